"""Bad input fails early with a message that names the value and what was expected."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TOY_REWARD, tiny_data, tiny_module
from lit_grpo.callbacks import GSM8KPassAtK, RefModelSwap, WeightSync

from lit_grpo.module import GRPOModule

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
    import lit_grpo.module as module

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
