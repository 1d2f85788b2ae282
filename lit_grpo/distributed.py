"""Process-group plumbing shared by the trainer, the data module and the callbacks (no Lightning, no math).

Everything here is a no-op in a single process, so the one-process path runs exactly as before. With more than
one process every function is a collective: all ranks must call it, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

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
    minimum, ``_max`` the maximum, every other key is summed (counts and sums, which merge exactly)."""
    keys = sorted(stats)
    values = {k: torch.as_tensor(stats[k], dtype=torch.float64).reshape(()) for k in keys}
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


def full_named_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsharded) parameters by their model names, one at a time.

    - FSDP2 (DTensor parameters): ``full_tensor()`` per parameter, an all-gather every rank runs together.
    - FSDP1: ``summon_full_params`` with ``writeback=False`` around the iteration.
    - Plain / DDP modules: the tensors themselves, no copy.
    """
    if is_fsdp1(module):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(module, writeback=False):
            for name, param in module.named_parameters():
                yield strip_wrapper_prefixes(name), param.detach()
        return
    for name, param in module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        yield strip_wrapper_prefixes(name), full.detach()


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
