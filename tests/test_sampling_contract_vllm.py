"""The sampling contract and the first-push check on the two vLLM engines, for real on the CPU build (the vLLM tier):
a model whose ``generation_config.json`` sets every sampling field (``tests/polluted_config.py``) is sampled from
``softmax(logits / T)`` all the same, and the check refuses a ``vllm serve`` without processed log-probs, a
generation config that reaches the sampler, and weights that are not the trainer's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from polluted_config import write_polluted_generation_config
from vllm_helpers import VLLMServe, mean_gap, perturbed, requires_vllm, save_model, tiny_vllm_llama

from lit_grpo.cli.plots import read_scalars
from lit_grpo.data.sampler_check import SamplerCheck, SamplerMismatchError
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.sampling_fields import vllm_sampling_fields
from lit_grpo.wire.protocol import NEUTRAL_SAMPLING_FIELDS

pytestmark = [pytest.mark.vllm, requires_vllm]

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72]]
#: the issue's bar for float32: the sampler's log-probs are the trainer's teacher-forced ones
MAX_MEAN_GAP = 1e-4


def test_the_neutral_values_are_vllms_own_defaults():
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    # what vLLM uses when neither the request nor the generation config says (a pydantic private attribute)
    defaults = CompletionRequest._DEFAULT_SAMPLING_PARAMS
    defaults = getattr(defaults, "default", defaults)
    fields = vllm_sampling_fields(SamplingConfig())
    assert set(defaults) <= set(fields)
    assert {k: defaults[k] for k in NEUTRAL_SAMPLING_FIELDS} == NEUTRAL_SAMPLING_FIELDS


@pytest.fixture(scope="module")
def polluted_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("polluted_serve")
    model_dir = save_model(root / "tiny")
    write_polluted_generation_config(model_dir)
    server = VLLMServe(model_dir, root / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def serve_client(server: VLLMServe, model):  # noqa: ANN001, ANN201
    from lit_grpo.engines.remote.client import ServerEngine

    return ServerEngine(url=server.url, kind="vllm", backend="gloo", dtype="float32", policy=model, timeout_s=120,
                        token=server.token)


def check(model, groups, temperature: float):  # noqa: ANN001, ANN201
    return SamplerCheck()(model, PROMPTS, groups, temperature, torch.device("cpu"), "vllm serve", nullcontext)


def test_vllm_serve_samples_the_contract_under_a_polluted_generation_config(polluted_server, monkeypatch):
    model, _ = tiny_vllm_llama()
    engine = serve_client(polluted_server, model)
    try:
        engine.load_weights(model.named_parameters(), step=1)
        sampling = SamplingConfig(max_new_tokens=16, temperature=0.8)
        groups = engine.generate(PROMPTS, 4, sampling, seed=3)
        gap = mean_gap(model, PROMPTS, groups, temperature=0.8)
        print(f"vllm serve, polluted generation config: mean gap {gap:.2e}")
        assert gap <= MAX_MEAN_GAP
        assert max(len(c.token_ids) for g in groups for c in g) > 2  # its max_new_tokens=2 did not apply
        assert check(model, groups, 0.8).mean_gap <= MAX_MEAN_GAP

        # the request as it was before the contract (temperature, top_p, max_tokens only): vLLM fills the rest
        # from the generation config, and the first-push check refuses what it then samples
        from lit_grpo.engines.remote import client

        monkeypatch.setattr(client, "vllm_sampling_fields", lambda s: {
            "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_new_tokens})
        leaked = engine.generate(PROMPTS, 4, sampling, seed=3)
        print(f"vllm serve, fields left to the generation config: mean gap {mean_gap(model, PROMPTS, leaked, 0.8):.2f}")
        assert mean_gap(model, PROMPTS, leaked, temperature=0.8) > 0.1
        with pytest.raises(SamplerMismatchError, match="generation config"):
            check(model, leaked, 0.8)
    finally:
        engine.close()


def test_first_push_check_refuses_weights_that_are_not_the_trainers(polluted_server):
    model, _ = tiny_vllm_llama()
    engine = serve_client(polluted_server, model)
    try:
        engine.load_weights(model.named_parameters(), step=2)
        groups = engine.generate(PROMPTS, 4, SamplingConfig(max_new_tokens=16), seed=5)
    finally:
        engine.close()
    trainer_policy = perturbed(tiny_vllm_llama()[0], scale=0.3, seed=1)  # another model than the one served
    with pytest.raises(SamplerMismatchError, match="same model"):
        check(trainer_policy, groups, 1.0)


def test_first_push_check_refuses_a_server_without_processed_logprobs(tmp_path):
    model_dir = save_model(tmp_path / "tiny")
    server = VLLMServe(model_dir, tmp_path / "serve.log", extra=("--logprobs-mode", "raw_logprobs"))
    model, _ = tiny_vllm_llama()
    try:
        server.wait_ready()
        engine = serve_client(server, model)
        try:
            engine.load_weights(model.named_parameters(), step=1)
            groups = engine.generate(PROMPTS, 4, SamplingConfig(max_new_tokens=16, temperature=0.5), seed=3)
        finally:
            engine.close()
        # through the command line: the fit stops at its first batch with one line, exit status 2
        options = dict(url=server.url, kind="vllm", backend="gloo", dtype="float32", timeout_s=120)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", LIT_GRPO_SERVER_TOKEN=server.token)
        proc = subprocess.run(
            [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
             "--model.model_name", str(model_dir), "--trainer.max_steps", "2", "--data.prompts_per_step", "4",
             "--data.temperature", "0.5", "--data.engine", "server", "--data.engine_options", json.dumps(options),
             "--eval.at_start", "false", "--eval.at_end", "false", "--eval.every_n_optimizer_steps", "null"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        )
    finally:
        server.stop()
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the rollout engine (vllm serve at ") and "processed_logprobs" in last
    assert "Traceback" not in proc.stderr
    print(f"vllm serve with raw_logprobs at T = 0.5: mean gap {mean_gap(model, PROMPTS, groups, 0.5):.3f}")
    with pytest.raises(SamplerMismatchError, match="processed_logprobs"):
        check(model, groups, 0.5)


def test_colocated_fit_samples_the_contract_under_a_polluted_generation_config(tmp_path):
    """The demo's batch (16 prompts x 8) with the colocated engine on a model whose generation config sets every
    sampling field: the first-push check's gap (the teacher-forced comparison of the first batch) is the float32
    bar, logged at the first step only."""
    model_dir = save_model(tmp_path / "tiny")
    write_polluted_generation_config(model_dir)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    options = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True}
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         "--model.model_name", str(model_dir), "--trainer.max_steps", "2", "--data.engine", "vllm",
         "--data.engine_options", json.dumps(options), "--data.sampler_check_sequences", "16",
         "--eval.at_start", "false", "--eval.at_end", "false", "--eval.every_n_optimizer_steps", "null"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(tmp_path / "runs" / "demo_cpu")
    gaps = scalars["rollout/sampler_check_gap"]
    print(f"colocated vLLM, polluted generation config: first-push gap {gaps}")
    assert [step for step, _ in gaps] == [0] and gaps[0][1] <= MAX_MEAN_GAP
