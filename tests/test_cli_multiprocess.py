"""The user's path to several processes: the CPU example config through `python -m lit_grpo fit`, with
Lightning's own launcher starting the second process (tiny model, so it takes seconds)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("strategy", [[], ["--trainer.strategy", "ddp"]], ids=["fsdp2", "ddp"])
def test_cpu_example_config_trains_in_two_processes(tmp_path, strategy):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    args = [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "cpu_fsdp2.yaml"),
            "--model.model_name", "tiny-random-llama", "--data.max_new_tokens", "8", "--data.system_prompt", "null",
            "--data.rewards", "[toy_rewards:digit_fraction]", "--data.reward_weights", "null",
            "--data.max_prompts", "16", "--eval.num_questions", "3", "--trainer.max_steps", "3",
            "--trainer.default_root_dir", str(tmp_path / "run"), "--trainer.enable_progress_bar", "false", *strategy]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "Starting with 2 processes" in out
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in out
    assert list((tmp_path / "run").rglob("*.ckpt"))  # the checkpoint callback of the default trainer wrote one
