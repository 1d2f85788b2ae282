"""What a normal (non-editable) install gets: the wheel that README's commands build from the tracked files holds
exactly the package's tracked modules (``callbacks/`` as ``lit_grpo.callbacks``), its data assets and the shipped
configs (``configs/`` as ``lit_grpo.configs``), and the copy README's install command makes of it
imports every module, answers ``serve --help``, and serves and trains asynchronously on its own.

The rest of the suite runs against the editable install, whose import hook serves any module from the source tree,
so a module the wheel leaves out (a whole subpackage once was) goes unnoticed there. Here the expected files come
from ``git ls-files``, not from a list, so a module added or moved later is expected without an edit."""

from __future__ import annotations

import configparser
import csv
import json
import os
import select
import subprocess
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import READY
from wheel_install import built_wheel, run, site_packages, tracked_files, venv_env, wheel_venv

from lit_grpo.cli.commands import TOOLS

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

PACKAGE = "lit_grpo"
# where a tracked file lies in the checkout -> where it lies in the wheel (pyproject.toml's package-dir); a folder
# moved into lit_grpo/ simply stops matching its entry
INSTALLED_AS = {"lit_grpo/": "lit_grpo/", "callbacks/": "lit_grpo/callbacks/", "configs/": "lit_grpo/configs/"}
# package data (pyproject.toml's package-data): folder -> how the name of a tracked file under it that is installed
# ends ("": every file)
DATA = {"lit_grpo/data/assets/": "", "configs/": ".yaml"}

# imports the given modules and prints those of the package that were loaded from outside the installed copy
IMPORT_CHECK = '''import importlib, json, sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
for name in sys.argv[2:]:
    importlib.import_module(name)
where = {name: getattr(module, "__file__", None) or next(iter(getattr(module, "__path__", [])), "")
         for name, module in sys.modules.items() if name.split(".")[0] == "lit_grpo"}
outside = {name: path for name, path in sorted(where.items()) if not Path(path).resolve().is_relative_to(site)}
print(json.dumps({"lit_grpo": importlib.import_module("lit_grpo").__file__, "outside": outside}))
'''


def expected_wheel_files(tracked: list[str]) -> set[str]:
    """The package files the wheel must hold: every tracked module under a package folder, renamed as installed,
    and every tracked data file."""
    expected = set()
    for name in tracked:
        for source, target in INSTALLED_AS.items():
            if name.startswith(source) and (name.endswith(".py") or is_data(name)):
                expected.add(target + name[len(source):])
    return expected


def is_data(name: str) -> bool:
    return any(name.startswith(folder) and name.endswith(suffix) for folder, suffix in DATA.items())


def module_name(wheel_file: str) -> str:
    return wheel_file.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


@pytest.fixture(scope="module")
def tracked() -> list[str]:
    return tracked_files()


