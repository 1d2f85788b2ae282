"""Every test runs somewhere in CI: `.ci/run` runs README's test command (the default tier) and one pytest command
per marked tier that the default leaves out, and fails when any of them fails."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
#: tiers that need hardware CI does not have (CONTRIBUTING says where they run)
NOT_IN_CI = {"gpu"}


def pytest_commands() -> list[list[str]]:
    """The arguments of each ``run_tests ... -m pytest ...`` line of `.ci/run`, after ``pytest``."""
    commands = []
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["run_tests"] and "pytest" in words:
            commands.append(words[words.index("pytest") + 1:])
    return commands


def marker_of(args: list[str]) -> str | None:
    return args[args.index("-m") + 1] if "-m" in args else None


def test_ci_runs_readmes_test_command_and_every_tier():
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest -q" in readme
    commands = pytest_commands()
    assert [marker_of(args) for args in commands][0] is None, "the default tier (README's command) runs first"
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    tiers = {line.split(":")[0] for line in config["markers"]}
    run = {marker_of(args) for args in commands}
    assert tiers - NOT_IN_CI <= run, f"tiers no CI command runs: {sorted(tiers - NOT_IN_CI - run)}"
    # the default command leaves out exactly the tiers that run on their own
    default = re.search(r"-m '([^']*)'", config["addopts"]).group(1)
    assert default == "not slow" and "slow" in run


def test_ci_fails_when_a_tier_fails():
    text = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in text
    # run_tests returns pytest's status (and 1 for "no tests collected"), so `set -e` stops CI at the first failure
    body = re.search(r"run_tests\(\) \{(.*?)\n\}", text, re.S).group(1)
    assert 'return "$status"' in body and "-eq 5" in body
