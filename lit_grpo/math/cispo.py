"""CISPO, Clipped IS-weight Policy Optimization (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, section 3.1):
token-level REINFORCE weighted by a clipped, stop-gradient importance weight. Clipping the weight instead of the
update (eq. 6's surrogate) keeps every token's gradient: a token far out of the band still moves, only with a
bounded weight.

The importance weight is ``r = pi / alpha`` with alpha the policy that sampled the rollouts (CISPO's pi_old):
correcting for the sampler is what the weight is for, so pi_k plays no part (``pik_logp`` is not used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.math.objective import LossConfig, token_stats, with_kl_penalty


@dataclass(frozen=True)
class CISPOOptions(LossConfig):
    """Options of ``cispo`` (MiniMax 2025, section 3.1): the weight is ``clip(r, 1 - eps_low, 1 + eps_high)``.

    Args:
        eps_high: the weight's upper edge is 1 + eps_high, > 0. TRL's ``epsilon_high`` for ``loss_type="cispo"``
            is the edge itself (ScaleRL's eps_max, 5.0 recommended): its 5.0 is eps_high 4.0, the default.
        eps_low: the weight's lower edge is 1 - eps_low, in (0, 1]; None: no lower edge (MiniMax's and TRL's
            choice).
    """

    eps_high: float = 4.0
    eps_low: float | None = None

    def __post_init__(self) -> None:
        if not self.eps_high > 0:
            raise ValueError(f"eps_high must be > 0 (CISPO's weight edge 1 + eps_high), got {self.eps_high}")
        if self.eps_low is not None and not 0 < self.eps_low <= 1:
            raise ValueError(f"eps_low must be in (0, 1] or None (CISPO's weight edge 1 - eps_low >= 0), "
                             f"got {self.eps_low}")

    @property
    def bounds(self) -> tuple[float | None, float]:
        """The weight's band ``(lower edge or None, upper edge)``."""
        return (None if self.eps_low is None else 1.0 - self.eps_low), 1.0 + self.eps_high


def cispo_weight(ratio: torch.Tensor, low: float | None, high: float) -> torch.Tensor:
    """CISPO's importance weight ``sg(clip(r, low, high))`` (MiniMax 2025, section 3.1, the clipped IS weight
    r-hat), detached: the gradient of the loss flows through ``log pi`` only. ``low`` None clips from above only."""
    return ratio.detach().clamp(min=low, max=high)


def cispo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
               mask: torch.Tensor, config: CISPOOptions, pik_logp: torch.Tensor | None = None,
               ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
               policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO's loss (MiniMax 2025, section 3.1, the CISPO objective):
    ``sum_t w_t [-sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A log pi(y_t) + beta * KL_k3(pi || pi_ref)]``.

    The value is a REINFORCE pseudo-loss (as the REC family's, :mod:`lit_grpo.math.rec`); its gradient w.r.t.
    ``logp`` is ``-w_t * weight_t * A`` per token (plus the KL term's). The aggregation is whatever ``weights``
    say: MiniMax and TRL normalise by the batch's tokens (``token_mean``).

    Statistics: a token whose weight was clipped counts in ``clip_high`` (r above the upper edge) or ``clip_low``
    (below the lower edge), whatever the sign of A; ``A == 0`` tokens carry no gradient and count on neither side.
    """
    raw_ratio = torch.exp(logp - alpha_logp)  # with gradient, for the bias-corrected KL only
    ratio = raw_ratio.detach()
    low, high = config.bounds
    weight = cispo_weight(ratio, low, high)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    per_token, kl = with_kl_penalty(-(weight * adv) * logp, logp, ref_logp, config.beta, correction, raw_ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        m = mask.bool()
        moves = m & (adv != 0)
        clip_high = moves & (ratio > high)
        clip_low = moves & (ratio < low) if low is not None else torch.zeros_like(m)
    return loss, token_stats(m, ratio, clip_low, clip_high, kl)
