"""SAPO, Soft Adaptive Policy Optimization (arXiv 2511.20347; TRL's ``loss_type="sapo"``): eq. 6's hard clip
replaced by a smooth gate of the token ratio. A token far from the sampler is not cut off at a band's edge:
its gradient fades out, smoothly and faster on the side of negative advantages (the larger tau).

The ratio is ``r = pi_theta / alpha`` per token, as in ``grpo`` (alpha the policy that sampled; pi_k plays no
part, as in TRL, which has no ``exact_ref_ratio`` for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.math.objective import LossConfig, token_stats, with_kl_penalty


@dataclass(frozen=True)
class SAPOOptions(LossConfig):
    """Options of ``sapo`` (SAPO, arXiv 2511.20347; defaults are TRL's ``sapo_temperature_pos`` /
    ``sapo_temperature_neg``).

    Args:
        tau_pos: the gate's temperature on tokens with A > 0, > 0.
        tau_neg: the gate's temperature on tokens with A <= 0, > 0; the paper takes it above tau_pos, so updates
            that lower a token's probability fade out faster off-policy.
    """

    tau_pos: float = 1.0
    tau_neg: float = 1.05

    def __post_init__(self) -> None:
        for name in ("tau_pos", "tau_neg"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (a temperature of SAPO's sigmoid gate), got {value}")


def sapo_gate(ratio: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
    """SAPO's soft gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))`` (arXiv 2511.20347, the gating function that
    replaces the clip; TRL's ``soft_coef_1``). Its derivative ``4 sigmoid (1 - sigmoid)`` is 1 at r = 1, so
    on-policy the gradient is the unclipped surrogate's, and it decays like ``exp(-tau |r - 1|)`` away from 1."""
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
              mask: torch.Tensor, config: SAPOOptions, pik_logp: torch.Tensor | None = None,
              ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
              policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO's loss (arXiv 2511.20347): ``sum_t w_t [-(4 / tau) sigmoid(tau (r_t - 1)) A + beta * KL_k3]`` with
    ``r_t = pi_theta / alpha`` and ``tau = tau_pos`` where A > 0, else ``tau_neg`` (as TRL's ``torch.where``).

    Gradient w.r.t. ``logp``: ``-w_t * 4 s (1 - s) r_t A`` with ``s = sigmoid(tau (r_t - 1))``. TRL averages per
    sequence then over sequences (``model.loss_aggregation: seq_mean_token_mean``). No token is clipped:
    ``clip_low`` and ``clip_high`` are 0.
    """
    ratio = torch.exp(logp - alpha_logp)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    # the temperatures in logp's dtype (torch.where of two Python floats would round them to float32)
    tau = torch.where(adv > 0, torch.tensor(config.tau_pos, dtype=logp.dtype, device=logp.device),
                      torch.tensor(config.tau_neg, dtype=logp.dtype, device=logp.device))
    per_token, kl = with_kl_penalty(-sapo_gate(ratio, tau) * adv, logp, ref_logp, config.beta, correction, ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()
    m = mask.bool()
    none = torch.zeros_like(m)
    return loss, token_stats(m, ratio.detach(), none, none, kl)
