"""What ``GRPOModule`` refuses of its own options when it is built, before any model loads. Imports nothing heavy, so
the command line applies the same rules before Lightning is imported (``lit_grpo.cli.early_checks``): a refusal
says the same line either way."""

from __future__ import annotations

import math


def check_module_numbers(iterations_per_batch: int = 1, temperature: float = 1.0, max_completion_length: int = 1,
                         peak_flops: float | None = None) -> None:
    """``i`` (updates per rollout batch), the sampling temperature the loss divides by, the generation budget
    (Dr.GRPO's constant normaliser) and the device's peak FLOP/s for the MFU metric."""
    if peak_flops is not None and not (math.isfinite(peak_flops) and peak_flops > 0):
        raise ValueError(f"peak_flops must be a finite number of FLOP/s > 0 (None: the device's known bf16 "
                         f"peak), got {peak_flops!r}")
    if iterations_per_batch < 1:
        raise ValueError(f"iterations_per_batch (i) must be >= 1, got {iterations_per_batch}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")


def check_loss_aggregation(mode: str) -> None:
    """How the loss of a batch's tokens is averaged (``lit_grpo.math.aggregation``)."""
    from lit_grpo.math.aggregation import AGGREGATION_MODES

    if mode not in AGGREGATION_MODES:
        raise ValueError(f"unknown loss_aggregation {mode!r}; expected one of {AGGREGATION_MODES}")


def check_head_chunk_mb(head_chunk_mb: float | None) -> None:
    """The chunked head's budget, MiB of float32 logits per chunk of tokens (``lit_grpo.core.chunked_head``)."""
    if head_chunk_mb is not None and not (isinstance(head_chunk_mb, (int, float)) and math.isfinite(head_chunk_mb)
                                          and head_chunk_mb > 0):
        raise ValueError(f"head_chunk_mb must be a finite number of MiB > 0 (null: the full logits, no chunks), "
                         f"got {head_chunk_mb!r}")
