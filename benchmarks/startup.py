"""Seconds until ``python -m lit_grpo`` answers: ``fit --help``, a one-line refusal of a bad value, ``--help`` and
``configs``, each run several times in a fresh process (min and median), and where each one's import time goes.

A command that validates before it loads the training stack answers in a fraction of a second (an unknown
option, a value of the wrong type, a number a light rule refuses: ``lit_grpo/cli/early_checks.py``); one that goes
through LightningCLI pays for importing Lightning (which imports torch, torchmetrics and transformers) first, the
floor of every such command. The floor is measured too: ``import torch`` and ``import lightning.pytorch`` alone.

    python benchmarks/startup.py              # 3 runs per command, the 8 heaviest imports of each
    python benchmarks/startup.py --runs 5 --top 12

Prints a table of wall-clock seconds (run it on an otherwise idle machine), then, per command, the heaviest
top-level packages by cumulative import time from ``python -X importtime`` (a package's first import, with what it
imports; packages nest, so the rows overlap).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
_FIT = ["-m", "lit_grpo", "fit", "--config", "configs/demo_cpu.yaml"]
#: name -> the arguments after ``python``; run from the repository root (the config paths are relative to it)
COMMANDS: dict[str, list[str]] = {
    "fit --help": ["-m", "lit_grpo", "fit", "--help"],
    "refusal (--model.beta -1)": [*_FIT, "--model.beta", "-1"],
    "refusal (--data.num_generations 1)": [*_FIT, "--data.num_generations", "1"],
    "refusal (--trainer.max_steps ten)": [*_FIT, "--trainer.max_steps", "ten"],
    "refusal (--model.bta 0.1)": [*_FIT, "--model.bta", "0.1"],
    # checked only when its class is built: LightningCLI's (the floor below plus parsing)
    "refusal (--sync.every_n_batches 0)": [*_FIT, "--sync.every_n_batches", "0"],
    "--help": ["-m", "lit_grpo", "--help"],
    "configs": ["-m", "lit_grpo", "configs"],
    "floor: import torch": ["-c", "import torch"],
    "floor: import lightning.pytorch": ["-c", "import lightning.pytorch"],
}
_IMPORT_LINE = re.compile(r"^import time:\s*(\d+)\s*\|\s*(\d+)\s*\|(\s*)(\S+)")


def wall_seconds(args: list[str]) -> float:
    """Wall-clock seconds of one ``python ARGS`` in the repository root (its output discarded)."""
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False)
    return time.perf_counter() - start


def heaviest_imports(importtime: str, top: int) -> list[tuple[str, float]]:
    """The ``top`` top-level packages with the largest cumulative import time (seconds) in ``python -X
    importtime``'s report: for each package, its largest entry (its first import, which holds the rest)."""
    best: dict[str, int] = {}
    for line in importtime.splitlines():
        match = _IMPORT_LINE.match(line)
        if match:
            package = match.group(4).split(".")[0]
            best[package] = max(best.get(package, 0), int(match.group(2)))
    ranked = sorted(best.items(), key=lambda item: -item[1])[:top]
    return [(name, micros / 1e6) for name, micros in ranked]


def importtime_report(args: list[str]) -> str:
    """stderr of ``python -X importtime ARGS`` in the repository root."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=False)
    return proc.stderr


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs per command (default 3)")
    parser.add_argument("--top", type=int, default=8, help="heaviest imports shown per command (default 8)")
    args = parser.parse_args(argv)
    print(f"python {sys.version.split()[0]} on {sys.platform}; {args.runs} runs per command; wall-clock seconds")
    print(f"{'command':<38} {'min':>7} {'median':>7}")
    for name, command in COMMANDS.items():
        times = [wall_seconds(command) for _ in range(args.runs)]
        print(f"{name:<38} {min(times):>7.2f} {statistics.median(times):>7.2f}", flush=True)
    for name, command in COMMANDS.items():
        if name.startswith("floor"):
            continue
        print(f"\n{name}: heaviest imports (cumulative seconds)")
        for package, seconds in heaviest_imports(importtime_report(command), args.top):
            print(f"  {package:<28} {seconds:>6.2f}")


if __name__ == "__main__":
    main()
