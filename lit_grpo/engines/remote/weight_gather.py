"""Rank 0's gather of the full parameters for a weight push (``WeightPusher``): the FSDP2 shards travel point to
point to rank 0, one bucket at a time, instead of every rank all-gathering every parameter (``rank0_buckets``); a
receive buffer rank 0 keeps across pushes holds each bucket (``GatherBuffer``). Every function here is a collective
when a process group exists: all ranks call it, in the same order."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lit_grpo.core.distributed import (
    FullParameters,
    all_reduce,
    is_distributed,
    is_fsdp1,
    is_fsdp2,
    rank_and_world,
    strip_wrapper_prefixes,
)
from lit_grpo.wire.weight_transfer import bucket_spans


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
    for start, stop in bucket_spans(sizes, bucket_bytes):  # planned up front: every rank cuts the same buckets
        bucket = _gather_bucket(named[start:stop], p2p[start:stop], buffer, group, device)
        if bucket:
            yield bucket
