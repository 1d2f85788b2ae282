"""The command line's progress bar: optimizer steps out of ``trainer.max_steps``.

A GRPO fit is step-based: ``trainer.max_steps`` ends it and ``max_epochs`` is left unset (-1), so Lightning's
default bars, which count batches of an epoch out of ``max_epochs``, read ``Epoch 0/-2`` and restart at every pass
over the prompts. This bar counts ``trainer.global_step`` (the optimizer steps, the unit of ``max_steps``, also
with several optimizer steps per rollout batch) across epochs, from where a resumed run starts. A fit without
``max_steps`` gets Lightning's epoch bar unchanged. Either way the bar shows the run's numbers (the reward), not the
logger's version (``v_num``), which is the run's folder name and no measurement. A step slower than a second shows
its seconds per step (``420.00s/it``, where Lightning's format shows ``0.00it/s``), and while the in-process engine
samples a batch's rollouts the bar's description says how far it is (``step (generating: 96/128 sequences, 2,113
tokens)``, at most once a second: ``lit_grpo.engines.progress``).

The model summary printed at the start of a fit is Lightning's without its FLOPs column and total
(:class:`ModelSummaryWithoutFlops`): Lightning counts them over a forward of the module's ``example_input_array``,
which a GRPO module has none of (its batches are sampled), so they read 0; the update's FLOPs are measured and
logged as ``train/update_flops`` (``lit_grpo/training/flops.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichModelSummary, TQDMProgressBar
from lightning.pytorch.utilities.model_summary.model_summary import (
    _format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
)

from lit_grpo.engines.progress import GenerationProgress, listen

DESCRIPTION = "step"
#: the progress bar's entry that names the logger's version, not a measurement of the run
LOGGER_VERSION = "v_num"
#: the model summary's column (and total) that Lightning fills only from an ``example_input_array``
FLOPS_COLUMN = "FLOPs"
#: the summary's columns whose numbers are right-aligned, as Lightning's rich summary aligns them
RIGHT_ALIGNED = ("Params", "Params per Device", "In sizes", "Out sizes")
#: the logger Lightning's text summary writes to (Lightning shows its records)
log = logging.getLogger("lightning.pytorch.callbacks.model_summary")


class StepProgressBar(TQDMProgressBar):
    """A ``TQDMProgressBar`` whose training bar is ``step n/max_steps``, kept across epochs, with the rate in
    seconds per step when a step takes more than a second (Lightning's bar shows ``0.00it/s`` for a 7-minute
    step), and the progress of a long generation in its description while the batch's rollouts are sampled."""

    # Lightning's format with tqdm's rate_fmt (s/it below one step a second) for its rate_noinv_fmt (always it/s)
    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
    _stop_listening: Callable[[], None] | None = None

    @property
    def train_description(self) -> str:
        return DESCRIPTION if counts_steps(self.trainer) else super().train_description

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, int | str | float | dict]:
        """Lightning's entries without the logger's version (``v_num``)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop(LOGGER_VERSION, None)
        return metrics

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.is_enabled and self._stop_listening is None:
            self._stop_listening = listen(self.show_generation)
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

    def show_generation(self, progress: GenerationProgress) -> None:
        """The training bar's description while a generation runs (:mod:`lit_grpo.engines.progress`): sequences and
        tokens done; back to the plain description when it ends."""
        bar = getattr(self, "_train_progress_bar", None)
        if bar is None or bar.disable:
            return
        base = self.train_description
        if progress.sequences_done >= progress.sequences:
            bar.set_description_str(base, refresh=True)
        else:
            bar.set_description_str(f"{base} (generating: {progress.sequences_done}/{progress.sequences} sequences, "
                                f"{progress.tokens:,} tokens)", refresh=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop_generation_display()
        super().on_train_end(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_generation_display()
        super().on_exception(trainer, pl_module, exception)

    def _stop_generation_display(self) -> None:
        stop, self._stop_listening = self._stop_listening, None
        if stop is not None:
            stop()

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


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's model summary without the FLOPs column and total (see the module's docstring): a rich table as
    ``RichModelSummary`` prints it with ``rich``, else the text table of ``ModelSummary``."""

    def __init__(self, max_depth: int = 1, rich: bool = False, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth, **summarize_kwargs)
        self.rich = rich

    # an instance method here (Lightning's is static, and called on the instance): the table depends on `rich`
    def summarize(self, summary_data: list[tuple[str, list[str]]], total_parameters: int,  # type: ignore[override]
                  trainable_parameters: int, model_size: float, total_training_modes: dict[str, int],
                  total_flops: int, **summarize_kwargs: Any) -> None:
        columns = without_flops(summary_data)
        if self.rich:
            rich_summary(columns, total_parameters, trainable_parameters, model_size, total_training_modes,
                         summarize_kwargs.get("header_style", "bold magenta"))
        else:
            table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                          total_flops, *columns)
            log.info("\n" + "\n".join(line for line in table.splitlines() if "Flops" not in line))


def without_flops(summary_data: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The summary's columns (name, values) without the FLOPs column."""
    return [(name, values) for name, values in summary_data if name != FLOPS_COLUMN]


def rich_summary(columns: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                 model_size: float, total_training_modes: dict[str, int], header_style: str) -> None:
    """Print the summary as Lightning's ``RichModelSummary`` does, with the given columns only."""
    from rich import get_console
    from rich.table import Table

    console = get_console()
    table = Table(header_style=header_style)
    for name, _ in columns:
        table.add_column(name, justify="right" if name in RIGHT_ALIGNED else "left", no_wrap=name == "Name",
                         style="dim" if name == " " else None)
    for row in zip(*(values for _, values in columns)):
        table.add_row(*row)
    console.print(table)
    grid = Table.grid(expand=True)
    grid.add_column()
    for label, value in (("Trainable params", get_human_readable_count(trainable_parameters)),
                         ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
                         ("Total params", get_human_readable_count(total_parameters)),
                         ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
                         ("Modules in train mode", total_training_modes["train"]),
                         ("Modules in eval mode", total_training_modes["eval"])):
        grid.add_row(f"[bold]{label}[/]: {value}")
    console.print(grid)


def without_flops_summary(callbacks: list[Any]) -> list[Any]:
    """``callbacks`` with Lightning's own model summary (``ModelSummary`` or ``RichModelSummary`` itself, not a
    subclass of someone's) replaced by :class:`ModelSummaryWithoutFlops` of the same depth and options."""
    return [ModelSummaryWithoutFlops(c._max_depth, rich=type(c) is RichModelSummary, **c._summarize_kwargs)
            if type(c) in (ModelSummary, RichModelSummary) else c for c in callbacks]


def _show(bar: Any, n: int) -> None:  # noqa: ANN401 -- a tqdm bar
    if not bar.disable:
        bar.n = n
        bar.refresh()