@pytest.fixture(scope="module")
def wheel(tracked, tmp_path_factory) -> Path:
    """The wheel README's commands build in a copy of the tracked files only (once a session: wheel_install.py)."""
    return built_wheel(tmp_path_factory)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Iterator[dict]:
    """The wheel installed by README's install command in a virtual environment (its dependencies come from this
    environment), the environment and working directory (not the checkout) of a process that must see that copy
    only, and a rollout server started from it: it loads the model while the import checks run."""
    venv = wheel_venv(tmp_path_factory)
    site, workdir = site_packages(venv), tmp_path_factory.mktemp("installed") / "work"
    workdir.mkdir()
    env, python = venv_env(venv), str(venv / "bin" / "python")
    token = workdir / "token"
    token.write_text(os.urandom(16).hex())
    token.chmod(0o600)
    server_log = workdir / "server.log"
    with open(server_log, "w") as log:
        server = subprocess.Popen(
            [python, "-m", "lit_grpo", "serve", "--model", "tiny-random-llama", "--port", "0",
             "--token-file", str(token), "--threads", "1", "--device", "cpu"],
            cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        yield dict(site=site, python=python, env=env, cwd=workdir, server=server, server_log=server_log, token=token)
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        server.stdout.close()


def test_the_wheel_holds_exactly_the_tracked_modules_and_data(wheel, tracked):
    expected = expected_wheel_files(tracked)
    # the expectation itself is not empty, and holds the module `python -m lit_grpo serve` runs
    assert f"{PACKAGE}/__init__.py" in expected
    assert TOOLS["serve"].replace(".", "/") + ".py" in expected
    # and the configs `python -m lit_grpo configs` prints, subfolders included
    assert {"lit_grpo/configs/__init__.py", "lit_grpo/configs/demo_cpu.yaml", "lit_grpo/configs/gsm8k/base.yaml",
            "lit_grpo/configs/rec/settings/mixed.yaml"} <= expected
    with zipfile.ZipFile(wheel) as archive:
        names = {name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
        top_level = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/top_level.txt")))
        entry_points = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")))
    assert not expected - names, f"missing from the wheel: {sorted(expected - names)}"
    assert not names - expected, f"in the wheel but not tracked under the package: {sorted(names - expected)}"
    assert top_level.decode().split() == [PACKAGE]  # no top-level callbacks, tests, benchmarks, experiments
    # every entry point (the console script, plugins) names a module the wheel holds
    parser = configparser.ConfigParser(delimiters=("=",))
    parser.read_string(entry_points.decode())
    targets = {value.split(":")[0].strip() for section in parser.sections() for value in parser[section].values()}
    modules = {module_name(name) for name in names if name.endswith(".py")}
    assert targets and not targets - modules, f"entry points name modules the wheel lacks: {sorted(targets - modules)}"


def test_the_installed_copy_imports_every_module_from_itself(installed, tracked):
    modules = sorted({module_name(f) for f in expected_wheel_files(tracked) if f.endswith(".py")})
    assert "lit_grpo.callbacks" in modules
    proc = run([installed["python"], "-c", IMPORT_CHECK, str(installed["site"]), *modules], env=installed["env"],
               cwd=installed["cwd"])
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(loaded["lit_grpo"]).resolve().is_relative_to(installed["site"].resolve()), loaded["lit_grpo"]
    assert loaded["outside"] == {}


def test_the_installed_serve_command_answers_help(installed):
    proc = run([installed["python"], "-m", "lit_grpo", "serve", "--help"], env=installed["env"], cwd=installed["cwd"])
    assert "--model" in proc.stdout and "--token-file" in proc.stdout


def test_the_installed_copy_serves_and_trains_asynchronously(installed):
    """A real ``serve`` process and a 2-step ``fit`` with ``data.engine: server`` and ``data.max_staleness: 1``,
    both from the installed copy: the second batch was generated while the first trained, one version behind."""
    workdir = installed["cwd"]
    url = wait_for_url(installed["server"], installed["server_log"], timeout_s=240.0)
    options = dict(url=url, token_file=str(installed["token"]), timeout_s=60)
    run([installed["python"], "-m", "lit_grpo", "fit", "--seed_everything", "0",
         "--model.model_name", "tiny-random-llama",
         "--data.engine", "server", "--data.engine_options", json.dumps(options), "--data.max_staleness", "1",
         "--data.prompts_per_step", "1", "--data.num_generations", "2", "--data.micro_batch_size", "2",
         "--data.max_new_tokens", "4", "--data.max_prompts", "4",
         "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.max_steps", "2",
         "--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", "logs",
         "--trainer.log_every_n_steps", "1", "--trainer.enable_checkpointing", "false",
         "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.default_root_dir", str(workdir)],
        env=installed["env"], cwd=workdir)
    (metrics,) = (workdir / "logs").rglob("metrics.csv")
    with open(metrics) as f:
        staleness = [float(row["train/staleness"]) for row in csv.DictReader(f) if row.get("train/staleness")]
    # K = 1, v = 1: the first batch comes from the starting weights, the second was sampled ahead, one step old
    assert staleness == [0.0, 1.0]


def wait_for_url(server: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The URL the server prints once it listens (``--port 0``: it picks the port)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited with {server.returncode}:\n{log.read_text()[-3000:]}")
        ready, _, _ = select.select([server.stdout], [], [], 0.5)
        if ready:
            match = READY.search(server.stdout.readline())
            if match:
                return match.group(1)
    raise AssertionError(f"the server did not start within {timeout_s} s:\n{log.read_text()[-3000:]}")
