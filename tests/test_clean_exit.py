"""A process that used the process groups of a multi-process run has joined every thread they started (gloo's
worker and I/O threads, the stores' threads) before its interpreter finalizes, and ends with exit status 0, also
when collectives are still queued on those groups as its script ends.

Why: gloo runs a collective on a worker thread of its group, which drops the finished work a moment after the
caller's ``wait`` returned. When that frees a tensor whose Python object is gone, the thread waits for the GIL; if
the interpreter has begun to finalize when the thread gets it, Python ends the thread inside that C++ destructor:
"terminate called without an active exception", exit -6, after complete results. ``lit_grpo.core.distributed`` releases
every group at exit, before the interpreter finalizes (destroying a gloo group waits for its queued work and joins
its threads), so no such thread is left; the last ``atexit`` handler of each rank counts the threads.

The groups are those of a run: the default group, a device mesh's subgroups (kept in a reference cycle, like a
finished trainer's) and the weight push's own group (``ServerConnection``; rank 1 stands in for the server). Rank 0
ends its script with one collective queued on each, which rank 1 joins only after rank 0 has begun to exit.

This file is also the worker: ``python test_clean_exit.py OUT`` is one rank (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT in the environment). One launch of 2 processes, torch and ``lit_grpo.engines.remote.connection`` only.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from pathlib import Path

#: rank 1 joins the collectives rank 0 left queued this long after rank 0 began to exit
JOIN_DELAY_S = 0.2
#: rank 1 fails after waiting this long for rank 0 to exit
WAIT_S = 60.0


def threads() -> int:
    """This process's threads (Python's and native ones)."""
    return len(os.listdir("/proc/self/task"))


class ThreadCount:
    """Writes ``{"before": ..., "at_exit": ...}`` to ``path`` from the last ``atexit`` handler (registered before
    torch and lit_grpo are imported): after every release at exit, before the interpreter finalizes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.before: int | None = None
        atexit.register(self.write)

    def write(self) -> None:
        self.path.write_text(json.dumps({"before": self.before, "at_exit": threads()}))


def worker(out: Path, count: ThreadCount) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_grpo.engines.remote.connection import ServerConnection
    from lit_grpo.wire.weight_transfer import open_group, open_store

    torch.set_num_threads(1)
    count.before = threads()
    dist.init_process_group("gloo")  # the default group, as Lightning's DDP and ModelParallelStrategy make it
    rank = dist.get_rank()
    # ModelParallelStrategy's mesh (data parallel x tensor parallel): process groups of its own
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    # the weight push's group, outside torch.distributed's registry: rank 0 is the trainer's side, rank 1 stands in
    # for the rollout server
    connection = ServerConnection("http://127.0.0.1:1", None, 30.0)
    port = [None]
    if rank == 0:
        store, listener = open_store("127.0.0.1", 30.0)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    if rank == 1:
        import datetime

        store, listener = dist.TCPStore("127.0.0.1", port[0], 2, False, datetime.timedelta(seconds=30)), None
    connection.attach_group(open_group(store, rank, 2, "gloo", 30.0, "127.0.0.1"), store, listener)

    groups = [dist.group.WORLD, mesh.get_group("data_parallel")]
    sums = []
    for group in groups:
        total = torch.ones(3)
        dist.all_reduce(total, group=group)
        sums.append(total.tolist())
    pushed = torch.full((3,), 7.0) if rank == 0 else torch.zeros(3)
    connection.group.broadcast(pushed, root=0).wait()
    out.with_suffix(f".{rank}.json").write_text(json.dumps({"sums": sums, "pushed": pushed.tolist()}))

    dist.barrier()
    flag = out.with_suffix(".exiting")
    if rank == 1:
        deadline = time.monotonic() + WAIT_S
        while not flag.exists():
            if time.monotonic() > deadline:
                raise SystemExit(f"rank 0 did not begin to exit within {WAIT_S:g} s")
            time.sleep(0.01)
        time.sleep(JOIN_DELAY_S)
    # one collective on each group, its tensor without a Python object: on rank 0 they are still queued at the end
    works = [dist.all_reduce(torch.ones(1000), group=group, async_op=True) for group in groups]
    works.append(connection.group.broadcast(torch.ones(1000), root=0))
    if rank == 1:
        for work in works:
            work.wait()
    finished_trainer = [mesh, connection]
    finished_trainer.append(finished_trainer)  # garbage in a reference cycle, as a Trainer is after its fit
    if rank == 0:
        atexit.register(flag.touch)  # registered last, so run first


def launch(workdir: Path, world: int = 2, timeout_s: float = 120.0) -> tuple[list[int | None], list[str]]:
    """Start ``world`` copies of this file as ranks and let each one end by itself (at most ``timeout_s``);
    their exit codes (``None``: killed at the timeout) and outputs."""
    from distributed_launch import start_script_ranks

    procs = start_script_ranks(__file__, workdir, world)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    codes = [p.poll() for p, _ in procs]
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
    return codes, [(workdir / f"rank{r}.log").read_text() for r in range(world)]


def test_ranks_exit_zero_with_collectives_left_to_gloo_at_the_end(tmp_path):
    codes, logs = launch(tmp_path)
    tails = "\n".join(f"--- rank {r} (exit {codes[r]}) ---\n{log[-3000:]}" for r, log in enumerate(logs))
    assert codes == [0, 0], tails
    assert not any("terminate called" in log for log in logs), tails
    for rank in range(2):  # the groups worked before the end
        result = json.loads((tmp_path / f"out.{rank}.json").read_text())
        assert result == {"sums": [[2.0] * 3, [2.0] * 3], "pushed": [7.0] * 3}, (rank, result)
    for rank in range(2):  # every thread the groups started was joined before the interpreter finalized
        count = json.loads((tmp_path / f"out.{rank}.threads.json").read_text())
        assert count["at_exit"] == count["before"], (rank, count)


if __name__ == "__main__":
    worker(Path(sys.argv[1]), ThreadCount(Path(sys.argv[1]).with_suffix(f".{os.environ['RANK']}.threads.json")))
