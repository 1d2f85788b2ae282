"""The on-/off-policy invariants of Table 1, checked on real fits of a tiny model."""

import torch
from conftest import recorded_steps, tiny_data, tiny_module, tiny_trainer
from handmade import handmade_batch, loss_and_grads, perturb, select_groups
from lit_grpo.callbacks import RefModelSwap, WeightSync

from lit_grpo.training.losses import GRPOOptions, LossOptions


def test_v1_i1_ratio_is_one_at_first_iteration_every_step(tmp_path, recorder):
    # the engine scores the completions itself: its synced copy must reproduce the policy exactly
    module, data = tiny_module(), tiny_data(reuse_policy_logprobs=False)
    trainer = tiny_trainer(tmp_path, max_steps=4, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=data)
    assert len(recorder.steps) == 4
    for step in recorder.steps:
        assert abs(step["train/ratio_first_iteration_min"] - 1.0) <= 1e-6
        assert abs(step["train/ratio_first_iteration_max"] - 1.0) <= 1e-6
        assert step["train/staleness"] == 0.0
    # same code, same shapes, same weights: in fact bit-for-bit
    assert all(s["train/ratio_first_iteration_max"] == 1.0 == s["train/ratio_first_iteration_min"]
               for s in recorder.steps)
    # the policy really moved, so a missed sync would have shown up as a ratio != 1
    assert recorder.steps[-1]["sync/count"] == 4.0  # one sync after every step


def test_v4_staleness_cycles_and_engine_weights_follow_syncs(tmp_path, recorder):
    module, data = tiny_module(), tiny_data()
    snapshots = []
    sync = WeightSync(every_n_batches=4)

    class CompareWeights(type(recorder)):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            engine = trainer.datamodule.rollout_engine
            same = all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), pl_module.policy.parameters()))
            snapshots.append((trainer.global_step, engine.synced_step, same))

    trainer = tiny_trainer(tmp_path, max_steps=9, callbacks=[sync, CompareWeights(), recorder])
    trainer.fit(module, datamodule=data)
    staleness = [s["train/staleness"] for s in recorder.steps]
    assert staleness == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    for global_step, synced_step, same in snapshots:
        assert same == (global_step == synced_step), (global_step, synced_step, same)
    assert [s for _, s, _ in snapshots] == [0, 0, 0, 4, 4, 4, 4, 8, 8]
    # between syncs the ratio at the first iteration is no longer 1: alpha lags pi
    lagged = [s for s in recorder.steps if s["train/staleness"] > 0]
    assert any(abs(s["train/ratio_first_iteration_max"] - 1.0) > 1e-4 for s in lagged)


def test_v1_i4_ratio_moves_after_first_iteration_and_clipping_fires(tmp_path, recorder):
    module = tiny_module(iterations_per_batch=4, lr=5e-3, loss_options=LossOptions(grpo=GRPOOptions(eps_low=0.01)))
    data = tiny_data()
    trainer = tiny_trainer(tmp_path, max_steps=8, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=data)
    assert len(recorder.steps) == 2  # 2 rollout batches x 4 optimizer steps
    for step in recorder.steps:
        assert abs(step["train/ratio_first_iteration_max"] - 1.0) <= 1e-6
        assert step["train/ratio_max"] > 1.0 + 1e-3 or step["train/ratio_min"] < 1.0 - 1e-3
        assert step["train/clip_low_fraction"] + step["train/clip_high_fraction"] > 0.0


