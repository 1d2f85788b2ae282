"""How per-token losses are reduced to one number: per-token weights that sum micro-batches exactly, and the
two ways of leaving zero-variance groups out of them (eq. 8 as written, or DAPO-style renormalised)."""

from __future__ import annotations

from collections.abc import Callable

import torch

AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "constant", "seq_mean_token_sum")

#: turns this process's counts into totals over all processes (an all-reduce sum; see :func:`token_weights`)
GlobalSum = Callable[[torch.Tensor], torch.Tensor]


def token_weights(
    mask: torch.Tensor,
    mode: str,
    max_completion_length: int | None = None,
    global_sum: GlobalSum | None = None,
) -> torch.Tensor:
    """Weights ``w`` with ``loss = sum(w * per_token_loss)`` over the whole rollout batch.

    ``mask`` is ``[num_sequences, T]``: 1 on completion tokens that count; they are also the tokens every
    denominator counts (for eq. 8's zero-variance groups see :func:`zero_variance_masked_weights`). Because
    weights are computed once for the whole batch, summing ``w * loss`` over micro-batches gives exactly the
    full-batch aggregate.

    - ``token_mean``: every counted token has weight ``1 / total_counted_tokens`` (DAPO; TRL's "dapo"/"bnpo").
    - ``seq_mean_token_mean``: mean over tokens inside each sequence, then over sequences that have any
      counted token (original GRPO, Shao et al. 2024).
    - ``constant``: ``1 / (num_sequences * max_completion_length)`` (Dr.GRPO's constant normaliser;
      all sequences count in the denominator, masked or not).
    - ``seq_mean_token_sum``: sum over tokens inside each sequence, then mean over sequences that have any
      counted token: every counted token weighs ``1 / active_sequences`` (LUSPO, arXiv 2602.05261, TRL's
      ``loss_type="luspo"``: a sequence's loss scaled by its length). TRL's ``.mean()`` divides by every
      sequence of the micro-batch; the two agree whenever each sequence has a counted token, and counting only
      those keeps the mode's meaning when zero-variance groups are dropped (:func:`zero_variance_dropped_weights`).

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
    if mode == "seq_mean_token_sum":
        active = total((mask.sum(dim=1) > 0).sum().to(torch.float32)).clamp(min=1.0)
        return mask / active
    raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {AGGREGATION_MODES}")


def zero_variance_masked_weights(mask: torch.Tensor, group_mask: torch.Tensor, mode: str,
                                 max_completion_length: int | None = None,
                                 global_sum: GlobalSum | None = None) -> torch.Tensor:
    """Weights of eq. 8 of Mroueh et al. as written, ``E_x[ 1{sigma(x) != 0} (L(x) - beta KL(x)) ]``.

    The aggregation's weights are those of eq. 7, computed over every completion of ``mask`` (zero-variance
    groups included: they keep their place in the denominator of every mode), then multiplied by the group
    indicator ``group_mask`` (``[num_sequences]``, 1 where the completion's group has a reward spread). A flat
    group's tokens weigh 0, so both its surrogate and its KL term contribute exactly zero, while every kept
    token weighs what it weighs under eq. 7: masking does not raise the step size as more groups go flat.

    With ``global_sum`` the denominators count the masked groups' tokens on every rank too (each rank passes its
    whole ``mask``), so the ranks' weights are still the one-process weights.
    """
    check_group_mask(mask, group_mask)
    weights = token_weights(mask, mode, max_completion_length, global_sum)
    return weights * group_mask.to(weights.dtype).unsqueeze(-1)


def zero_variance_dropped_weights(mask: torch.Tensor, group_mask: torch.Tensor, mode: str,
                                  max_completion_length: int | None = None,
                                  global_sum: GlobalSum | None = None) -> torch.Tensor:
    """DAPO-style alternative to eq. 8: zero-variance groups leave the batch, denominators included.

    The weights are those of a batch holding only the groups with a reward spread (as after DAPO's dynamic
    sampling filter, Yu et al. 2025, without its refill). Under ``token_mean`` and ``seq_mean_token_mean`` every
    kept token therefore weighs ``1 / (1 - fraction of flat tokens or sequences)`` times its eq. 8 weight;
    under ``constant`` the denominator counts every sequence, so the weights equal eq. 8's.
    """
    check_group_mask(mask, group_mask)
    return token_weights(mask.to(torch.float32) * group_mask.to(torch.float32).unsqueeze(-1), mode,
                         max_completion_length, global_sum)


def check_group_mask(mask: torch.Tensor, group_mask: torch.Tensor) -> None:
    """One indicator per completion row of ``mask``: a misaligned mask would silently weigh the wrong rows."""
    if group_mask.dim() != 1 or group_mask.shape[0] != mask.shape[0]:
        raise ValueError(f"group_mask must have shape [{mask.shape[0]}] (one value per completion of mask "
                         f"{tuple(mask.shape)}), got {tuple(group_mask.shape)}")
