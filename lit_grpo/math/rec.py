"""REC / REP / RED losses of Yao et al. (2025), "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm:
Demystifying Some Myths About GRPO and Its Friends" (arXiv 2509.24203): their options and their formulas.

The paper reads group-relative REINFORCE as an off-policy method and regularises it in three ways: by a hard
clip mask on the REINFORCE term (REC: OneSide, TwoSide, Ring, with or without importance sampling), by an
additive loss term (REP: OPMD, AsymRE), or by shaping the data distribution (RED: Drop, Weight). The summary
we work from gives no equation numbers; formulas are cited by the names it uses (REC, REP, RED; Figures 2-4;
the appendix sections on more clipping methods and on RED) and follow the notation of the paper's
reference implementation in Trinity-RFT:

    r = exp(log pi_theta - log alpha)  (detached; alpha = rollout policy, the paper's pi_old)
    per-token loss = -M * c * w * log pi_theta + regulariser,   M, c, w detached.

So the whole family is one function, :func:`reinforce_loss`, and each loss picks its pieces: the mask M
(:func:`one_side_mask`, :func:`two_side_mask`, :func:`ring_mask`; none keeps every token), the importance weight
w (1 or r), the per-sequence coefficient c (A, :func:`asymre_coefficient`, :func:`red_weight_coefficient`) and
the regulariser (:func:`opmd_regulariser`). Each loss takes the keyword arguments of
:func:`lit_grpo.math.objective.grpo_loss` and returns the same ``(loss, stats)`` (the loss contract, written in
:mod:`lit_grpo.training.losses`, whose registry names them); its ``config`` is its options dataclass below, which is
also its ``model.loss_options`` section. The loss VALUE is the REINFORCE pseudo-loss ``-A w log pi`` (not
GRPO's surrogate ``-A pi/alpha``), so logged losses of the two families are not comparable; their gradients
are: with ``w = r``, ``-A r grad log pi = -A grad(pi/alpha)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo.math.objective import ClipBand, LossConfig, LossFn, token_stats, with_kl_penalty

# ---------------------------------------------------------------------------------------------------------
# Options: each is the config its losses are called with (defaults are the paper's, as Trinity-RFT ships them)


def _check_lower_edge(name: str, value: float) -> None:
    # a lower edge 1 - eps must stay in [0, 1): beyond 1 the bound is negative and masks nothing
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1] (lower clip edge 1 - {name} >= 0), got {value}")


def _check_upper_edge(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0 (upper clip edge 1 + {name}), got {value}")


@dataclass(frozen=True)
class ClipOptions(ClipBand):
    """Options of a REC clip-mask loss (``rec_oneside_nois``, ``rec_oneside_is``, ``rec_twoside_is``).

    Args:
        eps_low: the mask's lower edge is 1 - eps_low, in (0, 1].
        eps_high: the mask's upper edge is 1 + eps_high (None: eps_low).
    """

    def __post_init__(self) -> None:
        _check_lower_edge("eps_low", self.eps_low)
        _check_upper_edge("eps_high", self.eps_upper)


@dataclass(frozen=True)
class RingOptions(ClipOptions):
    """Options of ``rec_ring``: the two-sided band plus the outer ring.

    Args:
        eps_low: the inner band's lower edge is 1 - eps_low, in (0, 1].
        eps_high: the inner band's upper edge is 1 + eps_high (None: eps_low).
        ring_eps_low: the ring's lower edge 1 - ring_eps_low, in (0, 1].
        ring_eps_high: the ring's upper edge 1 + ring_eps_high.
    """

    ring_eps_low: float = 0.6
    ring_eps_high: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_lower_edge("ring_eps_low", self.ring_eps_low)
        _check_upper_edge("ring_eps_high", self.ring_eps_high)


@dataclass(frozen=True)
class TauOptions(LossConfig):
    """Options of a REP loss (``opmd``, ``asymre``).

    Args:
        tau: OPMD's weight of (log pi - log alpha)^2, AsymRE's lowering of the baseline (both 0.1 in the paper).
    """

    tau: float = 0.1

    def __post_init__(self) -> None:
        if not self.tau >= 0:
            raise ValueError(f"tau must be >= 0 (OPMD / AsymRE regulariser weight), got {self.tau}")


@dataclass(frozen=True)
class REDWeightOptions(LossConfig):
    """Options of ``red_weight``.

    Args:
        temperature: each sample's REINFORCE term is weighted by exp(A / temperature), > 0.
    """

    temperature: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (RED-Weight's exp(A / temperature)), got {self.temperature}")


# ---------------------------------------------------------------------------------------------------------
# The pieces: masks M, coefficients c, regularisers

MaskFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]
CoefficientFn = Callable[[torch.Tensor, Any], torch.Tensor]
RegulariserFn = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def two_side_mask(ratio: torch.Tensor, advantages: torch.Tensor, config: ClipOptions) -> torch.Tensor:
    """REC-TwoSide's mask M (Yao et al. 2025, appendix "more clipping methods", Fig. 3), bool of ``ratio``'s
    shape: ``[1 - eps_low <= r <= 1 + eps_high]`` whatever the sign of A."""
    r = ratio.detach()
    return (r >= 1.0 - config.eps_low) & (r <= 1.0 + config.eps_upper)


def one_side_mask(ratio: torch.Tensor, advantages: torch.Tensor, config: ClipOptions) -> torch.Tensor:
    """REC-OneSide's mask M (Yao et al. 2025, REC family, Fig. 2), bool of ``ratio``'s shape:
    ``[A >= 0][r <= 1 + eps_high] OR [A <= 0][r >= 1 - eps_low]``, PPO's clip as a hard mask (drop a token only
    where PPO's clipped branch would zero its gradient).

    ``advantages`` is ``[S]`` (per sequence), broadcast over tokens. Both ``A >= 0`` and ``A <= 0`` hold at
    ``A == 0``; those tokens contribute 0 to the REINFORCE term either way.
    """
    r, a = ratio.detach(), advantages.unsqueeze(-1)
    return ((a >= 0) & (r <= 1.0 + config.eps_upper)) | ((a <= 0) & (r >= 1.0 - config.eps_low))


def ring_mask(ratio: torch.Tensor, advantages: torch.Tensor, config: RingOptions) -> torch.Tensor:
    """REC-Ring's mask M (Yao et al. 2025, appendix "more clipping methods", Fig. 3): the two-side band
    ``OR [A >= 0][r <= 1 - ring_eps_low] OR [A <= 0][r >= 1 + ring_eps_high]``, which also keeps tokens far out
    on the side where the update pulls r back towards 1."""
    r, a = ratio.detach(), advantages.unsqueeze(-1)
    outer = ((a >= 0) & (r <= 1.0 - config.ring_eps_low)) | ((a <= 0) & (r >= 1.0 + config.ring_eps_high))
    return two_side_mask(ratio, advantages, config) | outer


def advantage_coefficient(advantages: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Group-relative REINFORCE's coefficient of ``log pi``: the advantage itself, ``c = A``."""
    return advantages


