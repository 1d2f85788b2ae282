"""Start N real processes of ``dist_worker.py`` the way torchrun would (environment variables, one process per
rank, gloo on 127.0.0.1) and collect their results. A rank that fails or hangs fails the launch: every process
is killed and the tail of each one's output is in the error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ports import free_port

WORKER = Path(__file__).with_name("dist_worker.py")


def start(jobs: list[dict], world: int, workdir: Path) -> tuple[list[subprocess.Popen], list]:
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / "jobs.json"
    spec.write_text(json.dumps([{**job, "world": world} for job in jobs]))
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   NODE_RANK="0", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec), str(workdir / "out")], env=env,
                                      cwd=WORKER.parent, stdout=log, stderr=subprocess.STDOUT))
    return procs, logs


def stop(procs: list[subprocess.Popen], logs: list) -> None:
    """Kill the processes still running and close the logs."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    for log in logs:
        log.close()


#: launches tried when the rendezvous port was taken before rank 0 bound it (another process's listener, picked in
#: the seconds the ranks take to import torch): the processes fail before their first job, so a retry is a clean start
ATTEMPTS = 3


def _port_was_taken(workdir: Path, world: int) -> bool:
    return any("EADDRINUSE" in (workdir / f"rank{r}.log").read_text() for r in range(world))


def launch(jobs: list[dict], world: int, workdir: Path, timeout_s: float = 300.0) -> list[list[dict]]:
    """Run ``jobs`` in ``world`` processes; returns each rank's list of job results, in rank order."""
    for attempt in range(ATTEMPTS):
        procs, logs = start(jobs, world, workdir)
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.poll() is None for p in procs):
                failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            stop(procs, logs)
        codes = [p.returncode for p in procs]
        if (hung or any(codes)) and attempt + 1 < ATTEMPTS and _port_was_taken(workdir, world):
            continue
        if hung or any(codes):
            tails = "\n".join(f"--- rank {r} (exit {codes[r]}) ---\n" + (workdir / f"rank{r}.log").read_text()[-3000:]
                              for r in range(world))
            raise AssertionError(f"multi-process run failed (hung ranks: {hung}, exit codes: {codes})\n{tails}")
        break
    return [json.loads((workdir / f"out.{r}.json").read_text()) for r in range(world)]


def launch_to_the_end(jobs: list[dict], world: int, workdir: Path, timeout_s: float) -> tuple[list, list[str], float]:
    """Run ``jobs`` and let every process end by itself (a failing rank does not stop the others): returns the exit
    codes (``None`` for a rank still running at ``timeout_s``, then killed), each rank's output, and the seconds
    until the last one ended."""
    for attempt in range(ATTEMPTS):
        procs, logs = start(jobs, world, workdir)
        begin = time.monotonic()
        while any(p.poll() is None for p in procs) and time.monotonic() - begin < timeout_s:
            if attempt + 1 < ATTEMPTS and any(p.poll() not in (None, 0) for p in procs) and _port_was_taken(
                    workdir, world):
                break
            time.sleep(0.2)
        elapsed = time.monotonic() - begin
        codes = [p.poll() for p in procs]
        stop(procs, logs)
        if attempt + 1 < ATTEMPTS and any(c not in (None, 0) for c in codes) and _port_was_taken(workdir, world):
            continue
        return codes, [(workdir / f"rank{r}.log").read_text() for r in range(world)], elapsed
    raise AssertionError("unreachable")


def assert_same_steps(expected: list[dict[str, float]], got: list[dict[str, float]], abs_tol: float = 1e-6) -> None:
    """Every logged number of every step equal within ``abs_tol``, on steps that moved (the loss changes and
    the KL term is live), so that equality is not that of a run that did nothing."""
    import pytest

    for want, have in zip(expected, got, strict=True):
        for key in want:
            assert have[key] == pytest.approx(want[key], abs=abs_tol), key
    assert len({round(s["train/loss"], 6) for s in expected}) > 1 and any(s["train/kl"] > 0 for s in expected)


def start_script_ranks(script: str, workdir, world: int) -> list:  # noqa: ANN001
    """Start ``world`` copies of ``script`` (argument: ``workdir/out``) as gloo ranks on 127.0.0.1, one thread
    each, their output in ``workdir/rank{r}.log``; ``[(process, log file)]``."""
    from pathlib import Path

    port, procs = free_port(), []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   RANK=str(rank), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        log = open(Path(workdir) / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, script, str(Path(workdir) / "out")], env=env, stdout=log,
                                       stderr=subprocess.STDOUT, cwd=Path(script).parent), log))
    return procs


def run_script_ranks(script: str, workdir, world: int, timeout_s: float) -> tuple[list, str]:  # noqa: ANN001
    """Run :func:`start_script_ranks` to the end: all ranks, or until one fails or ``timeout_s`` passes (then the
    rest are killed); ``(exit codes, the ranks' logs' last 3000 characters, each under a header)``."""
    procs = start_script_ranks(script, workdir, world)
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p, _ in procs):
            break
        time.sleep(0.1)
    for p, log in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
        log.close()
    logs = "\n".join(f"--- rank {r} ---\n{(Path(workdir) / f'rank{r}.log').read_text()[-3000:]}" for r in range(world))
    return [p.returncode for p, _ in procs], logs
