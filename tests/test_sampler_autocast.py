"""``sampler_autocast`` (``TransformersOptions``): the in-process engine samples under bf16 autocast while its
``score`` (alpha's recompute) keeps the caller's fp32, the CPU stand-in for a bf16 vLLM against an fp32 trainer: the
sampler's log-probs (mu) then differ measurably from the engine's fp32 recompute of the same tokens, and agree with
it to float rounding when the option is off."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.core.option_groups import plain
from lit_grpo.data.rollout import pad_rollouts
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.options import TransformersOptions, engine_options
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer

SAMPLING = SamplingConfig(max_new_tokens=12, temperature=1.0)
TEXTS = ("What is 2+2?", "Name a prime.")


def mu_minus_alpha(sampler_autocast: str | None) -> float:
    """Mean |mu - score| over the completion tokens, with the engine built from ``data.engine_options``."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    options = engine_options("transformers", {"sampler_autocast": sampler_autocast, "decode": "dynamic"})
    kwargs = {k: v for k, v in plain(options).items() if k != "weights"}  # the fit's to decide (engine_setup)
    engine = TransformersEngine(policy, eos_token_ids(tokenizer, policy), tokenizer.pad_token_id, **kwargs)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    groups = engine.generate(prompts, 4, SAMPLING, seed=3)
    padded = pad_rollouts(prompts, groups, tokenizer.pad_token_id, 4)
    alpha = engine.score(padded, SAMPLING.temperature)  # no autocast around it: the trainer's fp32
    assert alpha.dtype == torch.float32
    mask = padded.completion_mask.bool()
    return float((padded.sampler_logp - alpha)[mask].abs().mean())


def test_bf16_sampling_gives_a_measurable_gap_and_fp32_sampling_none():
    gap = mu_minus_alpha("bf16")
    assert gap > 1e-4, gap  # mu from the bf16 pass, alpha from the fp32 one
    assert mu_minus_alpha(None) < 1e-5  # the same function of the same weights: float rounding only


def test_score_ignores_the_samplers_autocast():
    """The option changes sampling only: the recompute of given tokens is the same with and without it."""
    policy, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    eos, pad = eos_token_ids(tokenizer, policy), tokenizer.pad_token_id
    prompts = [tokenizer.encode(t) for t in TEXTS]
    lowered = TransformersEngine(policy, eos, pad, sampler_autocast="bf16", decode="dynamic")
    padded = pad_rollouts(prompts, lowered.generate(prompts, 2, SAMPLING, seed=1), pad, 4)
    fp32 = TransformersEngine(policy, eos, pad, decode="dynamic")
    assert torch.equal(lowered.score(padded, 1.0), fp32.score(padded, 1.0))


def test_a_bad_value_is_refused_in_one_line():
    for bad in ("bf17", "bfloat16", 16):
        with pytest.raises(ValueError, match=r"^sampler_autocast must be one of \['bf16', 'fp16'\] or null, got "):
            TransformersOptions(sampler_autocast=bad)
    with pytest.raises(ValueError, match="sampler_autocast must be one of"):
        engine_options("transformers", {"sampler_autocast": "half"})
    with pytest.raises(ValueError, match="sampler_autocast must be one of"):
        TransformersEngine(torch.nn.Linear(2, 2), [0], 0, sampler_autocast="bf8")
    # the static path samples outside any autocast: refused, and ``auto`` takes the dynamic path
    with pytest.raises(ValueError, match="expected decode 'auto' or 'dynamic', got 'static'"):
        TransformersOptions(sampler_autocast="bf16", decode="static")
    with pytest.raises(ValueError, match="expected decode 'auto' or 'dynamic', got 'static'"):
        TransformersEngine(torch.nn.Linear(2, 2), [0], 0, sampler_autocast="bf16", decode="static")
    assert not TransformersEngine(torch.nn.Linear(2, 2), [0], 0, sampler_autocast="bf16").uses_static_decoding()


def test_the_recompute_of_alpha_follows_the_modules_head_chunks(monkeypatch):
    """The data module builds the engine with the module's ``head_chunk_mb``, and the engine's recompute runs the
    head in the same chunks as the trainer's pass (each chunk's sum is the trainer's, not the default budget's)."""
    from conftest import tiny_module

    import lit_grpo.core.scoring as scoring
    from lit_grpo.core.scoring import layout_logprobs
    from lit_grpo.data.engine_setup import build_rollout_engine

    module = tiny_module(head_chunk_mb=0.01)
    tokenizer = module.tokenizer
    engine = build_rollout_engine(TransformersOptions(decode="dynamic"), module, tokenizer, 0, False)
    assert engine.head_chunk_mb == 0.01
    prompts = [tokenizer.encode(t) for t in TEXTS]
    padded = pad_rollouts(prompts, engine.generate(prompts, 2, SAMPLING, seed=1), tokenizer.pad_token_id, 4)
    budgets = []
    original = scoring.completion_logprobs
    monkeypatch.setattr(scoring, "completion_logprobs",
                        lambda *a, **k: budgets.append(k.get("head_chunk_mb")) or original(*a, **k))
    alpha = engine.score(padded, 1.0)
    assert budgets and set(budgets) == {0.01}
    with torch.no_grad():
        trainer = layout_logprobs(engine.model, padded, 1.0, 0.01)
    assert torch.equal(alpha, trainer)
