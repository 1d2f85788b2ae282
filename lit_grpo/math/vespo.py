"""VESPO, Variational Sequence-Level Soft Policy Optimization (arXiv 2602.10693; TRL's ``loss_type="vespo"``,
``GRPOTrainer.get_gamma_weights``): REINFORCE weighted by a smooth, asymmetric function of the sequence's
importance ratio instead of a clip. The weight ``phi(w) = e^lambda w^k e^(-lambda w)`` (a Gamma density's shape,
normalised so that phi(1) = 1) fades out sequences far from the sampler on both sides: like ``w^k`` below 1,
like ``e^(-lambda w)`` above.

``w`` is the product of the sequence's token ratios ``pi_theta / alpha`` (alpha the policy that sampled), not
their geometric mean as GSPO's. A token-level sampler correction (an importance ratio) enters it in log space
(:func:`sequence_log_weight`); a per-sequence ratio cannot (:data:`REFUSED_CORRECTIONS`); keep masks (the
top-entropy tokens, the correction's masks) multiply the per-token term after phi, as TRL's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lit_grpo.math.corrections import SEQUENCE_RATIO_MODES
from lit_grpo.math.objective import LossConfig, token_stats, with_kl_penalty

# TRL's clamps (get_gamma_weights): token log-ratios to [-20, 20], the sequence's log-weight to [log 1e-8, 20]
TOKEN_LOG_RATIO_BOUND = 20.0
LOG_WEIGHT_MIN = math.log(1e-8)
LOG_WEIGHT_MAX = 20.0
#: the sampler corrections VESPO refuses: a sequence's one ratio, broadcast over its tokens, would be added to the
#: sequence's log-weight once per token (TRL accepts only its token modes with VESPO)
REFUSED_CORRECTIONS = SEQUENCE_RATIO_MODES


@dataclass(frozen=True)
class VESPOOptions(LossConfig):
    """Options of ``vespo`` (VESPO, arXiv 2602.10693; defaults are TRL's ``vespo_k_pos`` etc.): the weight's
    shape ``(k, lambda)`` is ``(k_pos, lambda_pos)`` for A >= 0 and ``(k_neg, lambda_neg)`` for A < 0.

    Args:
        k_pos: power of w for A >= 0 (how fast sequences with w < 1 are down-weighted), >= 0.
        lambda_pos: decay rate for A >= 0 (how fast sequences with w > 1 are down-weighted), > 0.
        k_neg: power of w for A < 0, >= 0.
        lambda_neg: decay rate for A < 0, > 0.
    """

    k_pos: float = 2.0
    lambda_pos: float = 3.0
    k_neg: float = 3.0
    lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        for name in ("k_pos", "k_neg"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number >= 0 (the power of w in VESPO's phi), got {value}")
        for name in ("lambda_pos", "lambda_neg"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0 (the decay rate of VESPO's phi), got {value}")


def sequence_log_weight(logp: torch.Tensor, alpha_logp: torch.Tensor, mask: torch.Tensor,
                        correction: torch.Tensor | None = None) -> torch.Tensor:
    """``log w_i = sum_t clamp(log pi(y_it) - log alpha(y_it), -20, 20) + sum_t clamp(log c_it, log 1e-8, 20)``
    over the tokens of ``mask``, then clamped to ``[log 1e-8, 20]``: VESPO's sequence IS ratio in log space,
    ``[S, 1]``, detached (TRL's ``get_gamma_weights``, clamps included).

    ``correction`` ``c`` (``[S, T]``, a per-token sampler correction such as a truncated IS ratio alpha / mu) makes
    w the ratio to the sampler mu, ``pi / alpha * alpha / mu``, as TRL adds its ``importance_sampling_ratio``; a
    masked-out token (c = 0) drives w to 1e-8. It must be a token-level weight: a sequence's weight broadcast
    over its tokens would be counted once per token (TRL refuses its sequence modes for VESPO). Padding is
    replaced, not multiplied by the mask (TRL sums the correction over every position, where its ratio is 1).
    """
    m = mask.bool()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    with torch.no_grad():
        log_ratio = (logp - alpha_logp).clamp(-TOKEN_LOG_RATIO_BOUND, TOKEN_LOG_RATIO_BOUND)
        log_w = torch.where(m, log_ratio, zero).sum(-1, keepdim=True)
        if correction is not None:
            log_c = torch.log(correction.to(logp.dtype)).clamp(LOG_WEIGHT_MIN, LOG_WEIGHT_MAX)
            log_w = log_w + torch.where(m, log_c, zero).sum(-1, keepdim=True)
        return log_w.clamp(LOG_WEIGHT_MIN, LOG_WEIGHT_MAX)


def gamma_weight(log_w: torch.Tensor, advantages: torch.Tensor, config: VESPOOptions) -> torch.Tensor:
    """VESPO's weight ``phi(w) = e^lambda w^k e^(-lambda w)`` (arXiv 2602.10693; computed as
    ``exp(lambda + k log w - lambda w)``), ``(k, lambda)`` chosen by the sign of A (A >= 0: the ``_pos`` pair), a
    non-finite value set to 0 as TRL does. ``log_w`` and ``advantages`` are ``[S, 1]``; phi(1) = 1, its maximum for
    ``k = lambda``."""
    nonneg = advantages >= 0
    # the shapes in log_w's dtype (torch.where of two Python floats would round them to float32)
    k = torch.where(nonneg, torch.tensor(config.k_pos, dtype=log_w.dtype, device=log_w.device),
                    torch.tensor(config.k_neg, dtype=log_w.dtype, device=log_w.device))
    lam = torch.where(nonneg, torch.tensor(config.lambda_pos, dtype=log_w.dtype, device=log_w.device),
                      torch.tensor(config.lambda_neg, dtype=log_w.dtype, device=log_w.device))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
               mask: torch.Tensor, config: VESPOOptions, pik_logp: torch.Tensor | None = None,
               ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
               policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO's loss (arXiv 2602.10693): ``sum_t w_t [-sg(phi(w_i)) A_i log pi(y_it) + beta * KL_k3]``, a REINFORCE
    pseudo-loss whose gradient w.r.t. ``logp`` is ``-w_t phi(w_i) A_i`` per token.

    ``correction`` enters ``w_i`` in log space (:func:`sequence_log_weight`) and is NOT also multiplied onto the
    per-token term, as TRL leaves its ``importance_sampling_ratio`` out of VESPO's term: phi already holds it.
    ``policy_mask`` (the top-entropy tokens, the correction's keep masks) multiplies the per-token term after phi
    and stays out of ``w_i``, as TRL's ``entropy_mask`` and off-policy mask: one masked token drops that token,
    not its sequence.
    TRL normalises by the batch's tokens (``model.loss_aggregation: token_mean``). The bias-corrected KL takes
    the token ratio ``pi_theta / alpha`` (TRL runs VESPO at ``importance_sampling_level="token"``).

    Statistics: the ratio statistics are of the token ratio; no token is clipped (phi is smooth).
    """
    ratio = torch.exp(logp - alpha_logp)
    adv = advantages.to(logp.dtype).unsqueeze(-1)
    phi = gamma_weight(sequence_log_weight(logp, alpha_logp, mask, correction), adv, config)
    per_token, kl = with_kl_penalty(-(phi * adv) * logp, logp, ref_logp, config.beta, None, ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()
    m = mask.bool()
    none = torch.zeros_like(m)
    return loss, token_stats(m, ratio.detach(), none, none, kl)
