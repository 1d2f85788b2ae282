"""Running the command line in the test's process and expecting a refusal: what the bad-input tests share."""

from __future__ import annotations

import sys

import pytest


def no_model(monkeypatch) -> None:  # noqa: ANN001
    """Loading a model fails the test from now on: the value had to be refused before."""
    import lit_grpo.training.module

    def refuse(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded before the value was checked")

    monkeypatch.setattr(lit_grpo.training.module, "load_model_and_tokenizer", refuse)


def one_line_error(args: list[str], capsys) -> str:  # noqa: ANN001
    """``python -m lit_grpo ARGS`` in this process: it must exit with status 2 after exactly one ``error: ...`` line
    on stderr, which is returned."""
    from lit_grpo.cli.commands import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def refusal_line(args: list[str], tmp_path, monkeypatch, capsys, may_load: bool = False) -> str:  # noqa: ANN001
    """:func:`one_line_error` run in ``tmp_path``, with no model loaded unless ``may_load``."""
    if not may_load:
        no_model(monkeypatch)
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])  # LightningCLI reads sys.argv too; keep pytest's out of it
    monkeypatch.delenv("LIT_GRPO_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    return one_line_error(args, capsys)


#: runs the dispatcher as `python -m lit_grpo` does, then reports the exit status and which of MODULES loaded
PROBE = """
import json, sys
from lit_grpo.cli.commands import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as exit_:
    code = exit_.code
print(json.dumps({"code": code, "loaded": [m for m in MODULES if m in sys.modules]}), file=sys.__stdout__)
"""


def probe(args: list[str], cwd, modules: tuple[str, ...], env: dict | None = None) -> tuple[dict, str, str]:  # noqa: ANN001
    """A command in a fresh process: ``({"code": exit status, "loaded": those of ``modules`` it imported}, the rest of
    its stdout, its stderr)``."""
    import json
    import subprocess

    source = PROBE.replace("MODULES", repr(tuple(modules)))
    proc = subprocess.run([sys.executable, "-c", source, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env=env)
    *out, last = proc.stdout.strip().splitlines()
    return json.loads(last), "\n".join(out), proc.stderr
