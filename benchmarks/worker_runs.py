"""The parent/worker convention of the benchmarks that run each engine in a process of its own (a fresh process
per engine, so that one engine's start-up, threads and memory do not bleed into the next): the worker prints one
``RESULT {json}`` line, the parent runs it and reads that line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

PREFIX = "RESULT "


def report(result: dict[str, Any]) -> None:
    """The worker's side: print ``result`` as the one line the parent reads."""
    print(PREFIX + json.dumps(result), flush=True)


def run_worker(name: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The parent's side: run ``python <args>`` and return its result, or exit with its stderr's tail naming
    ``name`` when it failed or printed no result."""
    proc = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(PREFIX)]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(PREFIX):])
