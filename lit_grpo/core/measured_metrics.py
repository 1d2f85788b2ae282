"""Metrics measured at some steps only (a sync's time and size, the trainer-sampler gap of a batch the synced weights
sampled): written to the loggers at the steps that measured them, and at no other.

Why not ``LightningModule.log`` alone: Lightning keeps each logged key in the fit's result collection
(``lightning.pytorch.trainer.connectors.logger_connector.result._ResultCollection``). A key logged with
``on_step=True`` keeps the value of its last update (the metric's forward cache) and stays valid (``has_reset`` is
False) until the collection is reset: when the epoch ends (``update_train_epoch_metrics``), and for plain values
when a hook logs during an epoch's first batch (``should_reset_tensors``). After every batch,
``update_train_step_metrics`` hands the whole collection's step values to the loggers, so a key logged at step s
reappears with step s's value at every later step of the epoch (here a pass over the prompts, often the whole fit).

So these metrics go straight to the loggers (``Logger.log_metrics``, the route Lightning names for values it should
not reduce) at the step Lightning gives the batch's other metrics, under the same ``log_every_n_steps`` rule, and
through ``LightningModule.log(..., logger=False)`` to ``trainer.callback_metrics``, where, as for every metric
Lightning keeps there, a callback reads the latest measured value.
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L


def logging_step(trainer: L.Trainer) -> int:
    """The x of the current batch's metrics in the loggers: the batches trained before it (Lightning's
    ``_batches_that_stepped``, which it passes to ``Logger.log_metrics`` for the batch's ``self.log`` values; it
    counts rollout batches, not the i optimizer steps of one, and it is restored on resume)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def logs_this_step(trainer: L.Trainer) -> bool:
    """Lightning's rule for writing a training batch's metrics (``LoggerConnector.should_update_logs``): every
    ``log_every_n_steps`` batches (none at 0), and at the batch a fit stops at."""
    every = trainer.log_every_n_steps
    if every == 0:
        return False
    return (logging_step(trainer) + 1) % every == 0 or trainer.should_stop


def log_measured(module: L.LightningModule, metrics: Mapping[str, float]) -> None:
    """Log ``metrics``, measured at this step, at this step only: straight to the trainer's loggers (no later step
    repeats them), and to ``trainer.callback_metrics`` as their latest value. Call it from ``training_step`` or a
    ``on_train_batch_end`` hook; every rank may call it (the loggers write on rank 0)."""
    if not metrics:
        return
    for name, value in metrics.items():
        module.log(name, float(value), on_step=True, on_epoch=False, logger=False, batch_size=1)
    trainer = module.trainer
    if trainer.loggers and logs_this_step(trainer):
        step = logging_step(trainer)
        for logger in trainer.loggers:
            logger.log_metrics({name: float(value) for name, value in metrics.items()}, step=step)
