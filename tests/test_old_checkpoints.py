"""Checkpoints written before the package moved into role folders (``lit_grpo.module`` became
``lit_grpo.training.module``, ...) still resume and export.

``tests/data/pre_layout/`` holds what the package wrote before the move (see its README): ``half.ckpt``, the
resume test's run stopped after step 3, and ``cli/last.ckpt``, written by ``python -m lit_grpo fit``, whose
hyperparameters the command line reads back. The old checkpoint must resume exactly as the same state saved by
today's package does. (Its steps 4 to 6 can no longer equal those the old package computed: the in-process engine
samples from another random stream since decoding frees finished slots.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DATA = Path(__file__).with_name("data") / "pre_layout"
ROOT = Path(__file__).resolve().parents[1]


def test_a_checkpoint_of_the_old_layout_resumes_to_the_same_steps(tmp_path):
    from resume_worker import run

    # the old checkpoint read by today's package and written again: its objects now pickled under today's paths
    resaved = tmp_path / "resaved.ckpt"
    torch.save(torch.load(DATA / "half.ckpt", map_location="cpu", weights_only=False), resaved)
    expected = run(6, str(tmp_path / "new"), ckpt_in=str(resaved))
    resumed = run(6, str(tmp_path / "old"), ckpt_in=str(DATA / "half.ckpt"))
    assert len(resumed) == len(expected) == 3
    assert len({round(s["train/loss"], 6) for s in expected}) > 1  # steps that moved
    for want, got in zip(expected, resumed):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.slow
def test_a_cli_checkpoint_of_the_old_layout_resumes_and_exports(tmp_path):
    ckpt = DATA / "cli" / "last.ckpt"
    fit = [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
           "--model.model_name", "tiny-random-llama", "--trainer.max_steps", "3", "--data.prompts_per_step", "2",
           "--eval.num_questions", "8", "--eval.every_n_optimizer_steps", "100", "--ckpt_path", str(ckpt),
           "--trainer.default_root_dir", str(tmp_path / "run")]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    done = subprocess.run(fit, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "`max_steps=3` reached" in done.stderr  # one step on top of the checkpoint's two
    exported = subprocess.run([sys.executable, "-m", "lit_grpo", "export", str(ckpt), str(tmp_path / "hf")],
                              cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert exported.returncode == 0, exported.stderr[-3000:]
    from transformers import AutoModelForCausalLM

    from lit_grpo.core.checkpoints import Checkpoint

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    state = Checkpoint(ckpt).tensors("policy.", like=model.state_dict())
    for name, tensor in model.state_dict().items():
        if name in state:
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
