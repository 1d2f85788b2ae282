"""Process-group plumbing shared by the trainer, the data module and the callbacks (no Lightning, no math).

Everything here is a no-op in a single process, so the one-process path runs exactly as before. With more than
one process every function is a collective: all ranks must call it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

# Prefixes that wrappers put in front of a model's own parameter names.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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


def reduce_stats(stats: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
    """Reduce a dict of scalar statistics over ranks in three collectives: keys ending in ``_min`` take the
    minimum, ``_max`` the maximum, every other key is summed (counts and sums, which merge exactly).

    Values may be Python numbers or 0-d tensors on any device; the result is float64 on the host. Device values
    come over in one transfer (:func:`stack_to_host`), so a trainer can keep its statistics on the device for a
    whole step and pay one host sync here, instead of one per value."""
    keys = sorted(stats)
    values = dict(zip(keys, stack_to_host([stats[k] for k in keys]).unbind()))
    if not is_distributed():
        return values
    out: dict[str, torch.Tensor] = {}
    for suffix, op in (("_min", "min"), ("_max", "max"), (None, "sum")):
        group = [k for k in keys if (k.endswith(suffix) if suffix else not k.endswith(("_min", "_max")))]
        if group:
            reduced = all_reduce(torch.stack([values[k] for k in group]), op)
            out.update(zip(group, reduced.unbind()))
    return out


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
    consumer with a cheaper way to gather (the rollout server's push: ``rank0_buckets``, one point-to-point
    transfer per bucket instead of an all-gather per parameter) can take the module instead, as long as nothing
    has been iterated yet (``started``). Nothing is gathered before the first ``next``."""

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


def fsdp2_source(named_tensors: object) -> nn.Module | None:
    """The FSDP2 module behind a ``full_named_parameters`` iterator that has not started, else ``None``: the
    tensors may then be gathered with ``rank0_buckets`` instead. Every rank gets the same answer for the same call
    (the layout is the same on every rank), so every rank takes the same path."""
    if isinstance(named_tensors, FullParameters) and not named_tensors.started and not is_fsdp1(named_tensors.module):
        return named_tensors.module if is_fsdp2(named_tensors.module) else None
    return None