def test_masking_drops_zero_variance_groups_from_loss_and_gradient_eq8():
    """Eq. 8 next to eq. 7 and the DAPO-style form on one batch: groups 0 and 2 have a reward spread, groups 1 and
    3 do not. Their advantage is 0, but pi != pi_ref (the reference is perturbed, beta > 0), so without the mask
    their KL term would still count."""
    rewards = [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.5, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    spread_groups, flat_groups = [0, 2], [1, 3]
    batch = handmade_batch(rewards, len(tiny_module().tokenizer))
    spread, spread_rows = select_groups(batch, spread_groups)
    # token_mean's denominator over the whole batch (eq. 7 and eq. 8) and over the spread groups' tokens only
    every_token = spread.completion_mask.float() / batch.completion_mask.sum()
    spread_tokens = spread.completion_mask.float() / spread.completion_mask.sum()
    assert spread.completion_mask.sum() < batch.completion_mask.sum()  # the two forms differ on this batch

    # eq. 8 as written: the batch's loss and gradient are those of the spread groups, each token weighing what it
    # weighs under eq. 7 (the flat groups' tokens stay in the denominator); the flat groups add nothing, KL included
    module = tiny_module(mask_zero_variance=True, beta=0.1)
    perturb(module.reference)
    full_loss, full_grads = loss_and_grads(module, batch, module.loss_weights(batch))
    alone_loss, alone_grads = loss_and_grads(module, spread, every_token)
    assert alone_loss != 0.0 and any(g.abs().max() > 0 for g in alone_grads.values())
    assert abs(full_loss - alone_loss) <= 1e-6 * abs(alone_loss)
    assert_grads_close(full_grads, alone_grads)

    # DAPO-style: the spread groups alone, normalised over their tokens only
    module = tiny_module(drop_zero_variance=True, beta=0.1)
    perturb(module.reference)
    full_loss, full_grads = loss_and_grads(module, batch, module.loss_weights(batch))
    alone_loss, alone_grads = loss_and_grads(module, spread, spread_tokens)
    assert abs(full_loss - alone_loss) <= 1e-6 * abs(alone_loss)
    assert_grads_close(full_grads, alone_grads)

    # masking off (eq. 7): the flat groups add their KL term, exactly the loss and gradient they have on their own
    module = tiny_module(mask_zero_variance=False, beta=0.1)
    perturb(module.reference)
    weights = module.loss_weights(batch)
    full_loss, full_grads = loss_and_grads(module, batch, weights)
    flat, flat_rows = select_groups(batch, flat_groups)
    spread_loss, spread_grads = loss_and_grads(module, spread, weights[spread_rows])
    flat_loss, flat_grads = loss_and_grads(module, flat, weights[flat_rows])
    assert flat_loss > 1e-4  # beta * KL(pi || pi_ref) > 0; the surrogate is 0 at A = 0
    assert abs(full_loss - (spread_loss + flat_loss)) <= 1e-6 * abs(full_loss)
    assert abs(full_loss - spread_loss) > 1e-4
    assert_grads_close(full_grads, {k: spread_grads[k] + flat_grads[k] for k in full_grads})
    assert max(float((full_grads[k] - spread_grads[k]).abs().max()) for k in full_grads) > 1e-5


def assert_grads_close(got: dict, expected: dict, rel: float = 1e-6) -> None:
    for name, g in expected.items():
        tol = rel * float(g.abs().max()) + 1e-12
        assert float((got[name] - g).abs().max()) <= tol, name


def test_kl_is_zero_right_after_ref_swap(tmp_path, recorder):
    module = tiny_module(beta=0.1, lr=1e-2)
    data = tiny_data(prompts_per_step=2, max_prompts=8)  # 4 batches per epoch
    swap = RefModelSwap(every_n_optimizer_steps=3)
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[WeightSync(every_n_batches=1), swap, recorder])
    trainer.fit(module, datamodule=data)
    kl = [s["train/kl"] for s in recorder.steps]
    assert kl[0] == 0.0  # reference == initial policy
    assert kl[1] > 0 and kl[2] > 0  # policy moved away from the reference
    assert kl[3] == 0.0  # swap happened at the end of step 3
    assert kl[4] > 0
    assert swap.swaps == 1


def test_reusing_policy_logprobs_when_in_sync_changes_nothing(tmp_path):
    """alpha = pi_k when the engine holds the current weights: skipping its scoring pass changes nothing."""
    runs = {reuse: recorded_steps(tmp_path / str(reuse), tiny_module(beta=0.1, lr=1e-2),
                                  tiny_data(reuse_policy_logprobs=reuse), max_steps=5, every_n_batches=2)
            for reuse in (False, True)}
    for a, b in zip(runs[False], runs[True]):
        for key in ("train/loss", "train/ratio_first_iteration_max", "train/ratio_first_iteration_min", "train/kl"):
            # the engine's no-grad pass and the policy's training pass agree to float rounding
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), key
    assert [s["train/staleness"] for s in runs[True]] == [0, 1, 0, 1, 0]


def test_failing_reward_scores_zero_is_counted_and_the_run_goes_on(tmp_path, recorder):
    data = tiny_data(rewards=["toy_rewards:flaky"], reward_timeout_s=2.0)
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(tiny_module(), datamodule=data)
    assert len(recorder.steps) == 3
    errors = [s["rollout/reward_errors"] for s in recorder.steps]
    assert errors[-1] > 0 and errors == sorted(errors)  # a running count


def test_exact_ref_ratio_with_lagging_engine_and_sample_reuse(tmp_path, recorder):
    module = tiny_module(loss_options=LossOptions(grpo=GRPOOptions(exact_ref_ratio=True, ratio_cap=5.0)),
                         iterations_per_batch=2, lr=5e-3)
    trainer = tiny_trainer(tmp_path, max_steps=6, callbacks=[WeightSync(every_n_batches=2), recorder])
    trainer.fit(module, datamodule=tiny_data())
    assert [s["train/staleness"] for s in recorder.steps] == [0, 2, 0]
    lagged = recorder.steps[1]
    assert abs(lagged["train/ratio_first_iteration_max"] - 1.0) > 1e-4  # alpha lags pi_k: r' != 1
    assert all(s["train/ratio_max"] <= 5.0 + 1e-6 for s in recorder.steps)
