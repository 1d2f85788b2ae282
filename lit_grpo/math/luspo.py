"""LUSPO, Length-Unbiased Sequence Policy Optimization (arXiv 2602.05261; TRL's ``loss_type="luspo"`` with
``importance_sampling_level="sequence"``): GSPO's clipped surrogate on the sequence ratio, with each sequence's loss
scaled by its length. GSPO's ``1 / G`` average over sequences gives a long and a short completion the same weight,
so per token the long one is under-trained; LUSPO sums over a sequence's tokens and averages over sequences.

The per-token term is GSPO's (:func:`lit_grpo.math.gspo.gspo_loss`: the sequence ratio of
:func:`~lit_grpo.math.gspo.sequence_log_ratio`, clipped as eq. 6, broadcast to the sequence's tokens, the KL per
token); the length scaling is the aggregation ``seq_mean_token_sum`` (:func:`lit_grpo.math.aggregation.token_weights`:
every counted token weighs ``1 / #sequences``), so ``model.loss_aggregation: seq_mean_token_sum`` is LUSPO. Under
another aggregation the loss is GSPO's under that aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lit_grpo.math.gspo import GSPOOptions, gspo_loss


@dataclass(frozen=True)
class LUSPOOptions(GSPOOptions):
    """Options of ``luspo`` (LUSPO, arXiv 2602.05261): GSPO's, with GSPO's clip ranges as defaults (LUSPO keeps
    GSPO's sequence ratio and clip and changes the normalisation only).

    Args:
        eps_low: lower clip half-width of the sequence ratio: its band is [r' - eps_low, r' + eps_high].
        eps_high: upper clip half-width (None: eps_low).
        exact_ref_ratio: clip around r' = the sequence ratio of pi_k / alpha instead of r' = 1.
        ratio_cap: truncated importance sampling on the sequence ratio, s <= ratio_cap (None: no cap).
        delta: INTELLECT-2's two-sided clip of the sequence ratio (TRL applies its ``delta`` to ``luspo``),
            > 1 + eps_high (None: off).
    """


def luspo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
               mask: torch.Tensor, config: LUSPOOptions, pik_logp: torch.Tensor | None = None,
               ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
               policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """LUSPO's loss (arXiv 2602.05261): ``(1 / #sequences) sum_i sum_t [-f_eps(s_i, r', A_i) + beta KL_k3(t)]``
    under ``seq_mean_token_sum`` weights, i.e. ``mean_i |y_i| (-f_eps(s_i, r', A_i)) + ...``, with ``s_i`` GSPO's
    sequence ratio (eq. 7 of GSPO) and ``f_eps`` eq. 6's clip (and ``delta``'s cap).

    Value, gradient and statistics are :func:`lit_grpo.math.gspo.gspo_loss`'s with these ``weights``; the
    bias-corrected KL (``kl_bias_correction``) takes the sequence ratio, as TRL's ``coef_1`` at the sequence level.
    """
    return gspo_loss(logp, alpha_logp, advantages, weights, mask, config, pik_logp, ref_logp, correction,
                     policy_mask)
