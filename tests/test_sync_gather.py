"""``rank0_buckets`` (the weight push's gather to rank 0) with 2 real FSDP2 processes on gloo: rank 0's buckets
hold exactly the ``full_tensor()`` values of every parameter, in order, with dim-0 sizes that do not divide by the
world size (5 and 7 rows on 2 ranks, and 1 row: rank 1's shard is empty), for bucket sizes from one parameter per
bucket to one bucket for the model; the FSDP2 parameters travel point to point (no ``full_tensor()``), the others
(a replicated and a ``Shard(1)`` DTensor) are gathered as before; rank 1 gets nothing; the receive buffer is kept
across calls and a second call sees the updated weights.

This file is also the worker: ``python test_sync_gather.py OUT`` is one rank (the environment of an external
launcher: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). One launch of 2 processes, torch only (no Lightning).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BUCKET_SIZES = (1, 40, 200, 10**9)


def build_model():  # noqa: ANN201
    """FSDP2-sharded layers with uneven dim 0, plus DTensor parameters of two layouts FSDP2 does not make."""
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    sharded = nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 7), nn.Linear(7, 1), nn.Linear(1, 4))
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    other = nn.Module()
    other.replicated = nn.Parameter(distribute_tensor(torch.randn(3, 2), mesh, [Replicate()]))
    other.columns = nn.Parameter(distribute_tensor(torch.randn(2, 6), mesh, [Shard(1)]))
    root = nn.Module()
    root.sharded, root.other = sharded, other
    return root


FULL_TENSOR_CALLS = [0]


def count_full_tensor_calls() -> None:
    """Count ``DTensor.full_tensor`` calls (the per-parameter all-gathers the point-to-point path avoids)."""
    from torch.distributed.tensor import DTensor

    original = DTensor.full_tensor

    def full_tensor(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        FULL_TENSOR_CALLS[0] += 1
        return original(self, *args, **kwargs)

    DTensor.full_tensor = full_tensor


def compare(model, bucket_bytes: int, buffer) -> dict:  # noqa: ANN001
    """Rank 0's buckets against ``full_tensor()`` of every parameter (run on every rank: both are collectives)."""
    import torch

    from lit_grpo.core.distributed import full_named_parameters
    from lit_grpo.engines.remote.weight_gather import rank0_buckets

    expected = [(name, t.clone()) for name, t in full_named_parameters(model)]
    before = FULL_TENSOR_CALLS[0]
    buckets = [[(name, t.clone()) for name, t in bucket] for bucket in rank0_buckets(model, bucket_bytes, buffer)]
    got = [item for bucket in buckets for item in bucket]
    return {
        "buckets": len(buckets),
        "names": [n for n, _ in got] == [n for n, _ in expected],
        "equal": len(got) == len(expected) and all(torch.equal(a, b) and a.dtype == b.dtype
                                                    for (_, a), (_, b) in zip(got, expected)),
        "full_tensor_calls": FULL_TENSOR_CALLS[0] - before,
        "largest_bucket_bytes": max((sum(t.numel() * t.element_size() for _, t in b) for b in buckets), default=0),
    }


def worker(out: Path) -> None:
    import torch
    import torch.distributed as dist

    from lit_grpo.core.distributed import full_named_parameters
    from lit_grpo.engines.remote.weight_gather import GatherBuffer, fsdp2_source

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = build_model()
    count_full_tensor_calls()
    buffer = GatherBuffer()
    result = {"rank": dist.get_rank(), "runs": {str(b): compare(model, b, buffer) for b in BUCKET_SIZES}}
    pointer = buffer.memory.data_ptr() if buffer.memory is not None else None
    with torch.no_grad():  # the optimizer moves the weights: the next push must see the new ones
        for param in model.parameters():
            param.to_local().add_(1.0)
    result["after_update"] = compare(model, 10**9, buffer)
    result["buffer_kept"] = pointer is not None and buffer.memory.data_ptr() == pointer
    started = full_named_parameters(model)
    next(started)
    for _ in started:  # every rank ends the gathers it began
        pass
    result["source"] = [fsdp2_source(full_named_parameters(model)) is model, fsdp2_source(started) is None,
                        fsdp2_source(iter([])) is None, fsdp2_source(full_named_parameters(torch.nn.Linear(2, 2)))
                        is None]
    out.with_suffix(f".{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def launch(workdir: Path, world: int = 2, timeout_s: float = 180.0) -> list[dict]:
    """Start ``world`` copies of this file as ranks; kill them all if one fails or hangs."""
    from distributed_launch import run_script_ranks

    codes, logs = run_script_ranks(__file__, workdir, world, timeout_s)
    assert codes == [0] * world, f"exit codes {codes}\n{logs}"
    return [json.loads((workdir / f"out.{r}.json").read_text()) for r in range(world)]


def test_rank0_buckets_equal_full_tensor_for_every_parameter(tmp_path):
    rank0, rank1 = launch(tmp_path)
    parameters = 4 * 2 + 2  # 4 sharded layers (weight, bias), 2 DTensors of other layouts
    runs = {int(b): run for b, run in rank0["runs"].items()}
    for bucket_bytes, run in runs.items():
        assert run["names"] and run["equal"], (bucket_bytes, run)
        assert run["full_tensor_calls"] == 2, run  # only the 2 parameters FSDP2 did not shard
    assert runs[1]["buckets"] == parameters and runs[10**9]["buckets"] == 1
    assert 1 < runs[200]["buckets"] < runs[40]["buckets"] < parameters and runs[200]["largest_bucket_bytes"] <= 200
    for run in rank1["runs"].values():  # the other rank sends and gets nothing
        assert run["buckets"] == 0 and run["full_tensor_calls"] == 2
    assert rank0["after_update"]["equal"] and rank0["buffer_kept"]
    assert rank0["source"] == rank1["source"] == [True, True, True, True]


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
