"""GMPO, Geometric-Mean Policy Optimization (arXiv 2507.20673; TRL's experimental
``GMPOTrainer``, verl's ``geo_mean`` policy loss): maximise the geometric mean of a sequence's token ratios, each
clipped in log space, instead of their arithmetic mean (GRPO). One outlier token moves a geometric mean by
``1 / |y|`` of its log-ratio only, so GMPO is stable with a much wider band, ``(e^-0.4, e^0.4)``.

The ratio is ``pi_theta / alpha`` per token (alpha the policy that sampled, GMPO's pi_old), clipped around 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.math.gspo import sequence_log_ratio
from lit_grpo.math.objective import ClipBand, token_stats, with_kl_penalty


@dataclass(frozen=True)
class GMPOOptions(ClipBand):
    """Options of ``gmpo`` (GMPO, arXiv 2507.20673): the token log-ratio's clip band is ``[-eps_low, eps_high]``
    in LOG space, the ratio's ``[e^-eps_low, e^eps_high]`` (TRL's ``GMPOConfig.epsilon`` / ``epsilon_high``).

    Args:
        eps_low: the log-ratio's lower clip, > 0; the paper's (and TRL's) 0.4.
        eps_high: the log-ratio's upper clip, > 0 (None: eps_low).
    """

    eps_low: float = 0.4
    eps_high: float | None = None

    def __post_init__(self) -> None:
        if not self.eps_low > 0:
            raise ValueError(f"eps_low must be > 0 (GMPO's log-space clip, the ratio's lower edge e^-eps_low), "
                             f"got {self.eps_low}")
        if not self.eps_upper > 0:
            raise ValueError(f"eps_high must be > 0 (GMPO's log-space clip, the ratio's upper edge e^eps_high), "
                             f"got {self.eps_high}")


def gmpo_clipped_log_ratio(log_ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                           eps_high: float) -> torch.Tensor:
    """GMPO's per-token clip in log space (arXiv 2507.20673, the GMPO objective; TRL's ``GMPOTrainer``): for
    A > 0 ``min(l, clip(l, -eps_low, eps_high))``, else ``max(l, clip(l, -eps_low, eps_high))``, with
    ``l = log pi - log alpha``. PPO's pessimistic min written for ``sign(A) * l``: a token is held at the band's
    edge (and loses its gradient) only on the side where moving further would raise the objective."""
    clipped = log_ratio.clamp(-eps_low, eps_high)
    return torch.where(advantages > 0, torch.minimum(log_ratio, clipped), torch.maximum(log_ratio, clipped))


def gmpo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
              mask: torch.Tensor, config: GMPOOptions, pik_logp: torch.Tensor | None = None,
              ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
              policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO's loss (arXiv 2507.20673): ``-A_i exp(mean_t clip_A(log pi(y_it) - log alpha(y_it)))`` per sequence
    (:func:`gmpo_clipped_log_ratio`, the mean over the tokens of ``mask``), broadcast to its tokens, plus
    ``beta * KL_k3`` per token, weighted by ``weights``.

    Under ``seq_mean_token_mean`` this is TRL's ``GMPOTrainer``: a plain mean over sequences of ``-A_i g_i``, the
    KL averaged per sequence then over sequences. The gradient w.r.t. an unclipped token's ``logp`` is
    ``-A_i g_i / |y_i|`` times the sequence's weight. The bias-corrected KL (``kl_bias_correction``, which TRL's
    GMPO does not have) takes the unclipped geometric mean, GSPO's sequence ratio.

    Statistics: the ratio statistics are of the token ratios; ``clip_low`` / ``clip_high`` count the tokens
    whose log-ratio left the band on the side the clip holds (A < 0 below, A > 0 above), as TRL logs them.
    """
    log_ratio = logp - alpha_logp
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    eps_high = config.eps_upper
    clipped = gmpo_clipped_log_ratio(log_ratio, adv, config.eps_low, eps_high)
    geo_mean = torch.exp(sequence_log_ratio(clipped, torch.zeros_like(clipped), mask))
    seq_ratio = torch.exp(sequence_log_ratio(logp, alpha_logp, mask))
    per_token, kl = with_kl_penalty(-(geo_mean * adv).expand_as(logp), logp, ref_logp, config.beta, correction,
                                    seq_ratio, config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        m = mask.bool()
        clip_low = m & (adv < 0) & (log_ratio < -config.eps_low)
        clip_high = m & (adv > 0) & (log_ratio > eps_high)
    return loss, token_stats(m, torch.exp(log_ratio.detach()), clip_low, clip_high, kl)
