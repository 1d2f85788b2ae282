"""The in-process engine with a LoRA policy (``model.lora``): it is an ``AdapterEngine``, takes the adapter only,
samples as the trainer's own function of the same weights, follows the trainer's merges (base hash equal), refuses an
update for another base without changing anything, and keeps what an exact resume needs."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.engines.base import AdapterEngine, AdapterUpdate, SamplingConfig
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer, tiny_llama
from lit_grpo.models.lora import (
    LoraArgs,
    adapter_parameters,
    adapter_update,
    apply_lora,
    base_hash,
    swap_reference_by_merge,
)

SAMPLING = SamplingConfig(max_new_tokens=8)
PROMPTS = [[3, 4, 5], [6, 7]]


def lora_policy(base_seed: int | None = None):
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    if base_seed is not None:
        model = tiny_llama(model.config.vocab_size, seed=base_seed)
    torch.manual_seed(0)
    return apply_lora(model, LoraArgs(r=2, alpha=4.0)), tokenizer


def train_adapter(policy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(policy):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))


def engine_of(policy, tokenizer, copy_weights: bool = True) -> TransformersEngine:
    return TransformersEngine(policy, eos_token_ids(tokenizer, policy), tokenizer.pad_token_id,
                              copy_weights=copy_weights, decode="dynamic")


def rollouts(engine: TransformersEngine, seed: int = 1):
    groups = engine.generate(PROMPTS, 2, SAMPLING, seed)
    return [[(c.token_ids, c.logprobs) for c in g] for g in groups]


def test_adapter_update_checks_its_fields_and_counts_its_bytes():
    a = {"x.lora_A.weight": torch.zeros(2, 3), "x.lora_B.weight": torch.zeros(4, 2, dtype=torch.bfloat16)}
    update = AdapterUpdate(spec={"r": 2}, merges=(dict(a),), adapter=a, base_hash=None, step=3)
    assert update.nbytes == 2 * (2 * 3 * 4 + 4 * 2 * 2)  # adapter and one merge: fp32 A, bf16 B
    with pytest.raises(ValueError, match="step must be an integer >= 0, got -1"):
        AdapterUpdate(spec={"r": 2}, merges=(), adapter=a, base_hash=None, step=-1)
    with pytest.raises(ValueError, match="merges must be a tuple"):
        AdapterUpdate(spec={"r": 2}, merges=[a], adapter=a, base_hash=None, step=0)
    with pytest.raises(ValueError, match=r"adapter\['x'\] is a list, expected a tensor"):
        AdapterUpdate(spec={"r": 2}, merges=(), adapter={"x": [1.0]}, base_hash=None, step=0)


def test_the_engine_takes_the_adapter_only_and_samples_as_the_trainer_across_merges():
    policy, tokenizer = lora_policy()
    engine = engine_of(policy, tokenizer)
    assert isinstance(engine, AdapterEngine) and engine.merges_applied == 0
    trainer_side = engine_of(policy, tokenizer, copy_weights=False)  # the trainer's function of its own weights
    train_adapter(policy, 1)
    before = rollouts(engine)  # the copy made now holds the policy as it is
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=True, step=1), step=1)
    assert engine.synced_step == 1 and rollouts(engine) == rollouts(trainer_side) == before
    train_adapter(policy, 2)
    assert rollouts(engine) != rollouts(trainer_side)  # lags until the next push
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=2), step=2)
    assert rollouts(engine) == rollouts(trainer_side)
    # two swaps while the engine lags: both merges come with the next push, applied in order
    swap_reference_by_merge(policy, [])
    train_adapter(policy, 3)
    swap_reference_by_merge(policy, [])
    train_adapter(policy, 4)
    update = adapter_update(policy, engine.merges_applied, with_hash=False, step=4)
    assert len(update.merges) == 2
    engine.load_adapter(update, step=4)
    assert engine.merges_applied == 2 and base_hash(engine.model) == base_hash(policy)
    assert rollouts(engine, 5) == rollouts(trainer_side, 5)


def test_a_copy_made_after_merges_starts_with_them_and_state_dict_resumes_exactly():
    policy, tokenizer = lora_policy()
    train_adapter(policy, 1)
    swap_reference_by_merge(policy, [])
    engine = engine_of(policy, tokenizer)
    assert engine.merges_applied == 1  # it copies the merged base: the next update carries no merge
    train_adapter(policy, 2)
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=True, step=3), step=3)
    state = engine.state_dict()
    swap_reference_by_merge(policy, [])  # the policy moves on; the restored engine must still lag as saved
    train_adapter(policy, 3)
    restored = engine_of(lora_policy()[0], tokenizer)  # another run's start: fresh base, no merges
    restored.load_state_dict(state, step=3)
    assert restored.merges_applied == 1 and rollouts(restored) == rollouts(engine)
    restored.load_adapter(adapter_update(policy, restored.merges_applied, with_hash=False, step=6), step=6)
    assert base_hash(restored.model) == base_hash(policy)
    assert rollouts(restored) == rollouts(engine_of(policy, tokenizer, copy_weights=False))


def test_an_update_for_another_base_is_refused_in_one_line_and_changes_nothing():
    policy, tokenizer = lora_policy()
    engine = engine_of(policy, tokenizer)
    engine.load_adapter(adapter_update(policy, 0, with_hash=True, step=1), step=1)
    held = rollouts(engine)
    other, _ = lora_policy(base_seed=1)
    train_adapter(other, 1)
    swap_reference_by_merge(other, [])  # a merge then a hash that this engine's base cannot reach
    with pytest.raises(ValueError, match="has hash .* the trainer's has") as caught:
        engine.load_adapter(adapter_update(other, 0, with_hash=True, step=2), step=2)
    assert "\n" not in str(caught.value)
    assert engine.merges_applied == 0 and engine.synced_step == 1 and rollouts(engine) == held
