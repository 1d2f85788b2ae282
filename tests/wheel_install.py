"""The wheel built from the tracked files, and a virtual environment with it installed, made once per test session
and shared by the tests of what a wheel user gets (test_wheel.py, test_wheel_user.py, test_checkout_shadowing.py):
each build or install costs tens of seconds on a small machine.

Both are made by README's own commands, read from its Install row of a wheel install (:func:`readme_wheel_commands`)
and run through bash as written, in a copy of the checkout: torch's CPU build, ``python -m pip wheel ...`` and
``pip install dist/...``. They run in a plain ``venv --system-site-packages`` whose ``python`` and ``pip`` come first
on PATH, and offline: pip's own environment variables turn the index and build isolation off
(:data:`PIP_OFFLINE`), so the dependencies, torch included, are found installed in this environment. What the
environment ends with is what a person who ran README's commands has: the wheel's ``python`` and ``lit-grpo``. The
editable install of this environment is hidden from it (see :data:`GUARD`)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: README's Install row of a wheel install, the commands these tests run
WHEEL_ROW = "| the package (a wheel), CPU |"
#: pip offline, by its own environment variables, so that README's commands run unchanged: no index (torch and the
#: dependencies are this environment's), and no build isolation (setuptools is this environment's; pip reads
#: PIP_NO_BUILD_ISOLATION inverted: "0" turns isolation off)
PIP_OFFLINE = {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
#: the venv's ``pip``: this environment's pip (seen through the system site-packages) run by the venv's python
PIP_SCRIPT = '#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n'

# Removes the editable install's import hook in the processes started from an installed copy: the hook finds a
# submodule of `lit_grpo` in the source tree whenever the installed copy lacks it (and maps `lit_grpo.callbacks` to
# the checkout's callbacks/), which would hide the very bugs these tests look for.
GUARD = '''import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
'''

_MADE: dict[str, Path] = {}  # what this session already built: "source", "bare venv", "wheel", "venv"


def readme_wheel_commands() -> tuple[str, str, str]:
    """The three commands of README's wheel row, in order: torch's CPU build, the wheel's build in a checkout, the
    install of the built file."""
    rows = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith(WHEEL_ROW)]
    assert len(rows) == 1, f"README.md should have one install row starting {WHEEL_ROW!r}, has {len(rows)}"
    commands = re.findall(r"`([^`]+)`", rows[0])
    assert len(commands) == 3, f"README's wheel row should give three commands (torch, build, install): {commands}"
    torch, build, install = commands
    return torch, build, install


def tracked_files() -> list[str]:
    """The tracked files present in the work tree, with their uncommitted edits (a file deleted but not yet
    ``git rm``-ed is left out, as a build from the work tree would)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def run(cmd: list[str] | str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` (a string: through the shell), failing the test with its output unless it exits with 0."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=kwargs.pop("timeout", 300), **kwargs)
    shown = cmd if isinstance(cmd, str) else " ".join(map(str, cmd))
    assert proc.returncode == 0, f"{shown} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc


def checkout_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's tracked files only: a stale build/ or *.egg-info of the checkout, or an untracked
    module, cannot leak into the wheel built from it. README's build command runs in it, as in a checkout."""
    if "source" not in _MADE:
        source = tmp_path_factory.mktemp("checkout") / "lit_grpo_checkout"
        for name in tracked_files():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
        _MADE["source"] = source
    return _MADE["source"]


def bare_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment over this one's packages (``--system-site-packages``), without the wheel yet: its
    ``bin/python``, a ``bin/pip`` (:data:`PIP_SCRIPT`) and the :data:`GUARD`."""
    if "bare venv" not in _MADE:
        venv = tmp_path_factory.mktemp("venv") / "env"
        # no pip of its own (ensurepip costs seconds): this environment's pip, seen through the system site-packages
        run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
        pip = venv / "bin" / "pip"
        pip.write_text(PIP_SCRIPT)
        pip.chmod(0o755)
        (site_packages(venv) / "sitecustomize.py").write_text(GUARD)
        _MADE["bare venv"] = venv
    return _MADE["bare venv"]


def readme_command(command: str, venv: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run one of README's commands through bash as written, with the venv first on PATH and pip offline."""
    return run(command, shell=True, executable="/bin/bash", cwd=cwd, env={**venv_env(venv), **PIP_OFFLINE},
               timeout=600)


def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel that README's commands build in :func:`checkout_copy` (after its torch command)."""
    if "wheel" not in _MADE:
        torch, build, _ = readme_wheel_commands()
        source, venv = checkout_copy(tmp_path_factory), bare_venv(tmp_path_factory)
        readme_command(torch, venv, source)
        readme_command(build, venv, source)
        (_MADE["wheel"],) = (source / "dist").glob("lit_grpo-*.whl")
    return _MADE["wheel"]


def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The virtual environment with :func:`built_wheel` installed by README's install command (``bin/python``,
    ``bin/lit-grpo``)."""
    if "venv" not in _MADE:
        built_wheel(tmp_path_factory)
        venv = bare_venv(tmp_path_factory)
        readme_command(readme_wheel_commands()[2], venv, checkout_copy(tmp_path_factory))
        _MADE["venv"] = venv
    return _MADE["venv"]


def site_packages(venv: Path) -> Path:
    """The venv's own site-packages, where the wheel is installed."""
    purelib = run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    return Path(purelib.stdout.strip())


def venv_env(venv: Path) -> dict[str, str]:
    """The environment of a process run as the wheel user: the venv's ``bin`` first on PATH (``python`` and
    ``lit-grpo`` are the venv's), offline, one thread per process."""
    env = dict(os.environ, PATH=os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
               VIRTUAL_ENV=str(venv), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    for name in ("PYTHONPATH", "PYTHONHOME", "LIT_GRPO_SERVER_TOKEN"):
        env.pop(name, None)
    return env
