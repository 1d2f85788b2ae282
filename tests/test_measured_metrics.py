"""Metrics that only some steps measure appear in the logs at those steps and nowhere else: Lightning hands a value
logged once to the loggers again at every later step of the epoch (``lit_grpo.core.measured_metrics``), which showed
step 0's trainer-sampler gap at every step of an asynchronous run. Read back from the TensorBoard event files.
(K = 1 against a rollout server: tests/test_async_server.py.)"""

from __future__ import annotations

from conftest import MetricsRecorder, tiny_data, tiny_module, tiny_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lit_grpo.callbacks import WeightSync

from lit_grpo.cli.plots import read_scalars


def logged_steps(scalars: dict[str, list[tuple[int, float]]], tag: str) -> list[int]:
    """The steps at which ``tag`` was written (none when it never was)."""
    return [step for step, _ in scalars.get(tag, [])]


def fit_with_tensorboard(tmp_path, every_n_batches: int, max_steps: int, log_every_n_steps: int = 1):  # noqa: ANN201
    """A fit of the tiny model with ``WeightSync(every_n_batches)``, its TensorBoard scalars and each step's
    ``trainer.callback_metrics``."""
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=max_steps, callbacks=[WeightSync(every_n_batches=every_n_batches),
                                                                     recorder],
                           logger=TensorBoardLogger(str(tmp_path), name="tb"), log_every_n_steps=log_every_n_steps)
    trainer.fit(tiny_module(), datamodule=tiny_data())
    return read_scalars(tmp_path / "tb"), recorder.steps


def test_with_v2_sync_and_gap_metrics_appear_only_at_the_steps_that_measured_them(tmp_path):
    scalars, steps = fit_with_tensorboard(tmp_path, every_n_batches=2, max_steps=4)
    # v = 2: batches 0 and 2 are sampled by the policy's own weights, a push follows batches 1 and 3
    assert scalars["train/staleness"] == [(0, 0.0), (1, 1.0), (2, 0.0), (3, 1.0)]
    assert logged_steps(scalars, "train/logp_gap_synced") == [0, 2]
    assert logged_steps(scalars, "sync/seconds") == [1, 3]
    assert logged_steps(scalars, "sync/bytes") == [1, 3]
    assert all(value > 0 for _, value in scalars["sync/bytes"])
    # the counters are measured at every step, syncing or not
    assert scalars["sync/count"] == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 2.0)]
    assert scalars["sync/by_interval"] == scalars["sync/count"]
    # callbacks read the latest measured value, as Lightning keeps every metric in callback_metrics
    assert "train/logp_gap_synced" in steps[0] and "sync/bytes" not in steps[0]
    assert steps[1]["train/logp_gap_synced"] == steps[0]["train/logp_gap_synced"]
    assert steps[2]["sync/bytes"] == steps[1]["sync/bytes"] == scalars["sync/bytes"][0][1]


def test_log_every_n_steps_thins_them_as_it_thins_every_other_metric(tmp_path):
    scalars, _ = fit_with_tensorboard(tmp_path, every_n_batches=1, max_steps=4, log_every_n_steps=2)
    assert logged_steps(scalars, "train/loss") == [1, 3]
    for tag in ("train/logp_gap_synced", "sync/seconds", "sync/bytes", "sync/count"):
        assert logged_steps(scalars, tag) == [1, 3], tag
