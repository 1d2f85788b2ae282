"""The policy-loss key, the Theorem-1 TV monitor and the adaptive weight sync, on real fits of the tiny model."""

import pytest
from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync

from lit_grpo.training.losses import BUILTIN_LOSSES


@pytest.mark.parametrize("loss", list(BUILTIN_LOSSES))
def test_every_policy_loss_trains(tmp_path, loss):
    recorder = MetricsRecorder()
    aggregation = "seq_mean_token_sum" if loss == "luspo" else "token_mean"  # LUSPO's length scaling
    module = tiny_module(loss=loss, beta=0.1, lr=1e-2, loss_aggregation=aggregation)
    before = [p.detach().clone() for p in module.policy.parameters()]
    trainer = tiny_trainer(tmp_path, max_steps=2, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(module, datamodule=tiny_data())
    assert len(recorder.steps) == 2
    assert all(abs(s["train/loss"]) < float("inf") and s["train/grad_norm"] > 0 for s in recorder.steps)
    assert any((a - b).abs().max() > 0 for a, b in zip(before, module.policy.parameters()))


def test_tv_monitor_is_zero_on_policy_and_positive_when_alpha_lags(tmp_path):
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=6, callbacks=[WeightSync(every_n_batches=3), recorder])
    trainer.fit(tiny_module(lr=1e-2), datamodule=tiny_data())
    staleness = [s["train/staleness"] for s in recorder.steps]
    assert staleness == [0, 1, 2, 0, 1, 2]
    for step in recorder.steps:
        if step["train/staleness"] == 0:
            assert step["tv/pik_alpha"] == 0.0  # alpha = pi_k exactly: the estimate is exactly 0
        else:
            assert step["tv/pik_alpha"] > 1e-4
        assert step["tv/pi_alpha"] > 0  # measured after the update: the policy moved off alpha


def test_tv_after_update_off_measures_at_the_last_iteration(tmp_path):
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=4, callbacks=[WeightSync(every_n_batches=1), recorder])
    trainer.fit(tiny_module(lr=1e-2, monitor_tv_after_update=False, iterations_per_batch=2), datamodule=tiny_data())
    # i = 2: the last iteration's forward is after one optimizer step, so pi != alpha there
    assert all(s["tv/pik_alpha"] == 0.0 and s["tv/pi_alpha"] > 0 for s in recorder.steps)


class SyncLog(MetricsRecorder):
    """Per step: the TV the module logged, and whether WeightSync synced after it."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        metrics = trainer.callback_metrics
        self.steps.append({"tv": float(metrics["tv/pi_alpha"]), "count": float(metrics["sync/count"]),
                           "by_tv": float(metrics["sync/by_tv"]), "by_interval": float(metrics["sync/by_interval"])})


def test_max_tv_syncs_when_and_only_when_tv_exceeds_it_or_v_batches_pass(tmp_path):
    # a budget between the TVs this run produces, so some steps exceed it and some do not
    probe = SyncLog()
    tiny_trainer(tmp_path / "probe", max_steps=8, callbacks=[WeightSync(every_n_batches=100), probe]).fit(
        tiny_module(lr=3e-3), datamodule=tiny_data())
    tvs = sorted(s["tv"] for s in probe.steps)
    budget = (tvs[len(tvs) // 2 - 1] + tvs[len(tvs) // 2]) / 2
    sync, log = WeightSync(every_n_batches=3, max_tv=budget), SyncLog()
    tiny_trainer(tmp_path / "run", max_steps=8, callbacks=[sync, log]).fit(tiny_module(lr=3e-3), datamodule=tiny_data())
    since, previous = 0, {"count": 0.0, "by_tv": 0.0, "by_interval": 0.0}
    reasons = set()
    for step in log.steps:
        since += 1
        synced = step["count"] > previous["count"]
        expected_interval, expected_tv = since >= 3, step["tv"] > budget
        assert synced == (expected_interval or expected_tv), (step, since, budget)
        if synced:
            reason = "by_interval" if expected_interval else "by_tv"
            assert step[reason] == previous[reason] + 1, (step, reason)
            reasons.add(reason)
            since = 0
        previous = step
    assert "by_tv" in reasons  # the budget fired at least once, before the interval


def test_delayed_sync_gives_stale_data_and_resumes_exactly(tmp_path):
    # v = 2, d = 1: the weights taken after batch 2 reach the engine after batch 3, those of batch 4 after 5, ...
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path / "straight", max_steps=6,
                           callbacks=[WeightSync(every_n_batches=2, delay_batches=1), recorder])
    trainer.fit(tiny_module(lr=1e-2), datamodule=tiny_data())
    assert [s["train/staleness"] for s in recorder.steps] == [0, 1, 2, 1, 2, 1]
    assert all(s["tv/pik_alpha"] > 1e-4 for s in recorder.steps[1:])  # never on-policy after the first batch

    # the weights in flight survive a checkpoint taken between their sync and their delivery
    def delayed() -> WeightSync:
        return WeightSync(every_n_batches=2, delay_batches=1)

    first = MetricsRecorder()
    half = tiny_trainer(tmp_path / "half", max_steps=2, callbacks=[delayed(), first])
    half.fit(tiny_module(lr=1e-2), datamodule=tiny_data())
    half.save_checkpoint(tmp_path / "half.ckpt")
    second = MetricsRecorder()
    tiny_trainer(tmp_path / "rest", max_steps=6, callbacks=[delayed(), second]).fit(
        tiny_module(lr=1e-2), datamodule=tiny_data(), ckpt_path=tmp_path / "half.ckpt")
    for expected, got in zip(recorder.steps, first.steps + second.steps, strict=True):
        assert got["train/staleness"] == expected["train/staleness"]
        assert got["train/loss"] == pytest.approx(expected["train/loss"], abs=1e-6)


@pytest.mark.parametrize("kwargs, match", [(dict(delay_batches=-1), "delay_batches"),
                                           (dict(delay_batches=1, max_tv=0.1), "max_tv")])
def test_delayed_sync_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WeightSync(**kwargs)
