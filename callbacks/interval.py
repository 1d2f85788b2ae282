"""`Interval`: a period counted in rollout batches or in optimizer steps, named by its unit.

With i optimizer steps per rollout batch (the paper's i), "every 10 steps" would be ambiguous; the callbacks
therefore take ``every_n_batches`` (calls of ``training_step``, Algorithm 1's k; the unit of the paper's v) or
``every_n_optimizer_steps`` (``trainer.global_step``), never a bare ``every_n_steps``.
"""

from __future__ import annotations

import lightning as L


class Interval:
    """Every ``every_n_batches`` rollout batches or every ``every_n_optimizer_steps`` optimizer steps (at most one
    of the two; neither: never). ``boundaries(trainer, batches_seen)`` counts the periods completed so far, so a
    callback acts when that count grows."""

    def __init__(self, owner: str, every_n_batches: int | None = None,
                 every_n_optimizer_steps: int | None = None) -> None:
        if every_n_batches is not None and every_n_optimizer_steps is not None:
            raise ValueError(f"{owner}: set one of every_n_batches or every_n_optimizer_steps, not both "
                             f"(got {every_n_batches} and {every_n_optimizer_steps})")
        for name, value in (("every_n_batches", every_n_batches), ("every_n_optimizer_steps", every_n_optimizer_steps)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{owner}: {name} must be an integer >= 1 or None, got {value!r}")
        self.every_n_batches = every_n_batches
        self.every_n_optimizer_steps = every_n_optimizer_steps

    @property
    def active(self) -> bool:
        return self.every_n_batches is not None or self.every_n_optimizer_steps is not None

    def boundaries(self, trainer: L.Trainer, batches_seen: int) -> int:
        if self.every_n_batches is not None:
            return batches_seen // self.every_n_batches
        if self.every_n_optimizer_steps is not None:
            return trainer.global_step // self.every_n_optimizer_steps
        return 0
