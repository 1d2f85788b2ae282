"""Process-group plumbing shared by the trainer, the data module and the callbacks (no Lightning, no math).

Everything here is a no-op in a single process, so the one-process path runs exactly as before. With more than
one process every function is a collective: all ranks must call it, in the same order.
"""

from __future__ import annotations

import atexit
import gc
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

# Prefixes that wrappers put in front of a model's own parameter names.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def is_distributed() -> bool:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _RAN_DISTRIBUTED[0] = True  # this process's groups are released at exit (release_process_groups)
        return True
    return False


def rank_and_world() -> tuple[int, int]:
    """``(global rank, world size)``; ``(0, 1)`` without a process group."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _collective_device() -> torch.device:
    # NCCL only reduces CUDA tensors; gloo reduces CPU tensors.
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce a tensor over all ranks (``sum``, ``min`` or ``max``) and return it on the tensor's own device.
    The tensor is not modified."""
    if not is_distributed():
        return tensor
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    if op not in ops:
        raise ValueError(f"unknown reduction {op!r}; expected one of {sorted(ops)}")
    work = tensor.detach().to(_collective_device(), copy=True)
    dist.all_reduce(work, op=ops[op])
    return work.to(tensor.device)


def everyone(flag: bool) -> bool:
    """True when ``flag`` is true on every rank (one collective per call in a process group)."""
    if not is_distributed():
        return flag
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0]), "min").item() > 0.5)


def all_gather_objects(obj: object) -> list[object]:
    """Each rank's ``obj``, in rank order (``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def strip_wrapper_prefixes(name: str) -> str:
    """The model's own parameter name, without FSDP1 / activation-checkpointing / compile / DDP prefixes."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_fsdp1(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel

    return isinstance(module, FullyShardedDataParallel)


def _full_named_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The gathers behind ``full_named_parameters`` (a generator, so that nothing runs before the first item)."""
    if is_fsdp1(module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module, writeback=False):
            for name, param in module.named_parameters():
                yield strip_wrapper_prefixes(name), param.detach()
        return
    for name, param in module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield strip_wrapper_prefixes(name), full.detach()


class FullParameters(Iterator[tuple[str, torch.Tensor]]):
    """The iterator ``full_named_parameters`` returns. It also names the module it walks (``module``), so that a
    consumer with a cheaper way to gather (the rollout server's push: ``rank0_buckets``, one point-to-point transfer
    per bucket instead of an all-gather per parameter) can take the module instead, as long as nothing has been
    iterated yet (``started``). Nothing is gathered before the first ``next``."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._items: Iterator[tuple[str, torch.Tensor]] | None = None

    @property
    def started(self) -> bool:
        """True once an item was asked for: from then on the gathers are under way and must be iterated to the end."""
        return self._items is not None

    def __iter__(self) -> FullParameters:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._items is None:
            self._items = _full_named_parameters(self.module)
        return next(self._items)


def full_named_parameters(module: nn.Module) -> FullParameters:
    """Full (unsharded) parameters by their model names, one at a time (lazily: nothing runs before the first item).

    - FSDP2 (DTensor parameters): ``full_tensor()`` per parameter, an all-gather every rank runs together.
    - FSDP1: ``summon_full_params`` with ``writeback=False`` around the iteration.
    - Plain / DDP modules: the tensors themselves, no copy.
    """
    return FullParameters(module)


def is_fsdp2(module: nn.Module) -> bool:
    """True when some parameter of ``module`` is a DTensor (``fully_shard``)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def is_sharded(module: nn.Module) -> bool:
    """FSDP2 (DTensor parameters) or FSDP1 (a wrapper whose parameters are flat shards): a model no rank holds
    whole, which only collectives can read in full."""
    return is_fsdp1(module) or is_fsdp2(module)


def decoder_layer_classes(model: nn.Module) -> tuple[type, ...]:
    """The repeated block classes of a Hugging Face model (``_no_split_modules``), the natural FSDP units."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    if not classes:
        raise ValueError(
            f"cannot shard {type(model).__name__}: it names no repeated blocks in `_no_split_modules` "
            f"({sorted(names) or 'empty'}); FSDP needs the decoder-layer class to wrap"
        )
    return tuple(classes)


