"""`python -m lit_grpo eval` and the training-time callback share one implementation: same numbers."""

import json
import subprocess
import sys

import pytest
from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import GSM8KPassAtK, WeightSync

from lit_grpo.cli.commands import main

# a judge with spread for a random model (GSM8K correctness would be 0 for both, proving nothing)
EVAL = dict(num_samples=4, ks=[1, 2], num_questions=3, max_new_tokens=8, temperature=1.0, system_prompt=None,
            judge="toy_rewards:has_digit")


def test_eval_command_on_a_checkpoint_equals_the_callback(tmp_path):
    callback = GSM8KPassAtK(every_n_optimizer_steps=None, at_end=True, **EVAL)
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(every_n_batches=1), callback])
    trainer.fit(tiny_module(lr=1e-2), datamodule=tiny_data())
    ckpt = tmp_path / "policy.ckpt"
    trainer.save_checkpoint(ckpt)
    out = tmp_path / "eval.json"
    main(["eval", "--ckpt", str(ckpt), "--num_questions", "3", "--num_samples", "4", "--ks", "1,2",
          "--max_new_tokens", "8", "--no_system_prompt", "--device", "cpu", "--output", str(out),
          "--judge", "toy_rewards:has_digit"])
    report = json.loads(out.read_text())
    expected = callback.history[-1]
    assert report["pass_at_k"]["1"] == pytest.approx(expected["pass@1"], abs=1e-12)
    assert report["pass_at_k"]["2"] == pytest.approx(expected["pass@2"], abs=1e-12)
    assert report["questions"] == 3
    assert 0 < expected["pass@1"] < 1


def test_eval_command_bad_value_is_one_line_and_status_2(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lit_grpo", "eval", "--model", "tiny-random-llama", "--ks", "1,x"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "1,x" in lines[0], proc.stderr
