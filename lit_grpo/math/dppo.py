"""DPPO, Divergence Proximal Policy Optimization (arXiv 2602.04879): PPO's ratio clip replaced by a binary trust
region measured in probabilities. A token whose probability already moved too far from the sampling policy's, in
the direction its advantage pushes, is dropped from the gradient; every other token keeps the plain importance
weighted policy gradient ``-(pi / alpha) A``.

The two masks (the paper's Binary-TV, eq. 13, and Binary-KL, eq. 14) compare the current policy pi_theta with the
policy that sampled. They are used twice: as the losses ``dppo_tv`` / ``dppo_kl`` here (against alpha, the loss's
denominator) and as the sampler corrections of the same names (:mod:`lit_grpo.math.corrections`, against mu).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from lit_grpo.math.objective import LossConfig, token_stats, with_kl_penalty

#: the guard SkyRL adds inside the Bernoulli KL's second logarithm, so that a probability of exactly 1 (log-prob
#: 0) on either side gives a finite divergence instead of log(0) or 0 * inf
BERNOULLI_EPS = 1e-8


@dataclass(frozen=True)
class DPPOOptions(LossConfig):
    """Options of ``dppo_tv`` (DPPO's Binary-TV mask, arXiv 2602.04879 eq. 13), in probabilities.

    Args:
        delta_low: a token with A < 0 is dropped when alpha(y) - pi(y) > delta_low (>= 0).
        delta_high: a token with A > 0 is dropped when pi(y) - alpha(y) > delta_high (>= 0).
    """

    delta_low: float = 0.2
    delta_high: float = 0.2

    def __post_init__(self) -> None:
        for name in ("delta_low", "delta_high"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 (DPPO's trust-region threshold), got {value}")


@dataclass(frozen=True)
class DPPOKLOptions(DPPOOptions):
    """Options of ``dppo_kl`` (DPPO's Binary-KL mask, arXiv 2602.04879 eq. 14): the thresholds bound the Bernoulli
    KL(alpha(y) || pi(y)); SkyRL recommends 0.05 for them (0.2 for the TV variant).

    Args:
        delta_low: a token with A < 0 and pi(y) < alpha(y) is dropped when the KL exceeds delta_low (>= 0).
        delta_high: a token with A > 0 and pi(y) > alpha(y) is dropped when the KL exceeds delta_high (>= 0).
    """

    delta_low: float = 0.05
    delta_high: float = 0.05


def bernoulli_kl(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """``KL(Bern(p) || Bern(q)) = p log(p/q) + (1 - p) log((1 - p) / (1 - q))`` from the log-probs of one token
    under two policies (DPPO, arXiv 2602.04879 eq. 14: the divergence between the two policies restricted to
    "this token or any other"). The second logarithm carries :data:`BERNOULLI_EPS` in both terms, as SkyRL's."""
    p, q = torch.exp(logp_p), torch.exp(logp_q)
    return p * (logp_p - logp_q) + (1 - p) * torch.log((1 - p + BERNOULLI_EPS) / (1 - q + BERNOULLI_EPS))


@torch.no_grad()
def dppo_tv_keep(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, delta_low: float,
                 delta_high: float) -> torch.Tensor:
    """DPPO's Binary-TV trust region (arXiv 2602.04879 eq. 13), a boolean keep mask ``[S, T]``: drop a token if
    ``A > 0`` and ``pi(y) - b(y) > delta_high``, or ``A < 0`` and ``b(y) - pi(y) > delta_low``, where pi is the
    current policy (``logp``, used detached) and b the behaviour policy (``behaviour_logp``: alpha for the loss,
    mu for the correction). Probabilities, not ratios: a rare token may change its ratio a lot at no cost in TV.
    ``advantages`` ``[S]`` (or ``[S, T]``)."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    diff = torch.exp(logp.detach()) - torch.exp(behaviour_logp.detach())
    drop = ((adv > 0) & (diff > delta_high)) | ((adv < 0) & (-diff > delta_low))
    return ~drop


@torch.no_grad()
def dppo_kl_keep(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, delta_low: float,
                 delta_high: float) -> torch.Tensor:
    """DPPO's Binary-KL trust region (arXiv 2602.04879 eq. 14), a boolean keep mask ``[S, T]``: with
    ``D = KL(Bern(b(y)) || Bern(pi(y)))`` (:func:`bernoulli_kl`), drop a token if ``A > 0``, ``pi(y) > b(y)`` and
    ``D > delta_high``, or ``A < 0``, ``pi(y) < b(y)`` and ``D > delta_low``; pi is the current policy (``logp``,
    detached), b the behaviour policy (alpha for the loss, mu for the correction), as SkyRL's ``binary_kl``."""
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    logp, behaviour_logp = logp.detach(), behaviour_logp.detach()
    diff = torch.exp(logp) - torch.exp(behaviour_logp)
    kl = bernoulli_kl(behaviour_logp, logp)
    drop = ((adv > 0) & (diff > 0) & (kl > delta_high)) | ((adv < 0) & (diff < 0) & (kl > delta_low))
    return ~drop


def _dppo_loss(keep_fn: Callable[..., torch.Tensor], logp: torch.Tensor, alpha_logp: torch.Tensor,
               advantages: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, config: DPPOOptions,
               ref_logp: torch.Tensor | None, correction: torch.Tensor | None,
               policy_mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(logp - alpha_logp)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    keep = keep_fn(logp, alpha_logp, advantages, config.delta_low, config.delta_high)
    per_token = -(ratio * adv) * keep.to(logp.dtype)
    per_token, kl = with_kl_penalty(per_token, logp, ref_logp, config.beta, correction, ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        m = mask.bool()
        dropped = m & ~keep
        clip_low = dropped & (adv < 0)
        clip_high = dropped & (adv > 0)
    return loss, token_stats(m, ratio.detach(), clip_low, clip_high, kl)


def dppo_tv_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                 mask: torch.Tensor, config: DPPOOptions, pik_logp: torch.Tensor | None = None,
                 ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                 policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV's loss (arXiv 2602.04879, eq. 13's mask M on the importance-weighted policy gradient):
    ``sum_t w_t [-(pi / alpha) A M_t + beta * KL_k3(pi || pi_ref)]``, ``M_t`` from :func:`dppo_tv_keep` between
    pi (detached) and alpha. Its gradient w.r.t. ``logp`` is ``-w_t (pi / alpha) A M_t`` (plus the KL's).

    As SkyRL's ``policy_loss_type="dppo"`` with ``dppo_type="binary_tv"``, whose behaviour policy is the rollout's
    mu when it has it: ours is alpha (mu when ``alpha_source`` is "sampler"). Differences: SkyRL clamps the
    log-ratio to [-20, 20] before the exponential (zero gradient beyond); ours does not, so the two agree wherever
    |log pi - log alpha| < 20. verl's ``dppo_tv`` writes the same gradient as ``-A sg(min(r, 20)) log pi M``.
    ``pik_logp`` is not used.

    Statistics: a dropped token counts in ``clip_high`` (A > 0) or ``clip_low`` (A < 0), as PPO's clipped ones.
    """
    return _dppo_loss(dppo_tv_keep, logp, alpha_logp, advantages, weights, mask, config, ref_logp, correction,
                      policy_mask)


def dppo_kl_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
                 mask: torch.Tensor, config: DPPOKLOptions, pik_logp: torch.Tensor | None = None,
                 ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                 policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL's loss (arXiv 2602.04879, eq. 14's mask M): as :func:`dppo_tv_loss` with ``M_t`` from
    :func:`dppo_kl_keep` (the Bernoulli KL(alpha(y) || pi(y)) beyond delta, in the advantage's direction).
    SkyRL's ``dppo_type="binary_kl"``, with the differences :func:`dppo_tv_loss` lists."""
    return _dppo_loss(dppo_kl_keep, logp, alpha_logp, advantages, weights, mask, config, ref_logp, correction,
                      policy_mask)
