"""Sampler corrections: a detached per-token weight on the policy term that accounts for the sampler (vLLM, another
precision, stale weights) not being the policy the trainer computes, and statistics of that mismatch.

Notation: mu = the sampler's reported log-probs (``sampler_logp``); pi_old = the policy the correction compares mu
with (``old_logp``: pi_k, the trainer's log-probs before the batch's first step, with ``old_policy="proximal"``;
alpha recomputed in the trainer's numerics with ``"decoupled"``); pi_theta = the current policy (``logp``, used
detached); rho = pi_old / mu, per token. The weight multiplies the loss's policy term only
(:func:`lit_grpo.math.objective.with_kl_penalty`), as TRL, verl and SkyRL apply theirs.

Each mode is one small function; :func:`correction_weight` picks one. The four importance-sampling modes
(``token_truncate``, ``token_mask``, ``sequence_truncate``, ``sequence_mask``) compute exactly TRL 1.16's
``vllm_importance_sampling_ratio``, NaN handling included (tests/test_trl_correction_parity.py runs TRL's own
code). Pure torch; see docs/corrections.md for the peers that ship each mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lit_grpo.math.dppo import dppo_kl_keep, dppo_tv_keep
from lit_grpo.math.kl import k3_kl
from lit_grpo.math.objective import masked_extremum, masked_sum

CORRECTION_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop",
                    "geometric_mask", "off_policy_mask", "dppo_tv", "dppo_kl")
OLD_POLICIES = ("proximal", "decoupled")

#: each mode's default (low, high): TRL 1.16's vllm_importance_sampling_clip_min/max (None, 3.0) for its four IS
#: modes; IcePop's band [0.5, 5.0] (NeMo-RL's reference bounds, its docs/guides/prorlv2.md); SkyRL's recommended
#: geometric band [0.99, 1.01] (geo_mask_low/high); OPSM's delta 0.5 (TRL's documented example for
#: off_policy_mask_threshold); DPPO's delta_low/delta_high, SkyRL's DPPOConfig: 0.2 for TV, 0.05 recommended for KL
DEFAULT_BOUNDS: dict[str, tuple[float | None, float | None]] = {
    "none": (None, None),
    "token_truncate": (None, 3.0),
    "token_mask": (None, 3.0),
    "sequence_truncate": (None, 3.0),
    "sequence_mask": (None, 3.0),
    "icepop": (0.5, 5.0),
    "geometric_mask": (0.99, 1.01),
    "off_policy_mask": (None, 0.5),
    "dppo_tv": (0.2, 0.2),
    "dppo_kl": (0.05, 0.05),
}
# modes whose (low, high) is a band [low, high] on one quantity; DPPO's two thresholds are independent
_BAND_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "icepop", "geometric_mask")
#: the modes whose weight is a 0/1 keep mask, not an importance ratio: a loss multiplies it onto its policy term
#: after its own weighting (TRL's off-policy mask), never into an importance weight (VESPO's w)
MASK_MODES = ("geometric_mask", "off_policy_mask", "dppo_tv", "dppo_kl")
#: the modes whose weight is one ratio per sequence, broadcast over the sequence's tokens
SEQUENCE_RATIO_MODES = ("sequence_truncate", "sequence_mask")


@dataclass(frozen=True)
class CorrectionOptions:
    """The sampler correction (``model.correction``): a detached per-token weight on the policy term, from the
    sampler's log-probs mu and the trainer's (docs/corrections.md).

    Args:
        mode: none, token_truncate, token_mask, sequence_truncate, sequence_mask (TRL's vLLM IS modes), icepop,
            geometric_mask, off_policy_mask (DeepSeek-V3.2's OPSM), dppo_tv or dppo_kl (DPPO's trust-region masks).
        old_policy: pi_old of rho = pi_old / mu, and the loss's denominator: "decoupled" (default) is alpha
            recomputed in the trainer's numerics from the rollout weights (TRL's old_per_token_logps, computed
            when the batch is generated, by the weights that generated it), so eq. 6's clip stays around the
            sampling policy; it needs an engine that scores the rollout weights. "proximal" is pi_k, the trainer
            before the batch's first step (AReaL's proximal policy, verl's decoupled mode): at i = 1 its ratio
            pi / pi_k is 1 in the forward pass and the clip never acts (docs/corrections-study.md).
        low: lower bound (None: the mode's default): rho's for the IS modes and icepop, the geometric mean's for
            geometric_mask, delta_low for dppo_*; off_policy_mask has none.
        high: upper bound (None: the mode's default): rho's (3.0) for the IS modes, 5.0 for icepop, 1.01 for
            geometric_mask, OPSM's delta (0.5) for off_policy_mask, delta_high for dppo_* (0.2 TV, 0.05 KL).
    """

    mode: str = "none"
    old_policy: str = "decoupled"
    low: float | None = None
    high: float | None = None

    def __post_init__(self) -> None:
        if self.mode not in CORRECTION_MODES:
            raise ValueError(f"correction.mode {self.mode!r} is unknown; expected one of {', '.join(CORRECTION_MODES)}")
        if self.old_policy not in OLD_POLICIES:
            raise ValueError(f"correction.old_policy {self.old_policy!r} is unknown; expected one of "
                             f"{', '.join(OLD_POLICIES)}")
        for name in ("low", "high"):
            value = getattr(self, name)
            if value is not None and not value >= 0:  # `not >=` also refuses NaN
                raise ValueError(f"correction.{name} must be >= 0 or None (the mode's default), got {value}")
        if self.mode == "none" and (self.low is not None or self.high is not None):
            raise ValueError(f"correction.low/high are set ({self.low}, {self.high}) but correction.mode is 'none'; "
                             "pick a mode or remove them")
        if self.mode == "off_policy_mask" and self.low is not None:
            raise ValueError(f"correction.low is set ({self.low}) but off_policy_mask has one threshold, "
                             "correction.high (OPSM's delta)")
        low, high = self.bounds()
        if self.mode in _BAND_MODES and low is not None and high is not None and low > high:
            raise ValueError(f"correction.low {low} is above correction.high {high} (mode {self.mode}, None meaning "
                             f"its default {DEFAULT_BOUNDS[self.mode]}); expected low <= high")

    def bounds(self) -> tuple[float | None, float | None]:
        """``(low, high)`` in use: the fields, each None replaced by the mode's default (:data:`DEFAULT_BOUNDS`)."""
        default_low, default_high = DEFAULT_BOUNDS[self.mode]
        return (default_low if self.low is None else self.low), (default_high if self.high is None else self.high)


@dataclass
class CorrectionWeight:
    """A correction's outcome: ``weight`` ``[S, T]`` (detached, the factor on each token's policy term),
    ``masked`` ``[S, T]`` bool (counted tokens whose weight the mode set to 0) and ``truncated`` ``[S, T]`` bool
    (counted tokens whose weight was clamped to a bound)."""

    weight: torch.Tensor
    masked: torch.Tensor
    truncated: torch.Tensor


def _log_rho(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old - log mu`` on counted tokens, 0 elsewhere, as TRL 1.16 forms it: the difference times the
    mask, then NaN (a token the sampler could not score, or 0 * inf on padding) to 0, i.e. rho = 1 there
    (``torch.nan_to_num`` also brings +-inf to the dtype's extremes, as TRL's does)."""
    return torch.nan_to_num((old_logp.detach() - sampler_logp.detach()) * mask, nan=0.0)


def _sequence_log_rho(log_rho: torch.Tensor) -> torch.Tensor:
    """``[S, 1]``: the sum of a sequence's token log-ratios, log of the product of its rho (TRL's sequence level)."""
    return log_rho.sum(dim=-1, keepdim=True)


def _truncate(rho: torch.Tensor, low: float | None, high: float | None, counted: torch.Tensor) -> CorrectionWeight:
    weight = torch.clamp(rho, min=low, max=high)
    outside = torch.zeros_like(counted)
    if low is not None:
        outside = outside | (rho < low)
    if high is not None:
        outside = outside | (rho > high)
    return CorrectionWeight(weight, torch.zeros_like(counted), counted & outside)


def _band_mask(rho: torch.Tensor, low: float | None, high: float | None, counted: torch.Tensor) -> CorrectionWeight:
    low_value = low if low is not None else -math.inf
    high_value = high if high is not None else math.inf
    invalid = (rho < low_value) | (rho > high_value)
    return CorrectionWeight(rho.masked_fill(invalid, 0.0), counted & invalid, torch.zeros_like(counted))


def token_truncate(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, low: float | None,
                   high: float | None) -> CorrectionWeight:
    """Truncated importance sampling per token (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training"; TRL's ``vllm_importance_sampling_mode="token_truncate"``): weight
    ``clamp(rho_t, low, high)``, rho_t = pi_old(y_t) / mu(y_t), comparing pi_old with mu."""
    counted = mask.bool()
    rho = torch.exp(_log_rho(old_logp, sampler_logp, mask))
    return _truncate(rho, low, high, counted)


def token_mask(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, low: float | None,
               high: float | None) -> CorrectionWeight:
    """Masked importance sampling per token (MIS; TRL's ``token_mask``): weight rho_t = pi_old(y_t) / mu(y_t)
    inside ``[low, high]``, 0 outside (comparing pi_old with mu)."""
    counted = mask.bool()
    rho = torch.exp(_log_rho(old_logp, sampler_logp, mask))
    return _band_mask(rho, low, high, counted)


def sequence_truncate(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, low: float | None,
                      high: float | None) -> CorrectionWeight:
    """Truncated importance sampling per sequence (TRL's ``sequence_truncate``): every token of sequence i gets
    ``clamp(prod_t rho_t, low, high)``, the product of pi_old(y_t) / mu(y_t) over its counted tokens (pi_old vs mu)."""
    counted = mask.bool()
    rho = torch.exp(_sequence_log_rho(_log_rho(old_logp, sampler_logp, mask))).expand(mask.shape)
    return _truncate(rho, low, high, counted)


def sequence_mask(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, low: float | None,
                  high: float | None) -> CorrectionWeight:
    """Masked importance sampling per sequence (sequence-level MIS; TRL's ``sequence_mask``, its default mode):
    every token of sequence i gets ``prod_t rho_t`` (pi_old vs mu) when it lies in ``[low, high]``, else 0."""
    counted = mask.bool()
    rho = torch.exp(_sequence_log_rho(_log_rho(old_logp, sampler_logp, mask))).expand(mask.shape)
    return _band_mask(rho, low, high, counted)


def icepop(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, low: float,
           high: float) -> CorrectionWeight:
    """IcePop (Ling Team, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model",
    arXiv 2510.18855, the IcePop objective): ``M(rho_t) = rho_t`` if ``rho_t`` in ``[low, high]`` else 0, with
    rho_t = pi_train(y_t; theta_old) / pi_infer(y_t; theta_old), i.e. pi_old vs mu. IcePop's M keeps the ratio
    on kept tokens (weight rho_t, not 1), which is also what TRL's ``token_mask`` with a ``clip_min`` and
    NeMo-RL's ``"icepop"`` compute; it is :func:`token_mask` with IcePop's two-sided band [0.5, 5.0]."""
    return token_mask(old_logp, sampler_logp, mask, low, high)


def geometric_mask(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, low: float,
                   high: float) -> CorrectionWeight:
    """Geometric sequence mask (SkyRL's ``sequence_mask_metric="geometric"``; Yao et al.'s seq-mask,
    "When Speed Kills Stability"): drop sequence i when its geometric-mean ratio
    ``exp(mean_t log(pi_old(y_t) / mu(y_t)))`` over counted tokens lies outside ``[low, high]`` (pi_old vs mu);
    weight 1 on the kept sequences (SkyRL applies no ratio with the mask alone)."""
    counted = mask.bool()
    log_rho = _log_rho(old_logp, sampler_logp, mask)
    tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    geo = torch.exp(_sequence_log_rho(log_rho) / tokens)
    drop = ((geo < low) | (geo > high)).expand(mask.shape)
    weight = torch.where(drop, 0.0, 1.0).to(log_rho.dtype)
    return CorrectionWeight(weight, counted & drop, torch.zeros_like(counted))


def off_policy_mask(sampler_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                    delta: float) -> CorrectionWeight:
    """Off-policy sequence masking (OPSM; DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556, eq. 9), as TRL 1.16's
    ``GRPOTrainer.get_off_policy_mask``: keep sequence i iff ``A_i >= 0`` or
    ``mean_t (log mu(y_t) - log pi_theta(y_t)) <= delta`` over its counted tokens (mu vs pi_theta, detached: a
    sampled estimate of KL(mu || pi_theta)); weight 1 on kept sequences, 0 on dropped ones. A token whose mu is
    NaN adds 0 to the sum (TRL's rule) but still counts in the mean's denominator."""
    counted = mask.bool()
    kl = torch.nan_to_num(sampler_logp.detach() - logp.detach(), nan=0.0)
    m = mask.to(kl.dtype)
    mean_kl = (kl * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1.0)
    keep = (advantages.view(-1, 1) >= 0) | (mean_kl <= delta)
    drop = (~keep).expand(mask.shape)
    weight = torch.where(drop, 0.0, 1.0).to(kl.dtype)
    return CorrectionWeight(weight, counted & drop, torch.zeros_like(counted))


def dppo_mask(kind: str, sampler_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, delta_low: float, delta_high: float) -> CorrectionWeight:
    """DPPO's binary trust-region mask as a correction (arXiv 2602.04879, eq. 13 Binary-TV for ``kind="tv"``, eq.
    14 Binary-KL for ``"kl"``; :func:`lit_grpo.math.dppo.dppo_tv_keep`): compares pi_theta (detached) with mu, the
    sampler, as the paper's section 5.2 and SkyRL do; weight 1 on kept tokens, 0 on dropped ones."""
    keep_fn = dppo_tv_keep if kind == "tv" else dppo_kl_keep
    counted = mask.bool()
    keep = keep_fn(logp, sampler_logp, advantages, delta_low, delta_high)
    weight = torch.where(keep, 1.0, 0.0).to(logp.dtype)
    return CorrectionWeight(weight, counted & ~keep, torch.zeros_like(counted))


#: the modes on rho = pi_old / mu alone, by name (the others also read pi_theta and the advantages)
RATIO_MODES = {"token_truncate": token_truncate, "token_mask": token_mask, "sequence_truncate": sequence_truncate,
               "sequence_mask": sequence_mask, "icepop": icepop, "geometric_mask": geometric_mask}


def correction_weight(options: CorrectionOptions, old_logp: torch.Tensor, sampler_logp: torch.Tensor,
                      logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> CorrectionWeight:
    """The correction ``options.mode`` asks for, on ``[S, T]`` log-probs: ``old_logp`` = log pi_old (pi_k or the
    recomputed alpha, per ``options.old_policy``), ``sampler_logp`` = log mu, ``logp`` = log pi_theta (used
    detached), ``advantages`` ``[S]``, ``mask`` ``[S, T]`` (1 on counted tokens). The weight is detached, in
    ``logp``'s dtype, and finite on padding."""
    low, high = options.bounds()
    mode = options.mode
    with torch.no_grad():
        if mode == "none":
            counted = mask.bool()
            return CorrectionWeight(torch.ones_like(logp, dtype=logp.dtype).detach(), torch.zeros_like(counted),
                                    torch.zeros_like(counted))
        if mode in RATIO_MODES:
            result = RATIO_MODES[mode](old_logp, sampler_logp, mask, low, high)
        elif mode == "off_policy_mask":
            result = off_policy_mask(sampler_logp, logp, advantages, mask, high)
        else:
            result = dppo_mask(mode.removeprefix("dppo_"), sampler_logp, logp, advantages, mask, low, high)
    # the sequence modes broadcast one value per sequence: a contiguous copy, not a view that aliases [S, 1]
    result.weight = result.weight.to(logp.dtype).contiguous()
    return result


@torch.no_grad()
def mismatch_stats(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor,
                   mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trainer-sampler mismatch over the counted tokens of ``mask``, as float64 0-d tensors that merge over
    micro-batches and ranks by name (``*_max`` as a maximum, the others as sums;
    :func:`lit_grpo.training.stat_reduction.reduction`):

    - ``mismatch_tokens``: the counted tokens (the denominator of the means);
    - ``mismatch_abs_sum``, ``mismatch_abs_max``: sum and maximum of ``|log pi - log mu|``;
    - ``mismatch_k3_sum``: sum of ``rho - 1 - log rho`` with ``rho = pi / mu``, Schulman's k3 estimator
      ("Approximating KL Divergence", 2020) on tokens sampled from mu: since ``E_mu[rho] = 1`` its mean estimates
      ``KL(mu || pi)``, the sampler's divergence from the trainer, >= 0 token by token.

    ``trainer_logp`` is log pi (pi_k or the recomputed alpha), ``sampler_logp`` log mu. No host sync: padded
    positions are replaced with ``torch.where`` (their inf or NaN cannot leak), not dropped with ``x[mask]``.
    With no counted token the maximum is -inf."""
    m = mask.bool()
    log_rho = trainer_logp.detach().to(torch.float64) - sampler_logp.detach().to(torch.float64)
    gap = log_rho.abs()
    k3 = k3_kl(sampler_logp.detach().to(torch.float64), trainer_logp.detach().to(torch.float64))  # KL(mu || pi)
    return {
        "mismatch_tokens": m.sum().to(torch.float64),
        "mismatch_abs_sum": masked_sum(gap, m),
        "mismatch_abs_max": masked_extremum(gap, m, "max"),
        "mismatch_k3_sum": masked_sum(k3, m),
    }
