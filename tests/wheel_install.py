"""The wheel built from the tracked files, and a virtual environment with it installed, made once per test session
and shared by the tests of what a wheel user gets (test_wheel.py, test_wheel_user.py, test_checkout_shadowing.py):
each build or install costs tens of seconds on a small machine.

The environment is a plain ``venv --system-site-packages`` (the dependencies come from this environment, offline)
with the wheel installed by ``pip install --no-deps``: its ``python`` and ``lit-grpo`` console script are what a
person who ran ``pip install lit_grpo`` gets. The editable install of this environment is hidden from it (see
:data:`GUARD`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Removes the editable install's import hook in the processes started from an installed copy: the hook finds a
# submodule of `lit_grpo` in the source tree whenever the installed copy lacks it (and maps `lit_grpo.callbacks` to
# the checkout's callbacks/), which would hide the very bugs these tests look for.
GUARD = '''import sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
'''

_MADE: dict[str, Path] = {}  # what this session already built: "source", "wheel", "venv"


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
    module, cannot leak into the wheel built from it. The wheel is built in it, as ``pip install .`` does."""
    if "source" not in _MADE:
        source = tmp_path_factory.mktemp("checkout") / "lit_grpo_checkout"
        for name in tracked_files():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
        _MADE["source"] = source
    return _MADE["source"]


def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of :func:`checkout_copy`. No build isolation: setuptools comes from this environment, offline."""
    if "wheel" not in _MADE:
        source = checkout_copy(tmp_path_factory)
        dist = tmp_path_factory.mktemp("dist")
        run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
             "--disable-pip-version-check", "--wheel-dir", str(dist), str(source)])
        (_MADE["wheel"],) = dist.glob("*.whl")
    return _MADE["wheel"]


def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with :func:`built_wheel` installed (``bin/python``, ``bin/lit-grpo``)."""
    if "venv" not in _MADE:
        wheel = built_wheel(tmp_path_factory)
        venv = tmp_path_factory.mktemp("venv") / "env"
        # no pip of its own: this environment's pip, seen through the system site-packages, installs into it
        run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)])
        python = venv / "bin" / "python"
        run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check",
             str(wheel)])
        purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout
        (Path(purelib.strip()) / "sitecustomize.py").write_text(GUARD)
        _MADE["venv"] = venv
    return _MADE["venv"]


def venv_env(venv: Path) -> dict[str, str]:
    """The environment of a process run as the wheel user: the venv's ``bin`` first on PATH (``python`` and
    ``lit-grpo`` are the venv's), offline, one thread per process."""
    env = dict(os.environ, PATH=os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]),
               VIRTUAL_ENV=str(venv), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    for name in ("PYTHONPATH", "PYTHONHOME", "LIT_GRPO_SERVER_TOKEN"):
        env.pop(name, None)
    return env
