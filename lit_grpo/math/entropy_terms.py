"""Entropy in the policy loss: the high-entropy token mask of Wang et al. 2025 ("Beyond the 80/20 Rule:
High-Entropy Minority Tokens Drive Effective Reinforcement Learning for LLM Reasoning", arXiv 2506.01939; TRL's
``top_entropy_quantile``), the entropy bonus (TRL's ``entropy_coef``) and its adaptive coefficient (Skywork-OR1,
arXiv 2505.22312; TRL's ``use_adaptive_entropy``), with :class:`EntropyOptions` holding TRL's defaults.

Entropies are the per-token entropies of pi_theta's next-token distribution (``[S, T]``, as
:func:`lit_grpo.math.logprobs.token_entropy` gives them), ``mask`` the tokens that count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EntropyOptions:
    """Entropy settings of the policy loss (TRL's ``GRPOConfig`` fields and defaults).

    Args:
        top_entropy_quantile: rho of Wang et al. 2025: only the top-rho fraction of the batch's counted tokens by
            entropy keep their policy term (:func:`high_entropy_mask`); in [0, 1], 1.0 keeps every token, 0.0 the
            highest-entropy token(s) only, the paper's choice is 0.2 (TRL's ``top_entropy_quantile``).
        coef: weight of the entropy bonus, ``loss - coef * H`` with H the mean entropy (:func:`entropy_bonus`),
            >= 0; with ``adaptive`` the initial coefficient (TRL's ``entropy_coef``).
        adaptive: adapt ``coef`` after each optimizer step (:func:`adaptive_entropy_coefficient`) and apply it
            only while the measured entropy is at or below ``target`` (TRL's ``use_adaptive_entropy``).
        target: the entropy (nats per token) the adaptive coefficient aims at, >= 0 (TRL's ``entropy_target``).
        coef_delta: the adaptive coefficient's step, >= 0 (TRL's ``entropy_coef_delta``).
        coef_min: the adaptive coefficient's floor, >= 0 (TRL's ``entropy_coef_min``).
        coef_max: the adaptive coefficient's ceiling, >= coef_min (TRL's ``entropy_coef_max``).
    """

    top_entropy_quantile: float = 1.0
    coef: float = 0.0
    adaptive: bool = False
    target: float = 0.2
    coef_delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in [0, 1] (the fraction of tokens kept by entropy), "
                             f"got {self.top_entropy_quantile}")
        for name in ("coef", "target", "coef_delta", "coef_min", "coef_max"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.coef_min > self.coef_max:
            raise ValueError(f"coef_min ({self.coef_min}) must be <= coef_max ({self.coef_max}), the adaptive "
                             "entropy coefficient's range")
        if self.adaptive and not self.coef_min <= self.coef <= self.coef_max:
            raise ValueError(f"coef ({self.coef}) must lie in [coef_min, coef_max] = [{self.coef_min}, "
                             f"{self.coef_max}] with adaptive: it is the adaptive coefficient's start")

    @property
    def masks_tokens(self) -> bool:
        """Whether the high-entropy mask is on (``top_entropy_quantile < 1``)."""
        return self.top_entropy_quantile < 1.0

    @property
    def bonus_enabled(self) -> bool:
        """Whether the entropy bonus is computed: a non-zero ``coef``, or ``adaptive`` (whose coefficient may
        come back from 0), as TRL's ``_entropy_bonus_enabled``."""
        return self.coef != 0.0 or self.adaptive


def _upcast(x: torch.Tensor) -> torch.Tensor:
    # 16-bit entropies are compared and ranked in float32, as TRL's .float(); float32 and float64 stay as they are
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def quantile_linear(values: torch.Tensor, q: float) -> torch.Tensor:
    """``torch.quantile(values, q)`` (linear interpolation between the order statistics at ranks
    ``floor(q (n - 1))`` and ``ceil(q (n - 1))``), written out with the same arithmetic so the value is bit for bit
    torch's, without ``torch.quantile``'s limit on the input's size (a batch's tokens may exceed it). ``values`` is
    1-d and not empty."""
    ordered = values.sort().values
    rank = torch.tensor(q, dtype=values.dtype, device=values.device) * (ordered.numel() - 1)
    below = rank.to(torch.long)
    above = rank.ceil().to(torch.long)
    return torch.lerp(ordered[below], ordered[above], rank - below)


