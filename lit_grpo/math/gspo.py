"""GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071): eq. 6's clipped surrogate on
one importance ratio per sequence, the geometric mean of its tokens' ratios (GSPO's eq. 7), instead of one per
token.

How alpha and pi_k enter, as in ``grpo``: the ratio is ``pi / alpha`` with alpha the policy that sampled the
rollouts (GSPO's pi_old), and the clip band sits around ``r' = 1`` (the paper's practical choice), or around
``r' = s(pi_k / alpha)``, the sequence ratio of pi_k, with ``exact_ref_ratio``. GSPO's clip ranges are tiny
(3e-4, 4e-4): when alpha lags pi_k (``WeightSync`` every v > 1 batches, asynchronous rollouts) a band around 1
can clip every sequence at the first iteration; ``exact_ref_ratio`` centres it on where pi_k already is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.math.objective import GRPOOptions, check_delta, token_stats, with_kl_penalty
from lit_grpo.math.surrogate import clip_bounds, clipped_surrogate, truncate_ratio


@dataclass(frozen=True)
class GSPOOptions(GRPOOptions):
    """Options of ``gspo``, the clipped surrogate on the sequence-level ratio (Zheng et al. 2025, eq. 5 and 7).
    Defaults are the paper's clip ranges (TRL's ``epsilon=3e-4``, ``epsilon_high=4e-4`` for GSPO).

    Args:
        eps_low: lower clip half-width of the sequence ratio: its band is [r' - eps_low, r' + eps_high].
        eps_high: upper clip half-width (None: eps_low).
        exact_ref_ratio: clip around r' = the sequence ratio of pi_k / alpha instead of r' = 1.
        ratio_cap: truncated importance sampling on the sequence ratio, s <= ratio_cap (None: no cap).
        delta: INTELLECT-2's two-sided clip on the sequence ratio (TRL's ``delta``, which it applies to sequence
            ratios too): the unclipped branch's s is capped at delta, > 1 + eps_high (None: off).
    """

    eps_low: float = 3e-4
    eps_high: float | None = 4e-4

    def __post_init__(self) -> None:
        if not self.eps_low > 0:
            raise ValueError(f"eps_low must be > 0 (the clip half-width of GSPO's sequence ratio), got {self.eps_low}")
        if not self.eps_upper > 0:
            raise ValueError(f"eps_high must be > 0 (the clip half-width of GSPO's sequence ratio), "
                             f"got {self.eps_high}")
        if self.ratio_cap is not None and not self.ratio_cap > 0:
            raise ValueError(f"ratio_cap must be > 0 or None, got {self.ratio_cap}")
        check_delta(self.delta, self.eps_upper)


def sequence_log_ratio(logp: torch.Tensor, alpha_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log s_i = (1 / |y_i|) sum_t (log pi(y_it) - log alpha(y_it))`` over the tokens of ``mask`` (GSPO's eq. 7
    in log space), ``[S, 1]`` from ``[S, T]``; gradient ``1 / |y_i|`` w.r.t. each counted ``logp``.

    A sequence without counted tokens gets 0 (ratio 1). Padding is replaced, not multiplied by the mask, so a
    padded position whose log-prob is -inf cannot make the sum NaN (TRL's ``(log_ratio * mask).sum(-1) /
    mask.sum(-1).clamp(min=1)`` otherwise).
    """
    m = mask.bool()
    log_ratio = torch.where(m, logp - alpha_logp, torch.zeros((), dtype=logp.dtype, device=logp.device))
    return (log_ratio.sum(-1) / m.sum(-1).clamp(min=1).to(logp.dtype)).unsqueeze(-1)


def gspo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
              mask: torch.Tensor, config: GSPOOptions, pik_logp: torch.Tensor | None = None,
              ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
              policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's loss (Zheng et al. 2025, eq. 5): ``-sum_t w_t [f_eps(s_i, r', A_i) - beta * KL_k3(pi || pi_ref)]``
    with ``s_i`` the sequence ratio of :func:`sequence_log_ratio` (eq. 7) and ``f_eps`` eq. 6's clipped surrogate.

    Each sequence's surrogate is broadcast over its tokens and weighted by the aggregation's ``weights``, as TRL's
    ``GRPOTrainer`` does with ``importance_sampling_level="sequence"``: under ``seq_mean_token_mean`` a sequence
    weighs ``1 / #sequences``, GSPO's ``1 / G`` average; under ``token_mean`` it weighs by its length. The
    gradient of ``s_i`` flows through every token of the sequence, ``s_i A_i (1 / |y_i|) sum_t grad log pi(y_it)``
    inside the band (GSPO's gradient analysis; no stop-gradient, as in TRL). GSPO-token, the variant with
    ``sg[s_i] pi(y_it) / sg[pi(y_it)]``, has the same value and gradient when every token has its sequence's
    advantage, as here, so it is not a separate loss. The KL term stays per token.

    Statistics: the ratio statistics are of ``s_i`` on each of its tokens; a clipped sequence counts all of its
    tokens in ``clip_low`` / ``clip_high``.
    """
    log_s = sequence_log_ratio(logp, alpha_logp, mask)
    raw_ratio = torch.exp(log_s)
    ratio = truncate_ratio(raw_ratio, config.ratio_cap)
    if config.exact_ref_ratio:
        if pik_logp is None:
            raise ValueError("exact_ref_ratio needs pik_logp (the log-probs of pi_k, the policy before this batch)")
        ref_ratio: torch.Tensor | float = torch.exp(sequence_log_ratio(pik_logp, alpha_logp, mask)).detach()
    else:
        ref_ratio = 1.0
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    eps_high = config.eps_upper
    surrogate = clipped_surrogate(ratio, ref_ratio, adv, config.eps_low, eps_high, config.delta).expand_as(logp)
    # the bias-corrected KL takes the sequence ratio, [S, 1], as TRL's coef_1 at importance_sampling_level="sequence"
    per_token, kl = with_kl_penalty(-surrogate, logp, ref_logp, config.beta, correction, raw_ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        r = ratio.detach().expand_as(logp)
        low, high = clip_bounds(ref_ratio, config.eps_low, eps_high)
        m = mask.bool()
        clip_low = m & (adv < 0) & (r < low)
        clip_high = m & (adv > 0) & (r > high)
    return loss, token_stats(m, r, clip_low, clip_high, kl)