def fully_shard_model(model: nn.Module, mesh: object) -> nn.Module:
    """FSDP2: shard each decoder layer, then the rest of the model, over ``mesh``. Policy and reference get the
    same layout, so a reference swap copies shard to shard."""
    from torch.distributed.fsdp import fully_shard

    layer_classes = decoder_layer_classes(model)
    for module in model.modules():
        if isinstance(module, layer_classes):
            fully_shard(module, mesh=mesh)
    # FSDP2 keeps the root's parameters gathered after a forward, expecting a backward; the reference never has
    # one, so ask the root to reshard like every other unit
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def fsdp1_wrap_model(model: nn.Module, device: torch.device) -> nn.Module:
    """FSDP1 (Lightning's ``FSDPStrategy``): wrap one model as its own root, decoder layers as units, so each of
    the trainer's forwards through it unshards what it needs."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model, auto_wrap_policy=ModuleWrapPolicy(set(decoder_layer_classes(model))),
        device_id=device.index if device.type == "cuda" else None, use_orig_params=True,
    )


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of a plain, DDP, FSDP1 or FSDP2 model (the norm spans every rank's shard)."""
    if is_fsdp1(model):
        return model.clip_grad_norm_(max_norm)
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def rank_slice(items: list, rank: int, world: int, per_rank: int) -> list:
    """Rank ``rank``'s contiguous share of a global batch of ``world * per_rank`` items."""
    return items[rank * per_rank : (rank + 1) * per_rank]


Reducer = Callable[[torch.Tensor], torch.Tensor]


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """``all_reduce(tensor, "sum")`` with the signature the pure math functions take for global totals."""
    return all_reduce(tensor, "sum")


def stack_to_host(values: list[torch.Tensor | float]) -> torch.Tensor:
    """``values`` (Python numbers and 0-d tensors on any devices) as one float64 vector on the host, with one
    device-to-host transfer per device instead of one ``float()`` (one host sync) per value."""
    out = torch.empty(len(values), dtype=torch.float64)
    by_device: dict[torch.device, list[int]] = {}
    numbers: list[int] = []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append(i)
        else:
            numbers.append(i)
    if numbers:
        out[numbers] = torch.tensor([float(values[i]) for i in numbers], dtype=torch.float64)
    for index in by_device.values():
        out[index] = torch.stack([values[i].detach().reshape(()).to(torch.float64) for i in index]).cpu()
    return out


def gradient_sync_paused(wrapper: nn.Module | None, policy: nn.Module) -> AbstractContextManager:
    """A context in which backward passes accumulate gradients on each rank instead of reducing them over ranks.

    Why: an optimizer step sums the gradients of several micro-batches, and the reduction over ranks is linear, so
    reducing once, in the last micro-batch's backward, gives the same gradient as reducing every micro-batch, with
    one gradient reduction per step instead of one per micro-batch. Run every micro-batch but the last inside it.

    - DDP: ``wrapper.no_sync()``, ``wrapper`` being the ``DistributedDataParallel`` around the trained module (the
      strategy's model). With manual optimization all backward passes of a step run inside one DDP forward, and
      Lightning prepares DDP's reducer before each backward only while ``require_backward_grad_sync`` is set,
      which ``no_sync`` clears; the first backward after it reduces the accumulated sum.
    - FSDP2 (``policy`` passed to ``fully_shard``): ``set_requires_gradient_sync(False)`` on the root, restored on
      exit; the unsharded gradients accumulate and the next synced backward reduce-scatters their sum.
    - FSDP1 (``policy`` its own ``FullyShardedDataParallel`` root): ``policy.no_sync()``.
    - One process, or a model none of these wrap: a context that does nothing.
    """
    if not is_distributed():
        return nullcontext()
    if isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
        return wrapper.no_sync()
    if is_fsdp1(policy):
        return policy.no_sync()
    from torch.distributed.fsdp import FSDPModule

    if isinstance(policy, FSDPModule):
        return _fsdp2_sync_paused(policy)
    return nullcontext()


