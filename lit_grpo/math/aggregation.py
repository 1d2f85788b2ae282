"""How per-token losses are reduced to one number: per-token weights that sum micro-batches exactly."""

from __future__ import annotations

from collections.abc import Callable

import torch

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "constant")


def token_weights(
    mask: torch.Tensor,
    mode: str,
    max_completion_length: int | None = None,
    global_sum: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weights ``w`` with ``loss = sum(w * per_token_loss)`` over the whole rollout batch.

    ``mask`` is ``[num_sequences, T]``: 1 on completion tokens that count (already multiplied by the eq. 8
    group mask when masking is on). Because weights are computed once for the whole batch, summing
    ``w * loss`` over micro-batches gives exactly the full-batch aggregate.

    - ``token_mean``: every counted token has weight ``1 / total_counted_tokens`` (DAPO; TRL's "dapo"/"bnpo").
    - ``seq_mean_token_mean``: mean over tokens inside each sequence, then over sequences that have any
      counted token (original GRPO, Shao et al. 2024).
    - ``constant``: ``1 / (num_sequences * max_completion_length)`` (Dr.GRPO's constant normaliser;
      all sequences count in the denominator, masked or not).

    A batch with no counted token gets all-zero weights: loss 0, gradient 0, no NaN.

    ``global_sum`` turns this process's counts into totals over all processes (an all-reduce). With it the
    denominators are those of the global batch, so the per-rank losses add up to the loss of one process holding
    every rank's sequences (``mask`` is then this rank's share). Without it the batch is the local one.
    """
    mask = mask.to(torch.float32)
    total = global_sum if global_sum is not None else (lambda count: count)
    if mode == "token_mean":
        return mask / total(mask.sum()).clamp(min=1.0)
    if mode == "seq_mean_token_mean":
        per_seq = mask.sum(dim=1, keepdim=True)
        active = total((per_seq > 0).sum().to(torch.float32)).clamp(min=1.0)
        return mask / per_seq.clamp(min=1.0) / active
    if mode == "constant":
        length = max_completion_length if max_completion_length is not None else mask.shape[1]
        if length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {length}")
        sequences = total(torch.tensor(float(mask.shape[0]), device=mask.device))
        return mask / (sequences * float(length))
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATION_MODES}")
