"""The dependency floor that keeps known-bad Lightning releases out: 2.6.2 and 2.6.3 stole credentials when
imported (GHSA-w37p-236h-pfx3), and releases before 2.6.6 run code from a crafted checkpoint on load."""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MALICIOUS = {Version("2.6.2"), Version("2.6.3")}
FIXED = Version("2.6.6")


def lightning_requirement() -> Requirement:
    if sys.version_info < (3, 11):
        tomllib = pytest.importorskip("tomli")
    else:
        import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(dep) for dep in project["dependencies"] if Requirement(dep).name == "lightning"]
    assert len(found) == 1, project["dependencies"]
    return found[0]


def test_pyproject_requires_lightning_from_the_fixed_release():
    spec = lightning_requirement().specifier
    lower = [Version(s.version) for s in spec if s.operator in (">=", ">", "==")]
    assert lower and min(lower) >= FIXED, str(spec)
    assert not any(spec.contains(bad) for bad in MALICIOUS), str(spec)
    assert not spec.contains(Version("2.6.5")) and spec.contains(FIXED)


def test_installed_lightning_is_not_a_known_bad_release():
    installed = Version(version("lightning"))
    assert installed not in MALICIOUS, f"lightning {installed} is a malicious release (GHSA-w37p-236h-pfx3)"
    assert lightning_requirement().specifier.contains(installed), f"lightning {installed} is below the floor"
