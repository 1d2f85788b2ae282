"""The CPU commands of docs/vllm.md (colocated vLLM) and docs/rollout-server.md (``vllm serve``) run as written, at
the demo's batch size, for 1 step (the vLLM tier): the first batch, the first-push check and the push after the
update. Each fenced block that follows a ``<!-- vllm-tier: NAME -->`` line is read from the docs, so the docs cannot
drift from what runs. ``HOME`` is a folder of the module, where docs/vllm.md's export command (the first line of its
block, run once) writes the model both documents name under ``~/models``; each test runs in a folder of its own, and
the peak resident memory of each process tree is printed: the docs quote it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_helpers import requires_vllm

from lit_grpo.cli.plots import read_scalars

pytestmark = [pytest.mark.vllm, requires_vllm]

ROOT = Path(__file__).resolve().parents[1]
#: what the test adds to a documented ``fit``: 1 step, no held-out evaluation
SHORT = " --trainer.max_steps 1 --eval.at_start false --eval.at_end false --eval.every_n_optimizer_steps null"


def documented_block(doc: str, name: str) -> str:
    """The fenced block right after ``<!-- vllm-tier: name -->`` in ``docs/<doc>``, continuation lines joined."""
    text = (ROOT / "docs" / doc).read_text()
    match = re.search(rf"<!-- vllm-tier: {name} -->\n```bash\n(.*?)```", text, re.S)
    assert match, f"docs/{doc} has no block marked vllm-tier: {name}"
    return match.group(1).replace("\\\n", " ")


def shortened(block: str) -> str:
    """The block with every ``lit_grpo fit`` line cut to 1 step without evaluation."""
    return "\n".join(line + SHORT if "lit_grpo fit" in line else line for line in block.splitlines())


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def run_watched(script: str, cwd: Path, env: dict, timeout_s: float,
                side: subprocess.Popen | None = None) -> tuple[subprocess.CompletedProcess, int, int]:
    """Run ``script`` with bash; returns its result and the peak RSS of its tree and of ``side``'s tree."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak, side_peak = 0, 0
    deadline = time.monotonic() + timeout_s
    import threading

    out: dict[str, str] = {}
    reader = threading.Thread(target=lambda: out.update(zip(("stdout", "stderr"), proc.communicate())))
    reader.start()
    while reader.is_alive() and time.monotonic() < deadline:
        peak = max(peak, tree_rss(proc.pid))
        if side is not None:
            side_peak = max(side_peak, tree_rss(side.pid))
        reader.join(0.5)
    if reader.is_alive():
        proc.kill()
        reader.join()
    result = subprocess.CompletedProcess(script, proc.returncode, out.get("stdout", ""), out.get("stderr", ""))
    return result, peak, side_peak


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``(HOME, environment)`` after docs/vllm.md's export command, run as written in that HOME."""
    home = tmp_path_factory.mktemp("home")
    # `python` in the commands is this environment's, as in a shell where it is activated
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PATH=path)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the documented commands size vLLM's cache themselves
    env.pop("LIT_GRPO_CACHE", None)
    export = documented_block("vllm.md", "colocated").splitlines()[0]
    assert "lit_grpo export" in export, export
    setup = subprocess.run(["bash", "-c", export], cwd=home, env=env, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, setup.stderr[-3000:]
    return home, env


@pytest.fixture
def home(exported, tmp_path):
    """The test's folder, where the commands run (they name configs/ from the checkout), and the environment."""
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return tmp_path, exported[1]


def test_colocated_cpu_commands_of_docs_vllm_md(home):
    cwd, env = home
    _export, *fit = documented_block("vllm.md", "colocated").splitlines()  # the export: run by the fixture
    result, peak, _ = run_watched(shortened("\n".join(fit)), cwd, env, 1500)
    assert result.returncode == 0, result.stderr[-4000:]
    scalars = read_scalars(cwd / "runs" / "demo_cpu")
    assert len(scalars["train/loss"]) == 1
    assert scalars["sync/count"] == [(0, 1.0)]  # the update's weights were pushed to vLLM after the step
    gap = scalars["rollout/sampler_check_gap"]
    print(f"colocated vLLM, demo batch: peak RSS {peak / 2**30:.2f} GiB, first-push gap {gap}")
    assert [s for s, _ in gap] == [0] and gap[0][1] < 1e-4


def test_vllm_serve_cpu_commands_of_docs_rollout_server_md(home):
    cwd, env = home
    serve = documented_block("rollout-server.md", "serve")
    fit = documented_block("rollout-server.md", "serve-fit")
    token_line, *server_lines = [line for line in serve.splitlines() if line.strip()]
    assert token_line.startswith("export LIT_GRPO_SERVER_TOKEN=")
    token = subprocess.run(["bash", "-c", token_line + '\nprintf %s "$LIT_GRPO_SERVER_TOKEN"'], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert len(token) >= 32
    env = dict(env, LIT_GRPO_SERVER_TOKEN=token)  # the trainer's shell has the same token
    log = open(cwd / "serve.log", "w")
    server = subprocess.Popen(["bash", "-c", " ".join(server_lines)], cwd=cwd, env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, (cwd / "serve.log").read_text()[-4000:]
            try:
                urllib.request.urlopen("http://127.0.0.1:8000/health", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not answer within 600 s"
                time.sleep(2)
        result, trainer_peak, server_peak = run_watched(shortened(fit), cwd, env, 1500, side=server)
        assert result.returncode == 0, result.stderr[-4000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # bash and the server it started
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()
    scalars = read_scalars(cwd / "runs" / "demo_cpu")
    assert len(scalars["train/loss"]) == 1
    assert scalars["sync/count"] == [(0, 1.0)]  # the update's weights were pushed to vLLM after the step
    gap = scalars["rollout/sampler_check_gap"]
    print(f"vllm serve, demo batch: peak RSS trainer {trainer_peak / 2**30:.2f} GiB, server "
          f"{server_peak / 2**30:.2f} GiB, first-push gap {gap}")
    assert [s for s, _ in gap] == [0] and gap[0][1] < 1e-4
    assert "CPU Generator does not use offset" not in (cwd / "serve.log").read_text()
