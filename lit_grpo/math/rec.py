"""REC / REP / RED losses of Yao et al. (2025), "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm:
Demystifying Some Myths About GRPO and Its Friends" (arXiv 2509.24203), and a registry of policy losses.

The paper reads group-relative REINFORCE as an off-policy method and regularises it in three ways: by a hard
clip mask on the REINFORCE term (REC: OneSide, TwoSide, Ring, with or without importance sampling), by an
additive loss term (REP: OPMD, AsymRE), or by shaping the data distribution (RED: Drop, Weight). The summary
we work from gives no equation numbers; formulas are cited by the names it uses (REC, REP, RED; Figures 2-4;
the appendix sections on more clipping methods and on RED) and follow the notation of the paper's
reference implementation in Trinity-RFT:

    r = exp(log pi_theta - log alpha)  (detached; alpha = rollout policy, the paper's pi_old)
    per-token loss = -M * A * w * log pi_theta + regulariser,   M, w detached.

All per-token losses take the keyword arguments of :func:`lit_grpo.math.objective.grpo_loss` and return the
same ``(loss, stats)`` (the loss contract, written in :mod:`lit_grpo.losses`, whose registry adds each loss's
options group and RED-Drop's batch hook to the functions of :data:`POLICY_LOSSES`). The loss VALUE is the
REINFORCE pseudo-loss ``-A w log pi`` (not GRPO's surrogate ``-A pi/alpha``), so logged losses of the two
families are not comparable; their gradients are: with ``w = r``, ``-A r grad log pi = -A grad(pi/alpha)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from lit_grpo.math.kl import k3_kl
from lit_grpo.math.objective import GRPOLossConfig, grpo_loss, token_stats


@dataclass(frozen=True)
class RECLossConfig:
    """Knobs shared by the REC / REP / RED losses (defaults are the paper's, as Trinity-RFT ships them).

    ``eps_low`` / ``eps_high``: the inner clip band ``[1 - eps_low, 1 + eps_high]`` of REC-OneSide/TwoSide/Ring.
    ``ring_eps_low`` / ``ring_eps_high``: REC-Ring's outer edges ``1 - e'_low`` and ``1 + e'_high``.
    ``tau``: OPMD's squared-log-ratio coefficient and AsymRE's baseline shift (both 0.1 in the paper).
    ``red_weight_temperature``: RED-Weight's ``exp(A / temp)``. ``beta``: weight of the k3 KL to pi_ref.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    ring_eps_low: float = 0.6
    ring_eps_high: float = 2.0
    tau: float = 0.1
    red_weight_temperature: float = 1.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        # Lower edges 1 - eps must stay in [0, 1): beyond 1 the bound is negative and masks nothing.
        for name in ("eps_low", "ring_eps_low"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1] (lower clip edge 1 - {name} >= 0), got {value}")
        for name in ("eps_high", "ring_eps_high"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0 (upper clip edge 1 + {name}), got {value}")
        if not self.tau >= 0:
            raise ValueError(f"tau must be >= 0 (OPMD / AsymRE regulariser weight), got {self.tau}")
        if not self.red_weight_temperature > 0:
            raise ValueError(f"red_weight_temperature must be > 0 (RED-Weight exp(A / temp)), "
                             f"got {self.red_weight_temperature}")
        if not self.beta >= 0:
            raise ValueError(f"beta must be >= 0 (the KL weight), got {self.beta}")


LossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


# ---------------------------------------------------------------------------------------------------------
# Shared machinery


def _check_config(config: object) -> RECLossConfig:
    if not isinstance(config, RECLossConfig):
        raise ValueError(f"config must be a RECLossConfig for the REC/REP/RED losses, got {type(config).__name__}")
    return config


def _reinforce_family(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    ref_logp: torch.Tensor | None,
    keep: torch.Tensor | None,
    token_weight: torch.Tensor | float,
    coef: torch.Tensor,
    regulariser: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``sum(weights * (-keep * coef * token_weight * logp + regulariser + beta * k3))`` and grpo_loss's stats.

    ``coef`` is the per-sequence factor multiplying ``log pi`` (A, A + tau, A exp(A / temp)), broadcast over
    tokens; ``keep`` is the REC mask M (None: keep all); ``token_weight`` is w (1 or the detached ratio).
    """
    ratio = torch.exp(logp - alpha_logp).detach()
    factor = coef.to(logp.dtype).unsqueeze(-1) * token_weight
    if keep is not None:
        factor = factor * keep.to(logp.dtype)
    # factor is detached: the gradient w.r.t. logp is exactly -factor (REINFORCE), the value is a pseudo-loss.
    per_token = -factor.detach() * logp
    if regulariser is not None:
        per_token = per_token + regulariser
    kl = None
    if config.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp (the log-probs of pi_ref)")
        # The KL to pi_ref is not under the REC mask: M clips the policy-gradient term only (as grpo_loss,
        # whose KL is unclipped too).
        kl = k3_kl(logp, ref_logp)
        per_token = per_token + config.beta * kl
    loss = (per_token * weights).sum()

    with torch.no_grad():
        m = mask.bool()
        adv = advantages.unsqueeze(-1).expand_as(m)
        dropped = m & ~keep.bool() if keep is not None else torch.zeros_like(m)
        # A == 0 tokens carry no policy gradient: a masked one is counted on neither side.
        clip_low = dropped & (adv < 0)
        clip_high = dropped & (adv > 0)
    return loss, token_stats(m, ratio, clip_low, clip_high, kl)


def rec_masks(
    ratio: torch.Tensor, advantages: torch.Tensor, config: RECLossConfig
) -> dict[str, torch.Tensor]:
    """The three REC masks M (bool, shape of ``ratio``) on the detached ratio ``r = pi / alpha``.

    - one-side: ``[A >= 0][r <= 1 + eps_high] OR [A <= 0][r >= 1 - eps_low]`` (PPO's clip as a hard mask:
      drop a token only where PPO's clipped branch would zero its gradient).
    - two-side: ``[1 - eps_low <= r <= 1 + eps_high]`` whatever the sign of A.
    - ring: two-side ``OR [A >= 0][r <= 1 - ring_eps_low] OR [A <= 0][r >= 1 + ring_eps_high]``: also keeps
      tokens far out on the side where the update pulls r back towards 1.

    ``advantages`` is ``[S]`` (per sequence), broadcast over tokens. Both ``A >= 0`` and ``A <= 0`` hold at
    ``A == 0``; those tokens contribute 0 to the REINFORCE term either way.
    """
    r = ratio.detach()
    a = advantages.unsqueeze(-1)
    lo, hi = 1.0 - config.eps_low, 1.0 + config.eps_high
    inner = (r >= lo) & (r <= hi)
    one_side = ((a >= 0) & (r <= hi)) | ((a <= 0) & (r >= lo))
    ring = inner | ((a >= 0) & (r <= 1.0 - config.ring_eps_low)) | ((a <= 0) & (r >= 1.0 + config.ring_eps_high))
    return {"one_side": one_side, "two_side": inner, "ring": ring}


# ---------------------------------------------------------------------------------------------------------
# REC: regularisation by clipping


def _rec(
    kind: str,
    importance_sampling: bool,
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    ref_logp: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    config = _check_config(config)
    ratio = torch.exp(logp - alpha_logp).detach()
    keep = rec_masks(ratio, advantages, config)[kind]
    w: torch.Tensor | float = ratio if importance_sampling else 1.0
    return _reinforce_family(logp, alpha_logp, advantages, weights, mask, config, ref_logp, keep, w, advantages, None)


def rec_oneside_nois_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC-OneSide-NoIS (Yao et al. 2025, REC family, Fig. 2): ``-M_one-side * A * log pi`` (+ beta * k3).

    No importance weight (w = 1): the paper's point is that the one-sided clip mask alone regularises
    group-relative REINFORCE off-policy. Gradient w.r.t. ``logp``: ``-A * M * weights``. ``pik_logp`` is
    accepted for interface compatibility with grpo_loss and ignored (REC clips around 1, i.e. around alpha).
    """
    return _rec("one_side", False, logp, alpha_logp, advantages, weights, mask, config, ref_logp)


def rec_oneside_is_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC-OneSide-IS (Yao et al. 2025, REC family, Fig. 2): ``-M_one-side * A * sg(r) * log pi``.

    Its gradient ``-M A r grad log pi = -M A grad r`` is PPO/GRPO's clipped surrogate gradient (eq. 6 of Mroueh
    et al. with r' = 1): the clip written as a hard mask. Only the value differs (pseudo-loss ``-M A r log pi``).
    """
    return _rec("one_side", True, logp, alpha_logp, advantages, weights, mask, config, ref_logp)


def rec_twoside_is_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC-TwoSide-IS (Yao et al. 2025, appendix "more clipping methods", Fig. 3):
    ``-[1 - eps_low <= r <= 1 + eps_high] * A * sg(r) * log pi``: tokens leave the band on either side
    whatever the sign of A."""
    return _rec("two_side", True, logp, alpha_logp, advantages, weights, mask, config, ref_logp)


def rec_ring_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REC-Ring (Yao et al. 2025, appendix "more clipping methods", Fig. 3): ``-M_ring * A * log pi``.

    Choice: no importance weight (w = 1). The summary names only "REC-Ring"; the paper's experiments and
    Trinity-RFT's example config run it as REC-Ring-NoIS. Default ring edges e'_low = 0.6, e'_high = 2.0.
    """
    return _rec("ring", False, logp, alpha_logp, advantages, weights, mask, config, ref_logp)


# ---------------------------------------------------------------------------------------------------------
# REP: regularisation by an additive term


def opmd_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """OPMD (Kimi's online policy mirror descent read as regularised REINFORCE; Yao et al. 2025, REP family):
    ``-A * log pi + tau * (log pi - log alpha)^2`` per token, no mask.

    Choice: ``tau`` multiplies the square directly (the 1/2 of Kimi's form is absorbed into tau, as the summary
    and Trinity-RFT write it); gradient w.r.t. ``logp``: ``-A + 2 tau (log pi - log alpha)``, so at ``pi = alpha``
    it is plain REINFORCE.
    """
    config = _check_config(config)
    reg = config.tau * (logp - alpha_logp.detach()).pow(2)
    return _reinforce_family(logp, alpha_logp, advantages, weights, mask, config, ref_logp, None, 1.0, advantages, reg)


def asymre_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AsymRE (Meta's asymmetric REINFORCE; Yao et al. 2025, REP family): ``-(A + tau) * log pi``, no mask.

    The baseline is lowered by tau, i.e. REINFORCE plus the regulariser ``-tau * log pi`` (a cross-entropy
    towards the sampled data, a forward-KL(alpha || pi) pull). Choice: tau is added to whatever advantage the
    trainer passes (centred or whitened), not only to the raw ``R - mean`` of the paper's default.
    """
    config = _check_config(config)
    shifted = advantages + config.tau
    return _reinforce_family(logp, alpha_logp, advantages, weights, mask, config, ref_logp, None, 1.0, shifted, None)


# ---------------------------------------------------------------------------------------------------------
# RED: shaping the data distribution


def red_drop_advantages(
    rewards: torch.Tensor, generator: torch.Generator, eps: float = 1e-4, scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """RED-Drop's data shaping (Yao et al. 2025, appendix RED, Fig. 4): ``(advantages, keep_mask)``, both
    ``[num_groups, G]``.

    In each group a sample is "positive" when its reward is at or above the group mean. If a group has more
    negative than positive samples, ``neg - pos`` negatives chosen uniformly at random (from ``generator``)
    are dropped, so kept negatives == positives. Mean and std are then recomputed on the kept samples and
    advantages follow eq. 2 of Mroueh et al. on them (population std, ``eps`` inside the square root,
    ``scale=False`` centres only), exactly as :func:`lit_grpo.math.advantages.group_advantages` on a group with
    nothing to drop. Dropped samples get advantage 0 and ``keep_mask`` False.

    Choices: eq. 2's std convention (Trinity-RFT divides by ``std + 1e-6``); a sample equal to the group maximum
    is always positive, so float rounding of the mean can never make a zero-variance group drop everything.
    Trainer contract: fold ``keep_mask`` into the token mask before :func:`token_weights` (as eq. 8's mask), so
    dropped samples leave the aggregation denominators and the KL term, not just the REINFORCE term.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, G], got {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    is_pos = (r >= r.mean(dim=1, keepdim=True)) | (r == r.max(dim=1, keepdim=True).values)
    pos = is_pos.sum(dim=1, keepdim=True)
    surplus = (r.shape[1] - pos - pos).clamp(min=0)
    # Random order of negatives per group: positives get key +inf so negatives take ranks 0..neg-1, and the
    # `surplus` lowest-ranked negatives are dropped.
    keys = torch.rand(r.shape, generator=generator, device=generator.device, dtype=torch.float64).to(r.device)
    keys = keys.masked_fill(is_pos, float("inf"))
    rank = keys.argsort(dim=1).argsort(dim=1)
    keep = is_pos | (rank >= surplus)
    k = keep.to(torch.float64)
    n = k.sum(dim=1, keepdim=True)
    mean = (r * k).sum(dim=1, keepdim=True) / n
    centred = (r - mean) * k
    adv = centred / torch.sqrt(centred.pow(2).sum(dim=1, keepdim=True) / n + eps) if scale else centred
    return adv.to(torch.float32), keep


def red_drop_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RED-Drop's loss (Yao et al. 2025, appendix RED): plain group-relative REINFORCE ``-A * log pi``, no mask,
    no importance weight. The method lives in the data: ``advantages`` must come from
    :func:`red_drop_advantages` and its ``keep_mask`` be folded into ``mask`` (hence ``weights``) by the trainer.
    """
    config = _check_config(config)
    return _reinforce_family(logp, alpha_logp, advantages, weights, mask, config, ref_logp, None, 1.0, advantages, None)


def red_weights(advantages: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """RED-Weight's per-sample weights ``exp(A / temp)`` (Yao et al. 2025, appendix RED), elementwise on
    advantages of any shape (``[num_groups, G]`` or ``[S]``).

    Choice: unnormalised (no division by the group's sum of weights), as Trinity-RFT implements it: weights
    up-weight high-advantage samples, shifting the effective data distribution towards good answers.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.exp(advantages / temperature)


def red_weight_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: RECLossConfig,
    pik_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """RED-Weight (Yao et al. 2025, appendix RED, Fig. 4): ``-exp(A / temp) * A * log pi``, no mask, no IS.

    Choice: the sequence weight is computed here from ``advantages`` and ``config.red_weight_temperature`` with
    :func:`red_weights` and multiplied into the REINFORCE term (not into ``weights``, which keep meaning the
    aggregation), so the loss keeps grpo_loss's keyword interface.
    """
    config = _check_config(config)
    coef = advantages * red_weights(advantages, config.red_weight_temperature)
    return _reinforce_family(logp, alpha_logp, advantages, weights, mask, config, ref_logp, None, 1.0, coef, None)


# ---------------------------------------------------------------------------------------------------------
# Registry

POLICY_LOSSES: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "rec_oneside_nois": rec_oneside_nois_loss,
    "rec_oneside_is": rec_oneside_is_loss,
    "rec_twoside_is": rec_twoside_is_loss,
    "rec_ring": rec_ring_loss,
    "red_drop": red_drop_loss,
    "red_weight": red_weight_loss,
    "opmd": opmd_loss,
    "asymre": asymre_loss,
}


def make_loss_config(name: str, **kwargs: object) -> GRPOLossConfig | RECLossConfig:
    """The config for loss ``name``: :class:`GRPOLossConfig` for ``grpo``, :class:`RECLossConfig` otherwise.

    Unknown names and fields the chosen config does not have raise ValueError (a knob silently ignored by
    the chosen loss, e.g. ``ratio_cap`` for a REC loss, would be a wrong run).
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {tuple(POLICY_LOSSES)}")
    cls = GRPOLossConfig if name == "grpo" else RECLossConfig
    valid = tuple(f.name for f in fields(cls))
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ValueError(f"loss {name!r} ({cls.__name__}) has no option(s) {unknown}; expected among {valid}")
    return cls(**kwargs)  # type: ignore[arg-type]
