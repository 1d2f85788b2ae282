"""Per-token GRPO objective: eq. 7 (clipped surrogate minus beta * KL), or eq. 8 through the weights; the
config every built-in loss takes (:class:`LossConfig`) and what the losses share (the KL term, the statistics)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from lit_grpo.math.kl import k3_kl
from lit_grpo.math.surrogate import clip_bounds, clipped_surrogate, truncate_ratio

#: a policy loss: called with the contract's keyword arguments (written in :mod:`lit_grpo.training.losses`), returns
#: ``(loss, stats)``
LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

C = TypeVar("C", bound="LossConfig")


@dataclass(frozen=True)
class LossConfig:
    """What the config of every built-in loss holds besides its options: ``beta``, the weight of the k3 KL to
    pi_ref (eq. 7), and ``kl_bias_correction``, whether that KL is weighted by the importance ratio (TRL's
    ``use_bias_correction_kl``, :func:`with_kl_penalty`). They are ``model.beta`` and ``model.kl_bias_correction``,
    set by :meth:`with_beta` when the loss is built, so they are no options of a ``loss_options`` section:
    ``init=False`` keeps them out of the parser and of a checkpoint's ``loss_options``, ``repr=False`` out of the
    parser's help (``dataclasses.replace`` refuses them and resets them to their defaults: call :meth:`with_beta`
    on the copy). A loss with no options (``red_drop``) takes this class itself."""

    beta: float = field(default=0.0, init=False, repr=False)
    kl_bias_correction: bool = field(default=False, init=False, repr=False)

    def with_beta(self: C, beta: float, kl_bias_correction: bool = False) -> C:
        """A copy of these options that the loss is called with: the same fields, ``beta`` and
        ``kl_bias_correction``."""
        # a number first: a YAML null or a quoted word reaches here as None or str, where ``>=`` would raise a
        # TypeError naming neither the option nor the value
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta >= 0:
            raise ValueError(f"beta must be a number >= 0 (model.beta, the KL weight of eq. 7), got {beta!r}")
        if not isinstance(kl_bias_correction, bool):
            raise ValueError(f"kl_bias_correction must be true or false, got {kl_bias_correction!r}")
        config = copy.copy(self)
        object.__setattr__(config, "beta", float(beta))  # frozen, and beta is no argument of __init__
        object.__setattr__(config, "kl_bias_correction", kl_bias_correction)
        return config


@dataclass(frozen=True)
class ClipBand(LossConfig):
    """A clip band ``[1 - eps_low, 1 + eps_high]`` around a ratio; ``eps_high`` None means ``eps_low``."""

    eps_low: float = 0.2
    eps_high: float | None = None

    @property
    def eps_upper(self) -> float:
        """The upper half-width in use: ``eps_high``, or ``eps_low`` when it is None (a symmetric band)."""
        return self.eps_low if self.eps_high is None else self.eps_high


@dataclass(frozen=True)
class GRPOOptions(ClipBand):
    """Options of ``grpo``, the clipped off-policy objective (eq. 6/7 of Mroueh et al.).

    Args:
        eps_low: lower clip half-width of eq. 6, the ratio's band is [r' - eps_low, r' + eps_high].
        eps_high: upper clip half-width (None: eps_low).
        exact_ref_ratio: use r' = pi_k / alpha in eq. 6 instead of the paper's practical r' = 1.
        ratio_cap: truncated importance sampling, pi / alpha <= ratio_cap (None: no cap).
        delta: two-sided clip of INTELLECT-2 (arXiv 2505.07291, TRL's ``delta``): the unclipped branch's ratio is
            capped at delta, so a token with A < 0 and a huge ratio no longer gets an unbounded loss; must be
            > 1 + eps_high (None: off).
    """

    exact_ref_ratio: bool = False
    ratio_cap: float | None = None
    delta: float | None = None

    def __post_init__(self) -> None:
        if not self.eps_low > 0:
            raise ValueError(f"eps_low must be > 0 (the clip half-width of eq. 6), got {self.eps_low}")
        if not self.eps_upper > 0:
            raise ValueError(f"eps_high must be > 0 (the clip half-width of eq. 6), got {self.eps_high}")
        if self.ratio_cap is not None and not self.ratio_cap > 0:
            raise ValueError(f"ratio_cap must be > 0 or None, got {self.ratio_cap}")
        check_delta(self.delta, self.eps_upper)


def check_delta(delta: float | None, eps_high: float) -> None:
    """Refuse a two-sided clip ``delta`` at or below the band's upper edge ``1 + eps_high``: there it bounds
    nothing on the A < 0 side it is for (the clipped branch already wins the min) and only tightens the clip of
    the A > 0 side, a second, hidden ``eps_high``."""
    if delta is not None and not delta > 1.0 + eps_high:
        raise ValueError(f"delta must be > 1 + eps_high = {1.0 + eps_high} (INTELLECT-2's cap on the unclipped "
                         f"ratio, above the clip band) or None, got {delta}")


def with_kl_penalty(per_token: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor | None,
                    beta: float, correction: torch.Tensor | None = None, ratio: torch.Tensor | None = None,
                    bias_correction: bool = False,
                    policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eq. 7's KL term added to a per-token policy loss, ``m * c * per_token + beta * KL_k3(pi || pi_ref)``, and
    the KL values added (None at beta = 0, which needs no pi_ref and adds nothing).

    ``correction`` ``c`` (``[S, T]``, detached; None: 1) is the sampler correction's weight
    (:mod:`lit_grpo.math.corrections`): it scales the policy term only, as TRL, verl and SkyRL apply theirs; the
    KL to pi_ref is a regulariser of pi alone, not an expectation over the sampler's tokens. ``policy_mask`` ``m``
    (``[S, T]``, 0/1, detached; None: 1), the top-entropy tokens and the correction's keep masks, multiplies the
    policy term alone too, after the loss's own weighting: TRL's ``entropy_mask`` and off-policy mask.

    ``bias_correction`` (``config.kl_bias_correction``) weights the k3 KL by ``ratio``, the importance ratio
    ``pi_theta / alpha`` the loss uses (``[S, T]``, or ``[S, 1]`` for a sequence-level loss's sequence ratio), WITH
    its gradient: ``beta * r * KL_k3`` (DeepSeek-V3.2, arXiv 2512.02556, the unbiased KL estimate; TRL's
    ``use_bias_correction_kl``, which multiplies its undetached ``coef_1`` before any clip). The tokens were drawn
    from alpha, so ``r * k3`` estimates KL(pi_theta || pi_ref) under pi_theta, and its gradient is the reverse
    KL's gradient even on-policy, where r = 1 but d r = r d log pi. The KL values returned are the weighted ones
    (TRL logs those too)."""
    if correction is not None:
        per_token = per_token * correction
    if policy_mask is not None:
        per_token = per_token * policy_mask
    if not beta > 0:
        return per_token, None
    if ref_logp is None:
        raise ValueError("beta > 0 needs ref_logp (the log-probs of pi_ref)")
    kl = k3_kl(logp, ref_logp)
    if bias_correction:
        if ratio is None:
            raise ValueError("kl_bias_correction needs the loss's importance ratio (with_kl_penalty's ratio)")
        kl = kl * ratio
    return per_token + beta * kl, kl


def grpo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
              mask: torch.Tensor, config: GRPOOptions, pik_logp: torch.Tensor | None = None,
              ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
              policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss to minimise, ``-sum_t w_t [f_eps(pi/alpha, r', A) - beta * KL_k3(pi || pi_ref)]`` (eq. 7; eq. 8 when
    the zero-variance mask is folded into ``weights``), and detached statistics.

    Shapes: ``logp``, ``alpha_logp``, ``pik_logp``, ``ref_logp``, ``weights``, ``mask`` are ``[S, T]``
    (sequences x completion tokens); ``advantages`` is ``[S]`` (one per completion, broadcast over its tokens).
    ``weights`` come from :func:`lit_grpo.math.aggregation.token_weights`. ``config.delta`` caps the unclipped
    branch's ratio (INTELLECT-2's two-sided clip, :func:`lit_grpo.math.surrogate.clipped_surrogate`); the
    statistics count the clip band's tokens as before. Statistics are sums and extrema over
    the tokens of ``mask`` so that micro-batches can be merged: ``tokens``, ``ratio_sum``, ``ratio_min``,
    ``ratio_max``, ``clip_low``, ``clip_high``, ``kl_sum``.
    """
    raw_ratio = torch.exp(logp - alpha_logp)
    ratio = truncate_ratio(raw_ratio, config.ratio_cap)
    if config.exact_ref_ratio:
        if pik_logp is None:
            raise ValueError("exact_ref_ratio needs pik_logp (the log-probs of pi_k, the policy before this batch)")
        ref_ratio: torch.Tensor | float = torch.exp(pik_logp - alpha_logp).detach()
    else:
        ref_ratio = 1.0
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    eps_high = config.eps_upper
    surrogate = clipped_surrogate(ratio, ref_ratio, adv, config.eps_low, eps_high, config.delta)
    per_token, kl = with_kl_penalty(-surrogate, logp, ref_logp, config.beta, correction, raw_ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        r = ratio.detach()
        low, high = clip_bounds(ref_ratio, config.eps_low, eps_high)
        m = mask.bool()
        clip_low = m & (adv < 0) & (r < low)
        clip_high = m & (adv > 0) & (r > high)
    return loss, token_stats(m, r, clip_low, clip_high, kl)


@torch.no_grad()
def token_stats(m: torch.Tensor, ratio: torch.Tensor, clip_low: torch.Tensor, clip_high: torch.Tensor,
                kl: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Sums and extrema over the tokens of the boolean mask ``m``, so micro-batches and ranks merge exactly:
    ``tokens``, ``ratio_sum``, ``ratio_min``, ``ratio_max``, ``clip_low``, ``clip_high``, ``kl_sum``.

    Every value stays a 0-d tensor on the device, and nothing here waits for the device: masked-out tokens are
    replaced (0 for sums, +-inf for extrema) with ``torch.where`` rather than dropped with ``x[m]``, whose output
    size the host would have to read back. ``where``, not a product with the mask, so a padded position whose
    ratio overflowed to inf cannot turn a sum into NaN. With no token in ``m`` the extrema are +inf and -inf.
    """
    ratio = ratio.detach()
    return {
        "tokens": m.sum().to(torch.float64),
        "ratio_sum": masked_sum(ratio, m),
        "ratio_min": masked_extremum(ratio, m, "min"),
        "ratio_max": masked_extremum(ratio, m, "max"),
        "clip_low": clip_low.sum().to(torch.float64),
        "clip_high": clip_high.sum().to(torch.float64),
        "kl_sum": masked_sum(kl.detach(), m) if kl is not None else torch.zeros((), dtype=torch.float64,
                                                                               device=ratio.device),
    }


def masked_sum(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Float64 sum of ``x`` over the tokens of the boolean mask ``m``, without a host sync (see token_stats)."""
    return torch.where(m, x.to(torch.float64), 0.0).sum()


def masked_extremum(x: torch.Tensor, m: torch.Tensor, kind: str) -> torch.Tensor:
    """``min`` or ``max`` of ``x`` over the tokens of the boolean mask ``m`` (+inf / -inf when none), without a
    host sync: masked-out tokens are set to the neutral element instead of being dropped."""
    neutral = float("inf") if kind == "min" else float("-inf")
    if m.numel() == 0:  # a shape, known on the host: amin/amax refuse empty tensors
        return torch.tensor(neutral, dtype=x.dtype, device=x.device)
    filled = torch.where(m, x, neutral)
    return filled.amin() if kind == "min" else filled.amax()
