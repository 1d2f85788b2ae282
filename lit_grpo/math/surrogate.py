"""The clipped off-policy surrogate ``f_eps`` of eq. 6 and truncated importance sampling."""

from __future__ import annotations

import torch


def clip_bounds(
    ref_ratio: torch.Tensor | float, eps_low: float, eps_high: float
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """Clip interval of eq. 6: ``[max(r' - eps_low, 0), r' + eps_high]``.

    ``r' = pi_k / alpha``; the paper's practical choice is ``r' = 1`` (then the interval is PPO's
    ``[1 - eps, 1 + eps]``). The floor at 0 matters only for the exact ``r'`` when ``r' < eps_low``.
    """
    if isinstance(ref_ratio, torch.Tensor):
        return torch.clamp(ref_ratio - eps_low, min=0.0), ref_ratio + eps_high
    return max(ref_ratio - eps_low, 0.0), ref_ratio + eps_high


def clipped_surrogate(
    ratio: torch.Tensor,
    ref_ratio: torch.Tensor | float,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    delta: float | None = None,
) -> torch.Tensor:
    """``f_eps(r, r', A) = min(r A, clip(r, max(r' - eps_low, 0), r' + eps_high) A)`` of eq. 6.

    ``delta`` (None: off) is INTELLECT-2's two-sided clip (arXiv 2505.07291, TRL's ``delta``):
    ``min(min(r, delta) A, clip(r, ...) A)``. As in TRL's ``_compute_loss``, the clipped branch is computed from
    the uncapped r and only the unclipped branch is capped, so for A < 0 the loss is bounded by ``delta |A|``
    and a token above delta gets no gradient.

    ``ratio`` is ``r = pi / alpha`` and ``ref_ratio`` is ``r' = pi_k / alpha`` (a tensor, or the float 1.0
    for the paper's practical choice). Asymmetric ``eps_low`` / ``eps_high`` generalise the single eps of the
    paper (DAPO's clip-higher); with ``eps_low == eps_high == eps`` this is eq. 6 exactly. The value is to
    be maximised.
    """
    low, high = clip_bounds(ref_ratio, eps_low, eps_high)
    clipped = torch.clamp(ratio, min=low, max=high) if isinstance(low, torch.Tensor) else ratio.clamp(low, high)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    return torch.minimum(unclipped * advantages, clipped * advantages)


def truncate_ratio(ratio: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Truncated importance sampling: ``min(r, cap)`` (no-op when ``cap`` is None).

    Bounds the weight any single token can get when alpha puts much less mass on it than pi (a stale or
    mismatched rollout engine). Above the cap the gradient through the ratio is zero.
    """
    if cap is None:
        return ratio
    return torch.clamp(ratio, max=cap)