@contextmanager
def _fsdp2_sync_paused(module: nn.Module) -> Iterator[None]:
    """FSDP2's counterpart of ``no_sync``: no reduce-scatter in the backward passes run inside."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


# ---- the end of a multi-process run -------------------------------------------------------------------------------
# Why this exists: gloo runs each collective on a worker thread of its process group, and that thread drops its
# reference to the finished work a moment after the caller's ``wait`` has returned. When that is the last reference
# to a tensor whose Python object is already gone, dropping it needs the GIL. A thread that gets the GIL once the
# interpreter has begun to finalize is ended (``pthread_exit``), and ending it inside that C++ destructor calls
# ``std::terminate``: "terminate called without an active exception", exit -6, after a run that finished. Lightning
# destroys its process group at exit for NCCL only, and nothing destroyed the weight push's group, so their worker
# threads lived into finalization. Destroying a gloo group waits for its queued work and joins its worker threads;
# done from ``atexit``, which runs before finalization begins, every work is released while the GIL can be taken.
# (``ProcessGroup.shutdown`` and ``abort`` leave gloo's threads running: only the group's destruction joins them.)

_EXIT_CLOSERS: list[weakref.WeakMethod] = []
#: whether ``is_distributed`` was ever true here: the groups may then outlive ``destroy_process_group`` in garbage
#: (a finished trainer's device mesh), which a collection at exit destroys
_RAN_DISTRIBUTED = [False]
#: seconds the release at exit leaves the GIL free after destroying the groups: time for a worker thread of a group
#: that is still alive to be scheduled and to release its last work on a loaded machine
EXIT_YIELD_S = 0.05


def close_at_exit(method: Callable[[], object]) -> None:
    """Call the bound ``method`` at the end of the process (:func:`release_process_groups`), before the
    ``torch.distributed`` groups are destroyed, unless its object is gone by then. For a process group made outside
    ``torch.distributed``'s registry (the weight push's): ``method`` drops the owner's references to it, which
    destroys it. Registering the same method again keeps one entry."""
    ref = weakref.WeakMethod(method)
    _EXIT_CLOSERS[:] = [r for r in _EXIT_CLOSERS if r() is not None and r != ref]
    _EXIT_CLOSERS.append(ref)


def release_process_groups() -> None:
    """Close what :func:`close_at_exit` registered (newest first), destroy every ``torch.distributed`` process
    group, then collect garbage, so that a group whose last reference sat in a finished trainer (its device mesh, in
    a reference cycle) is destroyed now too. Destroying a gloo group waits for the work queued on it and joins its
    worker threads. A group something still reachable holds lives on (a device mesh that DTensor's caches keep, as
    after an FSDP2 fit, or a module-level model's): the GIL is then given away for a moment, so that a worker thread
    of such a group still releasing its last work gets it before the interpreter finalizes. Runs by itself at a
    normal exit of any process that imported this module; a no-op when there is nothing to release."""
    closers = [method for method in (ref() for ref in reversed(_EXIT_CLOSERS)) if method is not None]
    _EXIT_CLOSERS.clear()
    for close in closers:
        try:
            close()
        except Exception as err:  # noqa: BLE001 (the other groups are still released)
            warnings.warn(f"releasing {close.__qualname__} at exit failed: {err}", stacklevel=2)
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        try:
            dist.destroy_process_group()
        except Exception as err:  # noqa: BLE001 (the garbage is still collected)
            warnings.warn(f"destroying the process groups at exit failed: {err}", stacklevel=2)
    if closers or initialized or _RAN_DISTRIBUTED[0]:
        gc.collect()
        time.sleep(EXIT_YIELD_S)


def _release_at_exit() -> None:
    # After an uncaught exception a peer may never join a collective still queued here, and destroying the group
    # would wait for it up to the group's timeout: such a process ends at once, as it did before.
    if getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None:
        return
    release_process_groups()


atexit.register(_release_at_exit)
