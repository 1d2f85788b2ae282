"""A checkout never shadows an installed copy into a traceback. After ``pip install .`` (not editable), running
``python -m lit_grpo`` inside the checkout imports the checkout's ``lit_grpo/`` (the working directory comes first
on ``sys.path``), where ``callbacks/`` and ``configs/`` are not subfolders: this used to end in
``ModuleNotFoundError: No module named 'lit_grpo.callbacks'``. The checkout's finder (``lit_grpo/_layout.py``)
finds both top-level folders instead. The checkout here is the copy of the tracked files the wheel was built in."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from wheel_install import checkout_copy, run, venv_env, wheel_venv

from lit_grpo._layout import CheckoutFolders

# where each package would be imported from (find_spec runs the import system's finders without running the
# module: callbacks/ would load torch and Lightning)
WHERE = '''import importlib.util, json
print(json.dumps({name: importlib.util.find_spec(name).origin
                  for name in ("lit_grpo", "lit_grpo.callbacks", "lit_grpo.configs")}))
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    venv = wheel_venv(tmp_path_factory)
    return dict(python=str(venv / "bin" / "python"), env=venv_env(venv), checkout=checkout_copy(tmp_path_factory))


def test_inside_the_checkout_the_checkout_is_imported(setup):
    """The premise: the installed copy is shadowed, and the two top-level folders come from the checkout."""
    proc = run([setup["python"], "-c", WHERE], cwd=setup["checkout"], env=setup["env"])
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    checkout = setup["checkout"].resolve()
    assert {name: Path(path).resolve() for name, path in where.items()} == {
        "lit_grpo": checkout / "lit_grpo" / "__init__.py", "lit_grpo.callbacks": checkout / "callbacks" / "__init__.py",
        "lit_grpo.configs": checkout / "configs" / "__init__.py"}


# `fit --help-all` imports the training CLI, hence lit_grpo.callbacks (the old traceback); `fit --help` is the short
# list; `configs` reads lit_grpo.configs
@pytest.mark.parametrize("command", [["--help"], ["fit", "--help"], ["fit", "--help-all"], ["configs"],
                                     ["configs", "demo_cpu"]], ids=" ".join)
def test_a_command_in_the_checkout_runs_without_a_traceback(setup, command):
    proc = run([setup["python"], "-m", "lit_grpo", *command], cwd=setup["checkout"], env=setup["env"])
    assert "Traceback" not in proc.stdout + proc.stderr
    if command == ["configs"]:
        assert "demo_cpu" in proc.stdout and "gsm8k/v10_i1" in proc.stdout
    elif command == ["configs", "demo_cpu"]:  # the checkout's own file
        assert proc.stdout == (setup["checkout"] / "configs" / "demo_cpu.yaml").read_text()
    elif command[0] == "fit":
        assert "--config" in proc.stdout and "--model.model_name" in proc.stdout
    else:
        assert "fit" in proc.stdout


def test_outside_the_checkout_the_installed_copy_is_imported(setup, tmp_path):
    proc = run([setup["python"], "-c", WHERE], cwd=tmp_path, env=setup["env"])
    where = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = Path(setup["env"]["VIRTUAL_ENV"]).resolve()
    assert all(Path(path).resolve().is_relative_to(venv) for path in where.values()), where


@pytest.mark.parametrize("checkout", [True, False], ids=["checkout", "site-packages"])
def test_the_checkout_finder_answers_in_a_checkout_only(tmp_path, checkout):
    """Beside an installed copy (site-packages) a top-level ``configs`` package is another distribution's."""
    for folder in ("callbacks", "configs"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    if checkout:
        (tmp_path / "pyproject.toml").write_text("")
    finder = CheckoutFolders(tmp_path)
    for name, folder in (("lit_grpo.callbacks", "callbacks"), ("lit_grpo.configs", "configs")):
        spec = finder.find_spec(name)
        assert (spec.origin if spec else None) == (str(tmp_path / folder / "__init__.py") if checkout else None)
    assert finder.find_spec("lit_grpo.data") is None and finder.find_spec("configs") is None


# imports the old path first, then changes an attribute of the new module and reloads it: a reload runs the module's
# code again, so the attribute is the module's own again (it used to stay changed: the old path's loader, which
# runs nothing, had taken the new module's spec)
RELOAD = '''import importlib, json, warnings
warnings.simplefilter("ignore", DeprecationWarning)
old = importlib.import_module("lit_grpo.import_paths")
new = importlib.import_module("lit_grpo.core.import_paths")
original = new.__doc__
new.__doc__ = "changed"
reloaded = importlib.reload(new)
print(json.dumps({"same": old is new, "reloaded_is_new": reloaded is new, "restored": new.__doc__ == original,
                  "spec": new.__spec__.name, "old_again": importlib.import_module("lit_grpo.import_paths") is new}))
'''


def test_a_reload_after_an_old_import_path_runs_the_new_module_again(tmp_path):
    proc = run([sys.executable, "-c", RELOAD], cwd=tmp_path)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "same": True, "reloaded_is_new": True, "restored": True, "spec": "lit_grpo.core.import_paths",
        "old_again": True}