def asymre_coefficient(advantages: torch.Tensor, config: TauOptions) -> torch.Tensor:
    """AsymRE's coefficient (Meta's asymmetric REINFORCE; Yao et al. 2025, REP family): ``c = A + tau``, the
    baseline lowered by tau, i.e. REINFORCE plus the regulariser ``-tau * log pi`` (a cross-entropy towards the
    sampled data, a forward-KL(alpha || pi) pull).

    Choice: tau is added to whatever advantage the trainer passes (centred or whitened), not only to the raw
    ``R - mean`` of the paper's default.
    """
    return advantages + config.tau


def red_weight_coefficient(advantages: torch.Tensor, config: REDWeightOptions) -> torch.Tensor:
    """RED-Weight's coefficient (Yao et al. 2025, appendix RED, Fig. 4): ``c = exp(A / temp) * A``, the sample's
    REINFORCE term weighted by :func:`red_weights`.

    Choice: the weight multiplies the REINFORCE term (not ``weights``, which keep meaning the aggregation), so the
    loss keeps grpo_loss's keyword interface.
    """
    return advantages * red_weights(advantages, config.temperature)


def opmd_regulariser(logp: torch.Tensor, alpha_logp: torch.Tensor, config: TauOptions) -> torch.Tensor:
    """OPMD's regulariser (Kimi's online policy mirror descent read as regularised REINFORCE; Yao et al. 2025,
    REP family): ``tau * (log pi - log alpha)^2`` per token.

    Choice: ``tau`` multiplies the square directly (the 1/2 of Kimi's form is absorbed into tau, as the summary
    and Trinity-RFT write it); its gradient w.r.t. ``logp`` is ``2 tau (log pi - log alpha)``, 0 at ``pi = alpha``.
    """
    return config.tau * (logp - alpha_logp.detach()).pow(2)


