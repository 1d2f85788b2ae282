"""AdamW with linear warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

SCHEDULES = ("constant", "linear", "cosine")


def warmup_lambda(warmup_steps: int, total_steps: int | None, schedule: str) -> Callable[[int], float]:
    """Multiplier of the base learning rate at optimizer step ``s`` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; expected one of {SCHEDULES}")
    if schedule != "constant" and not total_steps:
        raise ValueError(f"lr_schedule={schedule!r} needs a known number of optimizer steps (set trainer.max_steps)")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(
    params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float],
    warmup_steps: int, total_steps: int | None, schedule: str,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(warmup_steps, total_steps, schedule))
    return optimizer, scheduler
