"""docs/multi-process.md, "A rank that dies": a 2-rank DDP fit (gloo, CPU) under torchrun with ``--max-restarts 1``
and ``--ckpt_path last``, one rank killed with SIGKILL after the step-3 checkpoint, is restarted by torchrun (both
ranks), resumes from that checkpoint and logs the losses of the same fit never stopped.

The command line is the documented one: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` with the c10d rendezvous
(``--standalone``). With torchrun's default (the static rendezvous, ``--master-port``) or the c10d rendezvous sharing
its store, the workers' process group uses the agent's TCPStore, which outlives the workers and is never cleared:
after a restart it still holds the killed attempt's gloo addresses under the same keys, so a restarted rank that
reaches ``init_process_group`` some seconds before its peer (3 s passed, 8 s did not) connects to a dead port,
"Connection refused" after gloo's 3 retries, and torchrun, out of restarts, stops. The switch makes each rendezvous
round hand the workers a new port, where rank 0 starts a store of its own, empty."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume_last import SMALL, VERSIONS

from lit_grpo.cli.plots import read_series, version_dirs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo_cpu.yaml"
TAGS = ("train/loss", "train/kl", "rollout/reward_mean")
RESTORED = f"Restoring states from the checkpoint path at {VERSIONS / 'version_0' / 'checkpoints' / 'last.ckpt'}"


def _command(folder: Path) -> tuple[list[str], dict[str, str]]:
    (folder / "small.yaml").write_text(SMALL)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="INFO",  # LOGLEVEL: torchrun's agent says restarts
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    for name in ("LIT_GRPO_DEBUG", "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "-m", "lit_grpo", "fit", "--config", str(DEMO), "--config", "small.yaml",
            "--ckpt_path", "last", "--trainer.strategy", "ddp", "--trainer.devices", "2",
            "--trainer.enable_progress_bar", "false"], env


def _logged_steps(version: Path) -> list[int]:
    try:
        return [step for step, _ in read_series([version]).get(version.name, {}).get("train/loss", [])]
    except ValueError:  # no event file yet
        return []


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of the worker of global rank ``rank`` among the torchrun agent's children (their RANK variable),
    read from /proc."""
    children = " ".join(p.read_text() for p in Path(f"/proc/{agent}/task").glob("*/children"))
    for pid in map(int, children.split()):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


def test_torchrun_restarts_both_ranks_after_one_is_killed_and_the_fit_resumes_exactly(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    straight.mkdir(), killed.mkdir()
    command, env = _command(straight)
    first = subprocess.run(command, cwd=straight, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, (first.stdout + first.stderr)[-4000:]
    assert "Starting with 2 processes" in first.stdout + first.stderr

    command, env = _command(killed)
    version = killed / VERSIONS / "version_0"
    log_path = killed / "torchrun.log"
    with open(log_path, "w") as log:
        agent = subprocess.Popen(command, cwd=killed, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:  # rank 1 killed once step 3 is logged: after the step-3 checkpoint, before step 6's
            deadline = time.monotonic() + 400
            while 3 not in _logged_steps(version) and agent.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert agent.poll() is None, "the fit ended before a rank could be killed"
            assert (version / "checkpoints" / "epoch=0-step=3.ckpt").exists()
            victim = _rank_pid(agent.pid, 1)
            assert victim is not None, "no worker of rank 1 among torchrun's children"
            os.kill(victim, signal.SIGKILL)
            stopped_at = max(_logged_steps(version))
            agent.wait(timeout=600)
        finally:
            if agent.poll() is None:
                agent.kill()
    output = log_path.read_text()
    assert agent.returncode == 0, output[-4000:]
    assert stopped_at < 6  # the kill came before the step-6 checkpoint: the restart resumes the step-3 one
    # torchrun saw the worker die and started the group again; the second start read the step-3 checkpoint
    assert f"failed (exitcode: -9) local_rank: 1 (pid: {victim})" in output
    assert "Worker group FAILED. 1/1 attempts left; will restart worker group" in output
    assert output.count("ckpt_path last: no checkpoint") == 2  # both ranks of the first start, none of the second
    assert output.count(RESTORED) == 1  # rank 0 says it; last.ckpt was then the link to epoch=0-step=3.ckpt

    # one version, one continued line equal to the fit never stopped; the steps after the checkpoint ran twice
    assert version_dirs(killed / "runs") == [version]
    assert len(list(version.glob("events.out.tfevents.*"))) == 2
    expected, got = read_series([straight / "runs"])["runs"], read_series([killed / "runs"])["runs"]
    for tag in TAGS:
        assert [s for s, _ in got[tag]] == list(range(7)), tag
        assert got[tag] == expected[tag], tag
    assert any(value != 0.0 for _, value in got["train/loss"][3:])  # the comparison can fail
    assert sorted(p.name for p in (version / "checkpoints").glob("*.ckpt")) == ["epoch=0-step=6.ckpt", "last.ckpt"]