# ---------------------------------------------------------------------------------------------------------
# The family's one formula


def reinforce_loss(
    logp: torch.Tensor,
    alpha_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    ref_logp: torch.Tensor | None,
    keep: MaskFn | None = None,
    importance_sampling: bool = False,
    coefficient: CoefficientFn = advantage_coefficient,
    regulariser: RegulariserFn | None = None,
    correction: torch.Tensor | None = None,
    policy_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Regularised group-relative REINFORCE (Yao et al. 2025, the REC / REP / RED families):
    ``sum(weights * (-M * c * w * log pi + regulariser + beta * k3))`` and grpo_loss's statistics.

    ``keep`` gives the REC mask M on the detached ratio (None: keep all); ``importance_sampling`` makes w the
    detached ratio ``r`` (else 1); ``coefficient`` gives the per-sequence factor c of ``log pi``, broadcast over
    tokens; ``regulariser`` an additive per-token term (with gradient). M, c and w are detached, so the gradient
    w.r.t. ``logp`` of the REINFORCE term is exactly ``-M c w`` per weighted token and its value a pseudo-loss.
    Tokens M drops are counted as clipped, on the side of their advantage's sign (``A == 0`` on neither).
    """
    # the regulariser is made first: the graph then sums logp's gradients in the order it always has
    reg = regulariser(logp, alpha_logp, config) if regulariser is not None else None
    raw_ratio = torch.exp(logp - alpha_logp)  # with gradient, for the bias-corrected KL only
    ratio = raw_ratio.detach()
    kept = keep(ratio, advantages, config) if keep is not None else None
    w: torch.Tensor | float = ratio if importance_sampling else 1.0
    factor = coefficient(advantages, config).to(logp.dtype).unsqueeze(-1) * w
    if kept is not None:
        factor = factor * kept.to(logp.dtype)
    per_token = -factor.detach() * logp
    if reg is not None:
        per_token = per_token + reg
    # The KL to pi_ref is not under the REC mask: M clips the policy-gradient term only (as grpo_loss, whose KL is
    # unclipped too).
    per_token, kl = with_kl_penalty(per_token, logp, ref_logp, config.beta, correction, raw_ratio,
                                    config.kl_bias_correction, policy_mask)
    loss = (per_token * weights).sum()

    with torch.no_grad():
        m = mask.bool()
        adv = advantages.unsqueeze(-1).expand_as(m)
        dropped = m & ~kept.bool() if kept is not None else torch.zeros_like(m)
        # A == 0 tokens carry no policy gradient: a masked one is counted on neither side.
        clip_low = dropped & (adv < 0)
        clip_high = dropped & (adv > 0)
    return loss, token_stats(m, ratio, clip_low, clip_high, kl)


def _family_loss(
    name: str,
    config_type: type[LossConfig],
    doc: str,
    keep: MaskFn | None = None,
    importance_sampling: bool = False,
    coefficient: CoefficientFn = advantage_coefficient,
    regulariser: RegulariserFn | None = None,
) -> LossFn:
    """A loss of the family under the contract's signature: :func:`reinforce_loss` with these pieces. Its
    ``config`` annotation is ``config_type`` (how the registry finds its options class, as for your own loss)."""

    def loss(logp: torch.Tensor, alpha_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor,
             mask: torch.Tensor, config: LossConfig, pik_logp: torch.Tensor | None = None,
             ref_logp: torch.Tensor | None = None, correction: torch.Tensor | None = None,
             policy_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # pik_logp is the contract's and not used: the family clips around 1, i.e. around alpha
        if not isinstance(config, config_type):
            raise ValueError(f"config of {name} must be a {config_type.__name__}, got {type(config).__name__}")
        return reinforce_loss(logp, alpha_logp, advantages, weights, mask, config, ref_logp, keep,
                              importance_sampling, coefficient, regulariser, correction, policy_mask)

    # named as the module attribute it is bound to, so it reads (and pickles) like a plain function
    loss.__name__ = loss.__qualname__ = name
    loss.__doc__ = doc
    loss.__annotations__ = {**loss.__annotations__, "config": config_type}
    return loss


# ---------------------------------------------------------------------------------------------------------
# REC: regularisation by clipping

rec_oneside_nois_loss = _family_loss("rec_oneside_nois_loss", ClipOptions, keep=one_side_mask, doc="""\
REC-OneSide-NoIS (Yao et al. 2025, REC family, Fig. 2): ``-M_one-side * A * log pi`` (+ beta * k3).

No importance weight (w = 1): the paper's point is that the one-sided clip mask alone regularises group-relative
REINFORCE off-policy. Gradient w.r.t. ``logp``: ``-A * M * weights``.""")

rec_oneside_is_loss = _family_loss("rec_oneside_is_loss", ClipOptions, keep=one_side_mask, importance_sampling=True,
                                   doc="""\
REC-OneSide-IS (Yao et al. 2025, REC family, Fig. 2): ``-M_one-side * A * sg(r) * log pi``.

Its gradient ``-M A r grad log pi = -M A grad r`` is PPO/GRPO's clipped surrogate gradient (eq. 6 of Mroueh et al.
with r' = 1): the clip written as a hard mask. Only the value differs (pseudo-loss ``-M A r log pi``).""")

rec_twoside_is_loss = _family_loss("rec_twoside_is_loss", ClipOptions, keep=two_side_mask, importance_sampling=True,
                                   doc="""\
REC-TwoSide-IS (Yao et al. 2025, appendix "more clipping methods", Fig. 3):
``-[1 - eps_low <= r <= 1 + eps_high] * A * sg(r) * log pi``: tokens leave the band on either side whatever the
sign of A.""")

rec_ring_loss = _family_loss("rec_ring_loss", RingOptions, keep=ring_mask, doc="""\
REC-Ring (Yao et al. 2025, appendix "more clipping methods", Fig. 3): ``-M_ring * A * log pi``.

Choice: no importance weight (w = 1). The summary names only "REC-Ring"; the paper's experiments and Trinity-RFT's
example config run it as REC-Ring-NoIS. Default ring edges e'_low = 0.6, e'_high = 2.0.""")

# ---------------------------------------------------------------------------------------------------------
# REP: regularisation by an additive term

opmd_loss = _family_loss("opmd_loss", TauOptions, regulariser=opmd_regulariser, doc="""\
OPMD (Yao et al. 2025, REP family): ``-A * log pi + tau * (log pi - log alpha)^2`` per token
(:func:`opmd_regulariser`), no mask. Gradient w.r.t. ``logp``: ``-A + 2 tau (log pi - log alpha)``, so at
``pi = alpha`` it is plain REINFORCE.""")

asymre_loss = _family_loss("asymre_loss", TauOptions, coefficient=asymre_coefficient, doc="""\
AsymRE (Yao et al. 2025, REP family): ``-(A + tau) * log pi`` (:func:`asymre_coefficient`), no mask.""")


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


def red_weights(advantages: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """RED-Weight's per-sample weights ``exp(A / temp)`` (Yao et al. 2025, appendix RED), elementwise on
    advantages of any shape (``[num_groups, G]`` or ``[S]``).

    Choice: unnormalised (no division by the group's sum of weights), as Trinity-RFT implements it: weights
    up-weight high-advantage samples, shifting the effective data distribution towards good answers.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return torch.exp(advantages / temperature)


red_drop_loss = _family_loss("red_drop_loss", LossConfig, doc="""\
RED-Drop's loss (Yao et al. 2025, appendix RED): plain group-relative REINFORCE ``-A * log pi``, no mask, no
importance weight. The method lives in the data: ``advantages`` must come from :func:`red_drop_advantages` and
its ``keep_mask`` be folded into ``mask`` (hence ``weights``) by the trainer (the ``red_drop`` entry's batch hook
in :mod:`lit_grpo.training.losses`).""")

red_weight_loss = _family_loss("red_weight_loss", REDWeightOptions, coefficient=red_weight_coefficient, doc="""\
RED-Weight (Yao et al. 2025, appendix RED, Fig. 4): ``-exp(A / temp) * A * log pi``
(:func:`red_weight_coefficient`), no mask, no importance weight.""")
