"""AdamW with linear warmup, then constant, linear or cosine decay: one option group, :class:`OptimizerArgs`."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import torch

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerArgs:
    """The optimizer's settings (``model.optimizer`` in a config; ``--model.optimizer.lr`` on the command line).

    Args:
        lr: peak learning rate of AdamW, reached after the warmup.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's (beta1, beta2), each in [0, 1).
        warmup_steps: optimizer steps of linear warmup from lr / warmup_steps to lr (0: none).
        schedule: after the warmup, ``constant``, or ``linear`` / ``cosine`` decay to 0 at ``trainer.max_steps``.
        fused: AdamW's fused kernel where it applies (plain float parameters on the CPU; see :func:`fuses_on_cpu`):
            one pass over the parameters instead of about ten, 0.07 s a step against 0.46-0.60 s for SmolLM2-135M
            on 2 CPU cores. Off by default: it rounds differently from torch's default loop (within 3e-7 after a
            few steps), so runs with it do not repeat the committed curves bit for bit.
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = 0
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    fused: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optimizer.lr must be a finite number > 0, got {self.lr!r}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas!r}")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps must be an integer >= 0, got {self.warmup_steps!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown optimizer.schedule {self.schedule!r}; expected one of {SCHEDULES}")
        if not isinstance(self.fused, bool):
            raise ValueError(f"optimizer.fused must be true or false, got {self.fused!r}")


def warmup_lambda(warmup_steps: int, total_steps: int | None, schedule: str) -> Callable[[int], float]:
    """Multiplier of the base learning rate at optimizer step ``s`` (0-based)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown optimizer.schedule {schedule!r}; expected one of {SCHEDULES}")
    if schedule != "constant" and not total_steps:
        raise ValueError(f"optimizer.schedule={schedule!r} needs a known number of optimizer steps "
                         "(set trainer.max_steps)")

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_optimizer(
    params: Iterable[torch.nn.Parameter], args: OptimizerArgs, total_steps: int | None,
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its warmup-then-schedule multiplier; ``total_steps`` (``trainer.max_steps``) is
    needed by the decaying schedules only."""
    params = list(params)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=tuple(args.betas),
                                  fused=True if args.fused and fuses_on_cpu(params) else None)
    factor = warmup_lambda(args.warmup_steps, total_steps, args.schedule)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def fuses_on_cpu(params: list[torch.Tensor]) -> bool:
    """Whether ``optimizer.fused`` can take AdamW's fused kernel: when every parameter is a plain float tensor on
    the CPU. On a CPU, torch's default AdamW loops over the parameters with about ten elementwise passes each; the
    fused kernel makes one. Sharded parameters (FSDP2's ``DTensor``) and accelerators keep torch's default
    (``foreach`` on CUDA), the implementation the GPU checks ran with."""
    from torch.distributed.tensor import DTensor

    return bool(params) and all(
        p.device.type == "cpu" and p.is_floating_point() and not isinstance(p, DTensor) for p in params)
