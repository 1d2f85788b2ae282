"""The on-/off-policy invariants of Table 1, checked on real fits of a tiny model."""

import torch

from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import RefModelSwap, WeightSync


def test_v1_i1_ratio_is_one_at_first_iteration_every_step(tmp_path, recorder):
    # the engine scores the completions itself: its synced copy must reproduce the policy exactly
    module, data = tiny_module(), tiny_data(reuse_policy_logprobs=False)
    trainer = tiny_trainer(tmp_path, max_steps=4, callbacks=[WeightSync(every_n_steps=1), recorder])
    trainer.fit(module, datamodule=data)
    assert len(recorder.steps) == 4
    for step in recorder.steps:
        assert abs(step["train/ratio_first_iteration_min"] - 1.0) <= 1e-6
        assert abs(step["train/ratio_first_iteration_max"] - 1.0) <= 1e-6
        assert step["train/staleness"] == 0.0
    # same code, same shapes, same weights: in fact bit-for-bit
    assert all(s["train/ratio_first_iteration_max"] == 1.0 == s["train/ratio_first_iteration_min"] for s in recorder.steps)
    # the policy really moved, so a missed sync would have shown up as a ratio != 1
    assert recorder.steps[-1]["sync/count"] == 4.0  # one sync after every step


def test_v4_staleness_cycles_and_engine_weights_follow_syncs(tmp_path, recorder):
    module, data = tiny_module(), tiny_data()
    snapshots = []
    sync = WeightSync(every_n_steps=4)

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
    module = tiny_module(iterations_per_batch=4, lr=5e-3, eps_low=0.01)
    data = tiny_data()
    trainer = tiny_trainer(tmp_path, max_steps=8, callbacks=[WeightSync(every_n_steps=1), recorder])
    trainer.fit(module, datamodule=data)
    assert len(recorder.steps) == 2  # 2 rollout batches x 4 optimizer steps
    for step in recorder.steps:
        assert abs(step["train/ratio_first_iteration_max"] - 1.0) <= 1e-6
        assert step["train/ratio_max"] > 1.0 + 1e-3 or step["train/ratio_min"] < 1.0 - 1e-3
        assert step["train/clip_low_fraction"] + step["train/clip_high_fraction"] > 0.0


def test_masking_equal_reward_groups_gives_zero_loss_and_gradient(tmp_path):
    module = tiny_module(mask_zero_variance=True, beta=0.1)
    # a random model never ends with '#### N': every group is all zeros
    data = tiny_data(rewards=["format"], reuse_policy_logprobs=False)
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.strategy.connect(module)
    data.trainer = trainer
    trainer.datamodule = data  # engine lookup through the trainer
    data.setup("fit")
    prompt_batch = next(iter(data.train_dataloader()))
    batch = data.rollout(prompt_batch)
    assert batch.group_mask.sum() == 0 and torch.all(batch.advantages == 0)
    weights = module.loss_weights(batch)
    from lit_grpo.math import grpo_loss
    from lit_grpo.scoring import completion_logprobs

    ref = module.reference_logprobs(list(batch.micro_batches()))
    total = torch.zeros(())
    for j, mb in enumerate(batch.micro_batches()):
        logp, _ = completion_logprobs(module.policy, mb, 1.0)
        loss, _ = grpo_loss(logp, mb.take(batch.alpha_logp), mb.take(batch.advantages), mb.take(weights),
                            mb.completion_mask, module.loss_config, ref_logp=ref[j])
        loss.backward()
        total = total + loss.detach()
    assert total.item() == 0.0
    grads = [p.grad for p in module.policy.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() and g.abs().max() == 0 for g in grads)


def test_kl_is_zero_right_after_ref_swap(tmp_path, recorder):
    module = tiny_module(beta=0.1, lr=1e-2)
    data = tiny_data(prompts_per_step=2, max_prompts=8)  # 4 batches per epoch
    swap = RefModelSwap(every_n_steps=3)
    trainer = tiny_trainer(tmp_path, max_steps=5, callbacks=[WeightSync(every_n_steps=1), swap, recorder])
    trainer.fit(module, datamodule=data)
    kl = [s["train/kl"] for s in recorder.steps]
    assert kl[0] == 0.0  # reference == initial policy
    assert kl[1] > 0 and kl[2] > 0  # policy moved away from the reference
    assert kl[3] == 0.0  # swap happened at the end of step 3
    assert kl[4] > 0
    assert swap.swaps == 1


def test_reusing_policy_logprobs_when_in_sync_changes_nothing(tmp_path):
    """alpha = pi_k when the engine holds the current weights: skipping its scoring pass changes nothing."""
    runs = {}
    for reuse in (False, True):
        recorder = MetricsRecorder()
        trainer = tiny_trainer(tmp_path / str(reuse), max_steps=5,
                               callbacks=[WeightSync(every_n_steps=2), recorder])
        trainer.fit(tiny_module(beta=0.1, lr=1e-2), datamodule=tiny_data(reuse_policy_logprobs=reuse))
        runs[reuse] = recorder.steps
    for a, b in zip(runs[False], runs[True]):
        for key in ("train/loss", "train/ratio_first_iteration_max", "train/ratio_first_iteration_min", "train/kl"):
            # the engine's no-grad pass and the policy's training pass agree to float rounding
            assert abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key])), key
    assert [s["train/staleness"] for s in runs[True]] == [0, 1, 0, 1, 0]


def test_failing_reward_scores_zero_is_counted_and_the_run_goes_on(tmp_path, recorder):
    data = tiny_data(rewards=["toy_rewards:flaky"], reward_timeout_s=2.0)
    trainer = tiny_trainer(tmp_path, max_steps=3, callbacks=[WeightSync(every_n_steps=1), recorder])
    trainer.fit(tiny_module(), datamodule=data)
    assert len(recorder.steps) == 3
    errors = [s["rollout/reward_errors"] for s in recorder.steps]
    assert errors[-1] > 0 and errors == sorted(errors)  # a running count


def test_exact_ref_ratio_with_lagging_engine_and_sample_reuse(tmp_path, recorder):
    module = tiny_module(exact_ref_ratio=True, iterations_per_batch=2, ratio_cap=5.0, lr=5e-3)
    trainer = tiny_trainer(tmp_path, max_steps=6, callbacks=[WeightSync(every_n_steps=2), recorder])
    trainer.fit(module, datamodule=tiny_data())
    assert [s["train/staleness"] for s in recorder.steps] == [0, 2, 0]
    lagged = recorder.steps[1]
    assert abs(lagged["train/ratio_first_iteration_max"] - 1.0) > 1e-4  # alpha lags pi_k: r' != 1
    assert all(s["train/ratio_max"] <= 5.0 + 1e-6 for s in recorder.steps)
