"""``HostMemory`` / ``lit_grpo.core.host_memory``: freed activations leave the process under a fixed mmap threshold,
where glibc's dynamic one keeps them in the heap (measured in fresh processes: the setting is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from lit_grpo.callbacks import HostMemory

from lit_grpo.core import host_memory
from tests.cli_runner import refusal_line

GLIBC = host_memory.glibc() is not None

# Free a 16 MiB block first (glibc's dynamic threshold rises to it), then fill 60 tensors of 8 MiB, free all but the
# last (it keeps the heap's top from being trimmed) and read what the process still holds.
RETAINED = """
import json, os, sys, torch
from lit_grpo.core.host_memory import fix_mmap_threshold

def rss_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

why_not = fix_mmap_threshold(int(sys.argv[1])) if sys.argv[1] != "glibc" else "glibc"
del_me = torch.ones(4 * 2**20)  # 16 MiB of float32
del del_me
before = rss_mib()
kept = [torch.ones(2 * 2**20) for _ in range(60)]  # 8 MiB each, written: resident
filled = rss_mib()
del kept[:-1]
print(json.dumps({"why_not": why_not, "grew": filled - before, "retained": rss_mib() - before}))
"""


def retained(setting: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", RETAINED, setting], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only (the setting does nothing elsewhere)")
def test_fixed_threshold_returns_freed_tensors_that_glibc_keeps() -> None:
    dynamic, fixed = retained("glibc"), retained("1024")
    assert dynamic["grew"] > 400 and fixed["grew"] > 400  # the 480 MiB were written in both
    assert dynamic["retained"] > 350, dynamic  # glibc's default: 59 freed tensors stay in the heap
    assert fixed["why_not"] is None and fixed["retained"] < 40, fixed  # only the one still alive


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_threshold_set_in_the_environment_is_kept() -> None:
    result = retained("1024", env={host_memory.ENV_VARIABLE: str(64 * 2**20)})
    assert result["why_not"] is not None and host_memory.ENV_VARIABLE in result["why_not"]
    assert result["retained"] > 350  # 64 MiB: the 8 MiB tensors are still served from the heap


@pytest.mark.parametrize("value", [-1, 32 * 1024 + 1, 1.5, True, "1024"])
def test_a_threshold_glibc_cannot_take_is_refused_in_one_line(value: object) -> None:
    with pytest.raises(ValueError, match=r"mmap_threshold_kb=.*expected a whole number of KiB from 0 to 32768"):
        HostMemory(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [None, 0, 1024, 32 * 1024])
def test_thresholds_glibc_takes_are_accepted(value: int | None) -> None:
    assert HostMemory(value).mmap_threshold_kb == value


def _trainer(device: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(strategy=types.SimpleNamespace(root_device=torch.device(device)))


def test_callback_applies_on_cpu_only_and_says_why_not(monkeypatch: pytest.MonkeyPatch) -> None:
    import lit_grpo.callbacks.host_memory as module

    calls: list[int] = []
    monkeypatch.setattr(module, "fix_mmap_threshold", lambda kb: calls.append(kb))
    callback = HostMemory(512)
    callback.setup(_trainer("cpu"), None, "fit")  # type: ignore[arg-type]
    assert calls == [512] and callback.applied is True
    callback.setup(_trainer("meta"), None, "fit")  # type: ignore[arg-type]  # not host memory: left alone
    assert calls == [512] and callback.applied is False
    HostMemory(None).setup(_trainer("cpu"), None, "fit")  # type: ignore[arg-type]
    assert calls == [512]
    monkeypatch.setattr(module, "fix_mmap_threshold", lambda kb: "the process's allocator is not glibc's malloc")
    said: list[str] = []
    monkeypatch.setattr(module, "rank_zero_info", said.append)
    callback.setup(_trainer("cpu"), None, "fit")  # type: ignore[arg-type]
    assert callback.applied is False
    assert said == ["host_memory.mmap_threshold_kb: not applied, the process's allocator is not glibc's malloc"]


def test_cli_refuses_a_bad_threshold_before_a_model_loads(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", "--trainer.max_steps", "1",
                         "--host_memory.mmap_threshold_kb", "99999"], tmp_path, monkeypatch, capsys)
    assert "mmap_threshold_kb=99999" in line and "32768" in line


def test_the_command_line_leaves_glibc_alone_unless_asked() -> None:
    from lit_grpo.cli.write_option_table import fit_parser

    parser = fit_parser()
    assert parser.get_defaults()["host_memory"]["mmap_threshold_kb"] is None  # opt-in: it costs page faults
    parsed = parser.parse_args(["--model.model_name", "tiny-random-llama", "--host_memory.mmap_threshold_kb", "1024"])
    assert parsed["host_memory"]["mmap_threshold_kb"] == 1024
