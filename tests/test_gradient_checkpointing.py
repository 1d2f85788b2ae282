"""`model.gradient_checkpointing: true` computes the same update as without it, and a fit runs with it."""

from conftest import recorded_steps, tiny_data, tiny_module
from handmade import handmade_batch, loss_and_grads, perturb

from lit_grpo.core.scoring import checkpointing_drops_cache


def test_checkpointing_gives_the_same_loss_and_gradients():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    results = {}
    for checkpointing in (False, True):
        module = tiny_module(gradient_checkpointing=checkpointing, beta=0.1)  # same seeded weights both times
        perturb(module.reference)  # KL > 0, so the reference's log-probs count in the loss
        # float64: the paths sum the shared prompt's gradient in different orders, which in float32 alone moves
        # gradients by ~5e-7 relative; transformers' RMSNorm still works in float32, leaving ~1e-7
        module.policy.double()
        module.reference.double()
        # the policy takes the cacheless path only when checkpointing; the frozen reference never checkpoints
        assert checkpointing_drops_cache(module.policy) == checkpointing
        assert not checkpointing_drops_cache(module.reference)
        batch = handmade_batch(rewards, len(module.tokenizer), micro_batch_size=8)  # micro-batches span groups
        results[checkpointing] = loss_and_grads(module, batch, module.loss_weights(batch))
    (loss, grads), (ckpt_loss, ckpt_grads) = results[False], results[True]
    assert loss != 0.0
    assert abs(ckpt_loss - loss) <= 1e-6 * abs(loss)
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, g in grads.items():
        assert float((ckpt_grads[name] - g).abs().max()) <= 1e-6 * float(g.abs().max()) + 1e-12, name


def test_fit_with_checkpointing_matches_fit_without(tmp_path):
    steps = {checkpointing: recorded_steps(tmp_path / str(checkpointing), tiny_module(
        gradient_checkpointing=checkpointing, beta=0.1, lr=1e-2), tiny_data(), max_steps=2)
        for checkpointing in (False, True)}
    assert len(steps[True]) == 2
    # same rollouts (the engine samples in eval mode either way), same loss at the first step
    first, ckpt_first = steps[False][0], steps[True][0]
    for key in ("train/loss", "train/entropy", "rollout/reward_mean"):
        assert abs(ckpt_first[key] - first[key]) <= 1e-6 * max(1.0, abs(first[key])), key
