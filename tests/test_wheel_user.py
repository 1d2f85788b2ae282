"""The README's commands for a wheel install, run as its user would: the wheel built and installed by README's own
Install commands (tests/wheel_install.py reads them from README and runs them), then, in that virtual environment
(not the editable checkout), from a folder that is not the checkout, with ``python`` and ``lit-grpo`` found on
PATH. The configs come from the package (``python -m lit_grpo configs demo_cpu > demo.yaml``), and the
demo trains from that file, made tiny by command-line overrides as tests/test_cli_demo.py makes it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from wheel_install import ROOT, readme_wheel_commands, run, venv_env, wheel_venv

from lit_grpo.cli.plots import read_scalars

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

# the demo in two steps on the untrained tiny model (the warm-started one costs minutes on first use), Pass@1 on
# 8 questions at the start and after step 2
TINY = ("--model.model_name tiny-random-llama --trainer.max_steps 2 --data.prompts_per_step 2 "
        "--eval.num_questions 8 --eval.every_n_optimizer_steps 2")


#: torch's CPU build, from PyTorch's CPU wheel index: from the default index a pinned torch is (on Linux) the CUDA
#: build, several GB of CUDA libraries a CPU never uses
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def section(text: str, heading: str) -> str:
    """The body of ``heading``'s section (up to the next heading of its level or above)."""
    level = heading.split()[0]
    return re.search(rf"^{re.escape(heading)}\n(.*?)(?=^#{{1,{len(level)}}} |\Z)", text, re.S | re.M).group(1)


def test_every_cpu_install_takes_torch_s_cpu_build_and_the_wheel_is_built_from_a_checkout():
    rows = [line for line in section((ROOT / "README.md").read_text(), "## Install").splitlines()
            if line.startswith("| ") and "CPU" in line.split("|")[1]]
    assert len(rows) == 3, rows  # the wheel, the checkout, CPU with vLLM
    for row in rows:
        first = re.findall(r"`([^`]+)`", row.split("|")[2])
        assert first and (first[0] == CPU_TORCH or first[0].startswith(CPU_TORCH + " && ")), row
    setup = section((ROOT / "CONTRIBUTING.md").read_text(), "## Set up")
    assert re.search(r"^```bash\n(.*?)\n", setup, re.M).group(1) == CPU_TORCH
    # the package is not on the index: the wheel row builds the wheel and installs the file that build writes
    torch, build, install = readme_wheel_commands()
    assert torch == CPU_TORCH
    assert build.startswith("python -m pip wheel ") and build.endswith(" -w dist .")
    assert install == "pip install dist/lit_grpo-*.whl"


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> dict:
    venv = wheel_venv(tmp_path_factory)
    return dict(env=venv_env(venv), venv=venv)


def shell(command: str, user: dict, cwd: Path, timeout: int = 300) -> str:
    """Run a README line through bash as the wheel user; it must exit with 0 and print no traceback."""
    proc = run(command, shell=True, executable="/bin/bash", cwd=cwd, env=user["env"], timeout=timeout)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return proc.stdout


def test_python_and_the_console_script_are_the_installed_ones(user):
    for program in ("python", "lit-grpo"):
        found = shutil.which(program, path=user["env"]["PATH"])
        assert found and Path(found).parent == user["venv"] / "bin", (program, found)


def test_the_readme_wheel_path_trains_the_demo_from_a_shipped_config(user, tmp_path):
    listing = shell("python -m lit_grpo configs", user, tmp_path)
    assert "demo_cpu" in listing and "gsm8k/v10_i1" in listing
    shell("python -m lit_grpo configs demo_cpu > demo.yaml", user, tmp_path)
    assert (tmp_path / "demo.yaml").read_text() == (ROOT / "configs" / "demo_cpu.yaml").read_text()
    shell(f"OMP_NUM_THREADS=1 python -m lit_grpo fit --config demo.yaml {TINY}", user, tmp_path, timeout=600)
    run_dir = tmp_path / "runs" / "demo_cpu"  # the config's relative paths land in the working directory
    scalars = read_scalars(run_dir)
    assert len(scalars["rollout/reward_mean"]) == 2
    assert [step for step, _ in scalars["eval/pass@1"]] == [0, 2]
    assert list(run_dir.rglob("last.ckpt"))


@pytest.mark.parametrize("command, expected", [
    ("python -m lit_grpo --help", "fit"),
    ("python -m lit_grpo eval --help", "--ckpt"),
    ("python -m lit_grpo export --help", "out_dir"),
    ("python -m lit_grpo configs --help", "--out"),
], ids=["help", "eval-help", "export-help", "configs-help"])
def test_a_readme_command_answers_from_the_wheel(user, tmp_path, command, expected):
    assert expected in shell(command, user, tmp_path)


def test_the_console_script_prints_the_same_config(user, tmp_path):
    assert shell("lit-grpo configs gsm8k/v10_i1.yaml", user, tmp_path) == \
        (ROOT / "configs" / "gsm8k" / "v10_i1.yaml").read_text()


def test_an_unknown_config_is_one_error_line(user, tmp_path):
    proc = run("python -m lit_grpo configs demo_gpu; test $? -eq 2", shell=True, executable="/bin/bash",
               cwd=tmp_path, env=user["env"])
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: unknown config 'demo_gpu'") and "demo_cpu" in line