def shard_rows(rows: int, shards: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of the rows that shard ``index`` of ``shards`` holds when ``rows`` are split like
    ``torch.chunk`` (DTensor's ``Shard(0)`` and FSDP2): chunks of ``ceil(rows / shards)``, the last ones shorter or
    empty."""
    chunk = -(-rows // shards)
    start = min(index * chunk, rows)
    return start, min(start + chunk, rows)


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[list[int]]:
    """Indices of consecutive items grouped into buckets of at most ``bucket_bytes`` (an item larger than that
    travels alone): the grouping of ``serving.weight_transfer.buckets``, computed up front so every rank agrees."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes!r}")
    plan: list[list[int]] = []
    size = 0
    for index, item in enumerate(sizes):
        if plan and plan[-1] and size + item <= bucket_bytes:
            plan[-1].append(index)
            size += item
        else:
            plan.append([index])
            size = item
    return plan


class GatherBuffer:
    """Rank 0's receive memory for ``rank0_buckets``, kept across syncs: fresh memory costs page faults about as
    slow as the copy on a CPU. One bucket of full tensors at a time lives in it."""

    def __init__(self) -> None:
        self.memory: torch.Tensor | None = None

    def get(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """``nbytes`` bytes (``uint8``) on ``device``, from the kept memory when it is large enough."""
        if self.memory is None or self.memory.numel() < nbytes or self.memory.device != device:
            self.memory = None  # free the old memory before taking the new
            self.memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self.memory[:nbytes]


def _aligned(offset: int, size: int) -> int:
    """``offset`` rounded up to a multiple of ``size``: a tensor viewed in a byte buffer must start aligned."""
    return -(-offset // size) * size


def _p2p_layout(param: torch.Tensor, mesh: object, device: torch.device) -> bool:
    """Can this parameter travel to rank 0 point to point? On ``mesh`` (1-D, every rank), one ``Shard(0)``
    placement (FSDP2's, possibly uneven), a contiguous local shard holding the rows ``shard_rows`` gives this
    rank, on ``device``, with a backend that sends it (gloo: CPU, NCCL: CUDA)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor) or param.device_mesh != mesh:
        return False
    placements = tuple(param.placements)
    if len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        return False
    local = param.to_local()
    start, stop = shard_rows(param.shape[0], mesh.size(), mesh.get_local_rank())
    backend = dist.get_backend(mesh.get_group())
    sends = "gloo" in backend if local.device.type == "cpu" else "nccl" in backend
    return (sends and local.device == device and local.is_contiguous()
            and tuple(local.shape) == (stop - start, *param.shape[1:]))


def _p2p_plan(params: list[torch.Tensor]) -> tuple[list[bool], object, torch.device | None]:
    """Which parameters go point to point (the same answer on every rank: one all-reduce of the flags), over which
    group (the first DTensor's mesh, when it is 1-D over every rank: FSDP2's training group) and on which
    device."""
    from torch.distributed.tensor import DTensor

    first = next((p for p in params if isinstance(p, DTensor)), None)
    if first is None or not is_distributed():
        return [False] * len(params), None, None
    mesh, device = first.device_mesh, first.to_local().device
    whole = mesh.ndim == 1 and mesh.size() == dist.get_world_size()
    flags = torch.tensor([1.0 if whole and _p2p_layout(p, mesh, device) else 0.0 for p in params])
    agreed = all_reduce(flags, "min") if flags.numel() else flags
    return [bool(f > 0.5) for f in agreed.tolist()], mesh.get_group() if whole else None, device


def _full_on_rank0(param: torch.Tensor, target: torch.Tensor, group: object, tag: int) -> list:
    """Rank 0's part for one parameter: its own rows copied into ``target`` (the full tensor's memory), a receive
    posted for every other rank's rows (``P2POp``s, empty shards skipped)."""
    mesh = param.device_mesh
    ranks = mesh.mesh.flatten().tolist()
    ops = []
    for index, rank in enumerate(ranks):
        start, stop = shard_rows(param.shape[0], len(ranks), index)
        if stop == start:
            continue
        if rank == dist.get_rank():
            target[start:stop].copy_(param.to_local())
        else:
            ops.append(dist.P2POp(dist.irecv, target[start:stop], peer=rank, group=group, tag=tag))
    return ops


def _gather_bucket(named: list[tuple[str, torch.Tensor]], p2p: list[bool], buffer: GatherBuffer, group: object,
                   device: torch.device | None) -> list[tuple[str, torch.Tensor]]:
    """One bucket: the other ranks send their shards to rank 0 (one batch of point-to-point transfers), rank 0
    rebuilds the full tensors back to back in ``buffer``; parameters of other layouts are gathered with
    ``full_tensor()`` (a collective, in the same order on every rank). Rank 0 gets the bucket, the others ``[]``."""
    rank, _ = rank_and_world()
    offsets, total = [], 0
    for (_, param), direct in zip(named, p2p):
        total = _aligned(total, param.element_size()) if direct else total
        offsets.append(total)
        total += param.numel() * param.element_size() if direct else 0
    memory = buffer.get(total, device) if rank == 0 and any(p2p) else None
    out, ops = [], []
    for tag, ((name, param), direct, offset) in enumerate(zip(named, p2p, offsets)):
        if not direct:
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            out.append((name, full.detach()))
        elif rank == 0:
            size = param.numel() * param.element_size()
            target = memory[offset : offset + size].view(param.dtype).view(param.shape)
            ops += _full_on_rank0(param, target, group, tag)
            out.append((name, target))
        elif param.to_local().numel():
            ops.append(dist.P2POp(dist.isend, param.to_local().detach(), peer=0, group=group, tag=tag))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()
    return out if rank == 0 else []


@torch.no_grad()
def rank0_buckets(module: nn.Module, bucket_bytes: int,
                  buffer: GatherBuffer | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full parameters by their model names, in buckets of at most ``bucket_bytes`` (a larger parameter travels
    alone), on rank 0 only: the other ranks send their FSDP2 shards point to point to rank 0 and yield nothing.

    Every rank must iterate it to the end, together (it is a collective). Rank 0 holds its own shards and one
    bucket: the bucket's tensors are views of ``buffer`` (kept across calls by the caller), valid until the next
    bucket is asked for; copy what you keep. FSDP2's ``Shard(0)`` parameters travel point to point; any other
    layout (plain, replicated, other placements) is gathered with ``full_tensor()``, exactly as
    ``full_named_parameters`` does. Without a process group this is ``full_named_parameters`` in buckets."""
    named = [(strip_wrapper_prefixes(name), param) for name, param in module.named_parameters()]
    p2p, group, device = _p2p_plan([param for _, param in named])
    buffer = buffer if buffer is not None else GatherBuffer()
    sizes = [param.numel() * param.element_size() for _, param in named]
    for indices in plan_buckets(sizes, bucket_bytes):
        bucket = _gather_bucket([named[i] for i in indices], [p2p[i] for i in indices], buffer, group, device)
        if bucket:
            yield bucket


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
