"""The command line's progress bar: optimizer steps out of ``trainer.max_steps``.

A GRPO fit is step-based: ``trainer.max_steps`` ends it and ``max_epochs`` is left unset (-1), so Lightning's
default bars, which count batches of an epoch out of ``max_epochs``, read ``Epoch 0/-2`` and restart at every pass
over the prompts. This bar counts ``trainer.global_step`` (the optimizer steps, the unit of ``max_steps``, also
with several optimizer steps per rollout batch) across epochs, from where a resumed run starts. A fit without
``max_steps`` gets Lightning's epoch bar unchanged.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

DESCRIPTION = "step"


class StepProgressBar(TQDMProgressBar):
    """A ``TQDMProgressBar`` whose training bar is ``step n/max_steps``, kept across epochs."""

    @property
    def train_description(self) -> str:
        return DESCRIPTION if counts_steps(self.trainer) else super().train_description

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if counts_steps(trainer):
            bar = self.train_progress_bar
            bar.total = trainer.max_steps
            _show(bar, trainer.global_step)

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        # one bar for the whole fit: an epoch is one pass over the prompts, not the unit of max_steps
        if not counts_steps(trainer):
            super().on_train_epoch_start(trainer, *args)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if not counts_steps(trainer):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        bar = self.train_progress_bar
        if self.is_enabled:
            _show(bar, trainer.global_step)
            bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not counts_steps(trainer):
            super().on_train_epoch_end(trainer, pl_module)
        elif not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


def counts_steps(trainer: pl.Trainer) -> bool:
    """Whether the fit is bounded by ``max_steps`` (Lightning's ``-1``: unset)."""
    return trainer.max_steps is not None and trainer.max_steps > 0


def default_progress_bar(trainer_config: dict[str, Any], callbacks: list[Any]) -> StepProgressBar | None:
    """The bar to add to a trainer built from ``trainer_config`` (its ``enable_progress_bar`` and ``callbacks``)
    with the extra ``callbacks``: none where the progress bar is off or a progress bar is given already (Lightning
    refuses two, and refuses a bar with ``enable_progress_bar`` false)."""
    if trainer_config.get("enable_progress_bar") is False:
        return None
    given = trainer_config.get("callbacks")
    given = list(given) if isinstance(given, (list, tuple)) else [] if given is None else [given]
    if any(isinstance(c, ProgressBar) for c in [*given, *callbacks]):
        return None
    return StepProgressBar()


def _show(bar: Any, n: int) -> None:  # noqa: ANN401 -- a tqdm bar
    if not bar.disable:
        bar.n = n
        bar.refresh()
