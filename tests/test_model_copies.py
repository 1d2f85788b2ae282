"""Frozen copies made without a second full copy on the host: values, independence, tied weights, and the
rollout engine's copy made on first use from where the policy is by then."""

import torch

from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.copies import frozen_copy, materialize, skeleton_copy
from lit_grpo.models.loading import tiny_llama, tiny_tokenizer


def tied_model() -> torch.nn.Module:
    model = tiny_llama(len(tiny_tokenizer()))
    model.lm_head.weight = model.model.embed_tokens.weight  # a tied model, as SmolLM2 and Qwen2.5-0.5B are
    return model


def test_frozen_copy_is_equal_independent_frozen_and_keeps_ties():
    model = tied_model()
    clone = frozen_copy(model)
    for (name, a), (_, b) in zip(model.named_parameters(), clone.named_parameters()):
        assert torch.equal(a, b), name
        assert a.data_ptr() != b.data_ptr() and not b.requires_grad
    assert clone.lm_head.weight is clone.model.embed_tokens.weight
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)
    assert not torch.equal(model.lm_head.weight, clone.lm_head.weight)
    ids = torch.tensor([[5, 6, 7]])
    assert torch.isfinite(clone(input_ids=ids).logits).all()


def test_skeleton_holds_no_parameter_memory_until_materialized():
    model = tied_model()
    skeleton = skeleton_copy(model)
    assert all(p.is_meta for p in skeleton.parameters())
    assert all(not b.is_meta for b in skeleton.buffers())  # rotary frequencies are real
    made = materialize(skeleton, "cpu")
    assert not any(p.is_meta for p in made.parameters())
    assert made.lm_head.weight is made.model.embed_tokens.weight


def test_engine_copies_the_policy_on_first_use_and_then_keeps_its_own_weights():
    tokenizer = tiny_tokenizer()
    policy = tiny_llama(len(tokenizer))
    engine = TransformersEngine(policy, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    assert engine._model is None  # nothing copied at construction
    engine.load_weights(policy.named_parameters(), step=0)
    mine = dict(engine.model.named_parameters())
    assert all(torch.equal(mine[n], p) and mine[n].data_ptr() != p.data_ptr() for n, p in policy.named_parameters())
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # training moves the policy; the engine lags until the next sync
    assert not torch.equal(next(engine.model.parameters()), next(policy.parameters()))


def test_load_from_checkpoint_restores_the_saved_reference(tmp_path):
    """pi_ref is made on first use; a state that holds it (after a stage swap it differs from the policy) must
    land in it, not be skipped while a fresh copy of the loaded policy takes its place."""
    from conftest import tiny_data, tiny_module, tiny_trainer
    from handmade import perturb
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.training.module import GRPOModule

    module = tiny_module(beta=0.1, lr=1e-2)
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync()])
    trainer.fit(module, datamodule=tiny_data())
    perturb(module.reference)
    trainer.save_checkpoint(tmp_path / "x.ckpt")
    loaded = GRPOModule.load_from_checkpoint(tmp_path / "x.ckpt")
    for a, b in zip(module.reference.parameters(), loaded.reference.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(loaded.policy.parameters(), loaded.reference.parameters()))
