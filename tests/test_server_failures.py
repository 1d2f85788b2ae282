"""A fit whose rollout server fails once it runs ends with one ``error:`` line and exit status 2, as a bad value does
(lit_grpo/cli/run_failures.py): a server killed mid-fit is named with the last checkpoint and the command that
resumes from it; a server that holds another model is named with both models. Real server and trainer processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_process import ServerProcess
from transformers import LlamaConfig, LlamaForCausalLM

from lit_grpo.models.loading import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SMALL = """
trainer:
  max_steps: 8
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args:
        save_last: link
        every_n_train_steps: 1
eval:
  at_start: false
  at_end: false
  every_n_optimizer_steps: null
model:
  model_name: tiny-random-llama
  log_completions_every_n_steps: null
data:
  prompts_per_step: 2
  num_generations: 2
  max_new_tokens: 4
"""
CHECKPOINTS = Path("runs") / "demo_cpu" / "tensorboard" / "version_0" / "checkpoints"


def fit(folder: Path, server: ServerProcess) -> subprocess.Popen:
    (folder / "small.yaml").write_text(SMALL)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("LIT_GRPO_DEBUG", None)
    options = json.dumps({"url": server.url, "token": server.token})
    command = [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
               "--config", "small.yaml", "--data.engine", "server", "--data.engine_options", options]
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def checkpoint_from_step(folder: Path, step: int) -> bool:
    """Whether ``folder`` holds a step checkpoint (``epoch=E-step=S.ckpt``) of step ``step`` or later."""
    return any(int(path.stem.rsplit("=", 1)[1]) >= step for path in folder.glob("epoch=*-step=*.ckpt"))


def error_lines(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr[-3000:]
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.slow
def test_a_server_killed_mid_fit_is_named_with_the_last_checkpoint_to_resume_from(tmp_path):
    server = ServerProcess(tmp_path / "server")
    try:
        server.wait_ready()
        proc = fit(tmp_path, server)
        deadline = time.monotonic() + 600
        # any checkpoint from step 2 on: ModelCheckpoint keeps only the newest, so step 2's own file lives for one
        # step only, which a poller on a loaded core can miss
        while not checkpoint_from_step(tmp_path / CHECKPOINTS, 2) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert proc.poll() is None, "the fit ended before the server could be killed"
    finally:
        server.kill()
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2, stderr[-3000:]
    (line,) = error_lines(stderr)
    assert line.startswith(f"error: rollout server {server.url} stopped answering at step ")
    assert "start it again and rerun this command with --ckpt_path last" in line
    assert f"from the last checkpoint, {CHECKPOINTS}/" in line and line.endswith(
        "(data.engine_options, on the command line)")


@pytest.mark.slow
def test_a_server_holding_another_model_is_named_with_both_models(tmp_path):
    other = tmp_path / "other_model"  # the tiny model's tokenizer, a wider MLP: the pushed weights cannot fit
    config = LlamaConfig(vocab_size=len(tiny_tokenizer()), hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    server = ServerProcess(tmp_path / "server", model=str(other))
    try:
        server.wait_ready()
        proc = fit(tmp_path, server)
        _, stderr = proc.communicate(timeout=600)
    finally:
        server.kill()
    assert proc.returncode == 2, stderr[-3000:]
    (line,) = error_lines(stderr)
    assert line.startswith(f"error: rollout server {server.url} holds model '{other}' and this run trains "
                           "'tiny-random-llama': it refused the run's weights")
    assert "start the server with --model tiny-random-llama" in line