def entropy_threshold(entropies: torch.Tensor | Sequence[torch.Tensor], masks: torch.Tensor | Sequence[torch.Tensor],
                      top_entropy_quantile: float) -> torch.Tensor:
    """The entropy a token needs to keep its policy term: the ``1 - top_entropy_quantile`` quantile of the
    entropies of the counted tokens (Wang et al. 2025, arXiv 2506.01939; TRL's ``get_high_entropy_mask``, whose
    ``torch.quantile`` it reproduces), a 0-d tensor.

    ``entropies`` and ``masks`` are one ``[S, T]`` pair or a list of them, e.g. every micro-batch of the rollout
    batch (the ranks' gathered tokens in a distributed run): the threshold is then one over all of them, where
    TRL takes one per micro-batch (over its ranks). With no counted token it is +inf (no token is kept)."""
    if isinstance(entropies, torch.Tensor):
        entropies, masks = [entropies], [masks]
    if len(entropies) != len(masks):
        raise ValueError(f"entropy_threshold needs one mask per entropy tensor, got {len(entropies)} and {len(masks)}")
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    values = torch.cat([_upcast(e.detach())[m.bool()] for e, m in zip(entropies, masks, strict=True)])
    if values.numel() == 0:
        return torch.tensor(float("inf"), dtype=values.dtype, device=values.device)
    return quantile_linear(values, 1.0 - top_entropy_quantile)


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, top_entropy_quantile: float = 1.0,
                      threshold: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[S, T]``: the counted tokens whose entropy is at or above the threshold (Wang et al. 2025, the
    top-rho tokens by entropy; TRL's ``get_high_entropy_mask``). The threshold is ``threshold`` when given (one
    computed by :func:`entropy_threshold` over the whole batch), else the ``1 - top_entropy_quantile`` quantile
    of this ``entropy``'s counted tokens. Padding is never kept."""
    if threshold is None:
        threshold = entropy_threshold(entropy, mask, top_entropy_quantile)
    e = _upcast(entropy.detach())
    return (e >= threshold.to(e.dtype)) & mask.bool()


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor,
                  total_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """The entropy bonus H, the mean entropy over the counted tokens of ``mask``, with its gradient (TRL's
    ``entropy_loss``; the loss is ``L_policy - coef * H``). ``total_tokens`` (None: this ``mask``'s count) is the
    denominator: the counted tokens of the whole batch, so the bonuses of its micro-batches add up to the batch's
    mean (the project's weights divide by batch totals too), where TRL averages per micro-batch. No counted
    token: 0."""
    m = mask.bool()
    total = m.sum().clamp(min=1) if total_tokens is None else total_tokens
    summed = torch.where(m, entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device)).sum()
    return summed / total


def adaptive_entropy_coefficient(coef: float, measured_entropy: float, target: float, delta: float,
                                 coef_min: float, coef_max: float) -> float:
    """The entropy coefficient after an optimizer step (Skywork-OR1, arXiv 2505.22312, adaptive entropy control;
    TRL's ``use_adaptive_entropy`` update): ``min(coef + delta, coef_max)`` when the step's measured mean entropy
    is at or below ``target``, else ``max(coef - delta, coef_min)``."""
    if measured_entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


def applied_entropy_coefficient(coef: float, last_entropy: float | None, target: float, adaptive: bool) -> float:
    """The coefficient the bonus is applied with during a step: ``coef``, or with ``adaptive`` ``coef`` only while
    the entropy measured at the previous step is at or below ``target`` and 0 otherwise, 0 before any
    measurement (``last_entropy`` None; TRL starts from +inf)."""
    if not adaptive:
        return coef
    return coef if last_entropy is not None and last_entropy <= target else 0.0
