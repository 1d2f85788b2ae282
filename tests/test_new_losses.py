"""SAPO, LUSPO, VESPO and GMPO, INTELLECT-2's ``delta``, the bias-corrected KL and the entropy terms, against values
written out by hand (float64, small batches whose every number is computed here from its formula)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.math import (
    AGGREGATION_MODES,
    EntropyOptions,
    GMPOOptions,
    GRPOOptions,
    LUSPOOptions,
    SAPOOptions,
    VESPOOptions,
    adaptive_entropy_coefficient,
    applied_entropy_coefficient,
    entropy_bonus,
    entropy_threshold,
    gmpo_loss,
    grpo_loss,
    gspo_loss,
    high_entropy_mask,
    luspo_loss,
    sapo_loss,
    token_weights,
    vespo_loss,
    with_kl_penalty,
)
from lit_grpo.math.entropy_terms import quantile_linear
from lit_grpo.math.vespo import sequence_log_weight
from lit_grpo.training.losses import BUILTIN_LOSSES, STAT_KEYS, build_loss

F64 = torch.float64
NEW_LOSSES = ("sapo", "luspo", "vespo", "gmpo")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def k3(logp: float, ref: float) -> float:
    return math.exp(ref - logp) - (ref - logp) - 1.0


def run(fn, config, log_ratios, advantages, weights, mask=None, alpha=None, ref=None, correction=None,
        **optional):
    """Call loss ``fn`` with ``logp = alpha + log_ratios`` (and ``optional``, e.g. ``policy_mask``, as float64
    tensors): (loss, d loss / d logp, stats)."""
    log_ratios = torch.tensor(log_ratios, dtype=F64)
    alpha = torch.full_like(log_ratios, -1.0) if alpha is None else torch.tensor(alpha, dtype=F64)
    logp = (alpha + log_ratios).requires_grad_(True)
    mask = torch.ones_like(log_ratios) if mask is None else torch.tensor(mask, dtype=F64)
    loss, stats = fn(logp=logp, alpha_logp=alpha, advantages=torch.tensor(advantages, dtype=F64),
                     weights=torch.tensor(weights, dtype=F64), mask=mask, config=config, pik_logp=alpha,
                     ref_logp=None if ref is None else torch.tensor(ref, dtype=F64),
                     correction=None if correction is None else torch.tensor(correction, dtype=F64),
                     **{key: torch.tensor(value, dtype=F64) for key, value in optional.items()})
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats


# ------------------------------------------------------------------------------------------------------------
# SAPO


def test_sapo_value_and_gradient_by_hand():
    # token 1: r = 1.5, A = 2 (tau_pos = 1); token 2: r = 0.8, A = -1 (tau_neg = 1.05); weights 0.25 and 0.5
    loss, grad, stats = run(sapo_loss, SAPOOptions(), [[math.log(1.5)], [math.log(0.8)]], [2.0, -1.0],
                            [[0.25], [0.5]])
    s1, s2 = sigmoid(1.0 * 0.5), sigmoid(1.05 * -0.2)
    expected = 0.25 * (-(4 / 1.0) * s1 * 2.0) + 0.5 * (-(4 / 1.05) * s2 * -1.0)
    assert loss == pytest.approx(expected, rel=1e-14)
    # d/dlogp of -(4/tau) sigmoid(tau (r - 1)) A = -4 s (1 - s) r A
    assert grad[0][0] == pytest.approx(0.25 * -4 * s1 * (1 - s1) * 1.5 * 2.0, rel=1e-14)
    assert grad[1][0] == pytest.approx(0.5 * -4 * s2 * (1 - s2) * 0.8 * -1.0, rel=1e-14)
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0


def test_sapo_on_policy_gradient_is_the_plain_surrogates():
    # at r = 1 the gate's slope is 4 * 1/4 = 1 whatever tau: the gradient is -A per token, as the unclipped surrogate
    _, grad, _ = run(sapo_loss, SAPOOptions(tau_pos=3.0, tau_neg=7.0), [[0.0, 0.0]], [0.7], [[1.0, 1.0]])
    assert grad == [[pytest.approx(-0.7, rel=1e-14)] * 2]
    _, grad, _ = run(sapo_loss, SAPOOptions(tau_pos=3.0, tau_neg=7.0), [[0.0]], [-0.7], [[1.0]])
    assert grad[0][0] == pytest.approx(0.7, rel=1e-14)


@pytest.mark.parametrize("field", ["tau_pos", "tau_neg"])
def test_sapo_refuses_a_non_positive_temperature(field):
    with pytest.raises(ValueError, match=f"{field} must be > 0.*got 0"):
        SAPOOptions(**{field: 0.0})


# ------------------------------------------------------------------------------------------------------------
# LUSPO and its aggregation


def test_seq_mean_token_sum_weights():
    assert "seq_mean_token_sum" in AGGREGATION_MODES
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    w = token_weights(mask, "seq_mean_token_sum")
    assert w.tolist() == [[0.5, 0.5, 0.5], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]  # 2 sequences have counted tokens
    # globally normalised: another rank's 3 active sequences join the denominator
    w = token_weights(mask, "seq_mean_token_sum", global_sum=lambda count: count + 3)
    assert w[0, 0].item() == pytest.approx(1 / 5)
    assert token_weights(torch.zeros(2, 3), "seq_mean_token_sum").abs().sum().item() == 0.0


def test_luspo_value_and_gradient_by_hand():
    # sequence 1: log-ratios 0.1, 0.2, 0.0 -> s = e^0.1 = 1.105 > 1.08 with A = 1: clipped to 1.08, no gradient;
    # sequence 2: one token, s = e^-0.02 inside [0.95, 1.08], A = -0.5; sequence 3 empty
    mask = [[1, 1, 1], [1, 0, 0], [0, 0, 0]]
    weights = token_weights(torch.tensor(mask), "seq_mean_token_sum").double().tolist()
    loss, grad, stats = run(luspo_loss, LUSPOOptions(eps_low=0.05, eps_high=0.08), [[0.1, 0.2, 0.0], [-0.02, 5, 5],
                            [3, 3, 3]], [1.0, -0.5, 2.0], weights, mask=mask)
    s2 = math.exp(-0.02)
    # a sequence's loss times its length, averaged over the 2 sequences
    expected = (3 * -1.08 * 1.0 + 1 * -(s2 * -0.5)) / 2
    assert loss == pytest.approx(expected, rel=1e-14)
    assert grad[0] == [0.0, 0.0, 0.0]
    assert grad[1] == [pytest.approx(0.5 * s2 / 2, rel=1e-14), 0.0, 0.0]
    assert grad[2] == [0.0, 0.0, 0.0]
    assert stats["clip_high"].item() == 3 and stats["clip_low"].item() == 0


def test_luspo_and_gspo_differ_only_by_the_weights():
    gen = torch.Generator().manual_seed(3)
    ratios = (0.1 * torch.randn(3, 4, generator=gen, dtype=F64)).tolist()
    mask = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]]
    weights = token_weights(torch.tensor(mask), "seq_mean_token_sum").double().tolist()
    got = run(luspo_loss, LUSPOOptions(), ratios, [1.0, -1.0, 0.5], weights, mask=mask)
    ref = run(gspo_loss, LUSPOOptions(), ratios, [1.0, -1.0, 0.5], weights, mask=mask)
    assert got[0] == ref[0] and got[1] == ref[1]


# ------------------------------------------------------------------------------------------------------------
# VESPO


def phi(log_w: float, k: float, lam: float) -> float:
    return math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))


def test_vespo_value_and_gradient_by_hand():
    # sequence 1: log w = 0.1 + 0.2 (a product of ratios, not GSPO's mean), A = 1: (k, lambda) = (2, 3);
    # sequence 2: log w = -0.3, A = -2: (3, 2). Padding (5.0) is no part of w.
    alpha = [[-1.0, -2.0], [-0.5, -1.0]]
    mask = [[1, 1], [1, 0]]
    weights = [[0.25, 0.25], [0.5, 0.0]]
    loss, grad, stats = run(vespo_loss, VESPOOptions(), [[0.1, 0.2], [-0.3, 5.0]], [1.0, -2.0], weights, mask=mask,
                            alpha=alpha)
    p1, p2 = phi(0.3, 2, 3), phi(-0.3, 3, 2)
    logp = [[-0.9, -1.8], [-0.8, 4.0]]
    expected = 0.25 * (-p1 * logp[0][0]) + 0.25 * (-p1 * logp[0][1]) + 0.5 * (-p2 * -2.0 * logp[1][0])
    assert loss == pytest.approx(expected, rel=1e-13)
    # phi is detached: the gradient is -w_t phi A
    assert grad == [[pytest.approx(-0.25 * p1), pytest.approx(-0.25 * p1)], [pytest.approx(0.5 * p2 * 2.0), 0.0]]
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0


def test_vespo_phi_is_one_at_w_one_and_its_shape():
    assert run(vespo_loss, VESPOOptions(), [[0.0]], [1.0], [[1.0]])[1][0][0] == pytest.approx(-1.0, rel=1e-15)
    # phi(w) = e^lambda w^k e^(-lambda w) is largest at w = k / lambda: 2/3 for A >= 0
    values = [-run(vespo_loss, VESPOOptions(), [[math.log(w)]], [1.0], [[1.0]])[1][0][0] for w in (0.6, 2 / 3, 0.75)]
    assert values[1] > values[0] and values[1] > values[2]


def test_vespo_correction_enters_w_and_not_the_term():
    # c = (0.5, 1): log w = 0.3 + log 0.5; the per-token term is not multiplied by c
    loss, grad, _ = run(vespo_loss, VESPOOptions(), [[0.1, 0.2]], [1.0], [[0.5, 0.5]], correction=[[0.5, 1.0]])
    p = phi(0.3 + math.log(0.5), 2, 3)
    assert grad[0] == [pytest.approx(-0.5 * p, rel=1e-13), pytest.approx(-0.5 * p, rel=1e-13)]
    # a masked-out token (c = 0) sends w to TRL's floor 1e-8: phi(1e-8) = e^3 1e-16 e^(-3e-8)
    _, grad, _ = run(vespo_loss, VESPOOptions(), [[0.1, 0.2]], [1.0], [[1.0, 0.0]], correction=[[0.0, 1.0]])
    assert grad[0][0] == pytest.approx(-math.exp(3) * 1e-16 * math.exp(-3e-8), rel=1e-9)


def test_vespo_clamps_keep_the_weight_finite():
    # a token log-ratio of 50 is clamped to 20, w to e^20: phi = exp(3 + 40 - 3 e^20) = 0, not NaN
    loss, grad, _ = run(vespo_loss, VESPOOptions(), [[50.0]], [1.0], [[1.0]])
    assert math.isfinite(loss) and grad[0][0] == 0.0
    log_w = sequence_log_weight(torch.tensor([[-15.0, -15.0]], dtype=F64), torch.zeros(1, 2, dtype=F64),
                                torch.ones(1, 2))
    assert log_w.item() == pytest.approx(math.log(1e-8), rel=1e-15)


@pytest.mark.parametrize("field, value", [("k_pos", -1.0), ("k_neg", float("inf")), ("lambda_pos", 0.0),
                                          ("lambda_neg", -2.0)])
def test_vespo_refuses_bad_shapes(field, value):
    with pytest.raises(ValueError, match=f"{field} must be"):
        VESPOOptions(**{field: value})


# ------------------------------------------------------------------------------------------------------------
# GMPO


def test_gmpo_value_and_gradient_by_hand():
    # sequence 1 (A = 1): log-ratios 0.5, -0.1, 0.2 -> the first is held at 0.4; g = exp((0.4 - 0.1 + 0.2) / 3)
    # sequence 2 (A = -1): -0.5, 0.3 -> the first is held at -0.4; g = exp((-0.4 + 0.3) / 2)
    mask = [[1, 1, 1], [1, 1, 0]]
    weights = [[1 / 6] * 3, [1 / 4, 1 / 4, 0.0]]  # seq_mean_token_mean, in float64
    loss, grad, stats = run(gmpo_loss, GMPOOptions(), [[0.5, -0.1, 0.2], [-0.5, 0.3, 9.0]], [1.0, -1.0], weights,
                            mask=mask)
    g1, g2 = math.exp(0.5 / 3), math.exp(-0.1 / 2)
    assert loss == pytest.approx((-g1 * 1.0 + g2 * 1.0) / 2, rel=1e-14)
    assert grad[0] == [0.0, pytest.approx(-g1 / 3 / 2, rel=1e-14), pytest.approx(-g1 / 3 / 2, rel=1e-14)]
    assert grad[1] == [0.0, pytest.approx(g2 / 2 / 2, rel=1e-14), 0.0]
    assert stats["clip_high"].item() == 1 and stats["clip_low"].item() == 1


def test_gmpo_clip_is_pessimistic():
    # A > 0 and a log-ratio below -0.4: min(l, clip(l)) keeps l (and its gradient); A < 0 above 0.4 likewise
    loss, grad, stats = run(gmpo_loss, GMPOOptions(), [[-0.7]], [1.0], [[1.0]])
    assert loss == pytest.approx(-math.exp(-0.7), rel=1e-14) and grad[0][0] == pytest.approx(-math.exp(-0.7))
    loss, grad, stats = run(gmpo_loss, GMPOOptions(eps_low=0.1, eps_high=0.2), [[0.7]], [-1.0], [[1.0]])
    assert loss == pytest.approx(math.exp(0.7), rel=1e-14) and grad[0][0] == pytest.approx(math.exp(0.7))
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0


def test_gmpo_refuses_a_non_positive_band():
    with pytest.raises(ValueError, match="eps_low must be > 0"):
        GMPOOptions(eps_low=0.0)
    with pytest.raises(ValueError, match="eps_high must be > 0"):
        GMPOOptions(eps_high=-0.1)


# ------------------------------------------------------------------------------------------------------------
# delta: INTELLECT-2's two-sided clip


def test_delta_caps_the_unclipped_branch():
    # eps 0.2, delta 1.5. A = -1: r = 2 gives min(1.5 * -1, 1.2 * -1) = -1.5 (loss 1.5, no gradient; without
    # delta: loss 2, gradient 2 * r = 4); r = 1.3 below delta: loss 1.3, gradient 1.3. A = +1, r = 2: clipped.
    ratios = [[math.log(2.0)], [math.log(1.3)], [math.log(2.0)]]
    adv, weights = [-1.0, -1.0, 1.0], [[1.0], [1.0], [1.0]]
    loss, grad, _ = run(grpo_loss, GRPOOptions(delta=1.5), ratios, adv, weights)
    assert loss == pytest.approx(1.5 + 1.3 - 1.2, rel=1e-14)
    assert grad == [[0.0], [pytest.approx(1.3, rel=1e-14)], [0.0]]
    loss, grad, _ = run(grpo_loss, GRPOOptions(), ratios, adv, weights)
    assert loss == pytest.approx(2.0 + 1.3 - 1.2, rel=1e-14) and grad[0][0] == pytest.approx(2.0, rel=1e-14)


def test_delta_applies_to_sequence_ratios():
    # luspo / gspo: s = e^(log 2) = 2 with A = -1 and delta 1.5: the loss per token is 1.5, no gradient
    loss, grad, _ = run(luspo_loss, LUSPOOptions(eps_low=0.2, eps_high=0.2, delta=1.5), [[math.log(2.0)] * 2],
                        [-1.0], [[1.0, 1.0]])
    assert loss == pytest.approx(3.0, rel=1e-14) and grad == [[0.0, 0.0]]


@pytest.mark.parametrize("kind", [GRPOOptions, LUSPOOptions])
def test_delta_must_be_above_the_band(kind):
    with pytest.raises(ValueError, match=r"delta must be > 1 \+ eps_high = 1.2 .*got 1.2"):
        kind(eps_low=0.2, eps_high=0.2, delta=1.2)
    assert kind(eps_low=0.2, eps_high=0.2, delta=1.21).delta == 1.21


# ------------------------------------------------------------------------------------------------------------
# The bias-corrected KL


def test_bias_corrected_kl_by_hand():
    # A = 0: the loss is the KL term alone. logp = -1, alpha = -1.2 (r = e^0.2), ref = -1.5, beta 0.1:
    # beta r k3, gradient beta (r k3 + r (1 - pi_ref / pi)): the ratio is not detached
    config = build_loss("grpo", None, 0.1, kl_bias_correction=True).config
    assert config.kl_bias_correction and config.beta == 0.1
    loss, grad, stats = run(grpo_loss, config, [[0.2]], [0.0], [[1.0]], alpha=[[-1.2]], ref=[[-1.5]])
    r, kl = math.exp(0.2), k3(-1.0, -1.5)
    assert loss == pytest.approx(0.1 * r * kl, rel=1e-14)
    assert grad[0][0] == pytest.approx(0.1 * (r * kl + r * (1 - math.exp(-0.5))), rel=1e-14)
    assert stats["kl_sum"].item() == pytest.approx(r * kl, rel=1e-14)  # the weighted KL, as TRL logs it
    plain = run(grpo_loss, build_loss("grpo", None, 0.1).config, [[0.2]], [0.0], [[1.0]], alpha=[[-1.2]],
                ref=[[-1.5]])
    assert plain[0] == pytest.approx(0.1 * kl, rel=1e-14)


def test_bias_corrected_kl_of_a_sequence_loss_takes_the_sequence_ratio():
    config = build_loss("luspo", None, 0.1, kl_bias_correction=True).config
    loss, _, _ = run(luspo_loss, config, [[0.1, 0.3]], [0.0], [[1.0, 1.0]], ref=[[-1.2, -0.4]])
    s = math.exp(0.2)
    assert loss == pytest.approx(0.1 * s * (k3(-0.9, -1.2) + k3(-0.7, -0.4)), rel=1e-14)


def test_bias_correction_needs_the_ratio_and_a_loss_config():
    x = torch.zeros(1, 1, dtype=F64)
    with pytest.raises(ValueError, match="kl_bias_correction needs the loss's importance ratio"):
        with_kl_penalty(x, x, x, 0.1, bias_correction=True)
    with pytest.raises(ValueError, match="kl_bias_correction must be true or false"):
        GRPOOptions().with_beta(0.1, kl_bias_correction="yes")
    # a custom loss whose config is no LossConfig could not read the setting
    with pytest.raises(ValueError, match="kl_bias_correction needs a loss whose config is a LossConfig"):
        build_loss("tests.test_new_losses:plain_custom_loss", None, 0.1, kl_bias_correction=True)


def plain_custom_loss(logp, alpha_logp, advantages, weights, mask, config, pik_logp=None, ref_logp=None):
    raise AssertionError("never called")


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo", "rec_oneside_is", "opmd", *NEW_LOSSES])
def test_every_builtin_loss_weighs_its_kl_by_a_ratio(name):
    # on-policy (r = 1) the value is unchanged but the gradient gains beta * k3 * d r / d logp = beta * k3
    gen = torch.Generator().manual_seed(5)
    ref = (-1.0 + 0.3 * torch.randn(2, 3, generator=gen, dtype=F64)).tolist()
    args = ([[0.0] * 3] * 2, [0.0, 0.0], [[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    plain = run(BUILTIN_LOSSES[name].fn, build_loss(name, None, 0.2).config, *args, mask=[[1, 1, 0], [1, 0, 0]],
                ref=ref)
    corrected = run(BUILTIN_LOSSES[name].fn, build_loss(name, None, 0.2, kl_bias_correction=True).config, *args,
                    mask=[[1, 1, 0], [1, 0, 0]], ref=ref)
    assert corrected[0] == pytest.approx(plain[0], rel=1e-14)
    # a sequence-level ratio spreads d r over the sequence's tokens: compare the sequences' summed gradients
    extra = sum(w * 0.2 * k3(-1.0, ref[i][t]) for i, row in enumerate(args[2]) for t, w in enumerate(row))
    assert sum(map(sum, corrected[1])) - sum(map(sum, plain[1])) == pytest.approx(extra, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------
# What every new loss shares: registry, correction, empty batches


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_registered_with_options_and_stats(name):
    built = build_loss(name, None, 0.0)
    assert built.fn is BUILTIN_LOSSES[name].fn
    _, _, stats = run(built.fn, built.config, [[0.1, -0.1]], [1.0], [[0.5, 0.5]])
    assert set(STAT_KEYS) <= set(stats)
    with pytest.raises(ValueError, match="loss_options.sapo is set"):
        build_loss("grpo" if name == "sapo" else name, {"sapo": {"tau_pos": 2.0}}, 0.0)


@pytest.mark.parametrize("name", ["sapo", "luspo", "gmpo"])
def test_correction_scales_the_policy_term_only(name):
    # loss(weights w, correction c) = loss(weights w * c) + beta * sum(w (1 - c) k3)
    gen = torch.Generator().manual_seed(11)
    ratios = (0.2 * torch.randn(2, 3, generator=gen, dtype=F64)).tolist()
    ref = (-1.0 + 0.3 * torch.randn(2, 3, generator=gen, dtype=F64)).tolist()
    w = [[0.2, 0.2, 0.2], [0.2, 0.2, 0.0]]
    c = [[0.5, 1.0, 2.0], [0.0, 0.7, 3.0]]
    wc = [[a * b for a, b in zip(x, y)] for x, y in zip(w, c)]
    config = build_loss(name, None, 0.3).config
    with_c = run(BUILTIN_LOSSES[name].fn, config, ratios, [1.0, -0.5], w, ref=ref, correction=c)
    folded = run(BUILTIN_LOSSES[name].fn, config, ratios, [1.0, -0.5], wc, ref=ref)
    logp = [[-1.0 + x for x in row] for row in ratios]
    extra = sum(0.3 * w[i][t] * (1 - c[i][t]) * k3(logp[i][t], ref[i][t]) for i in range(2) for t in range(3))
    assert with_c[0] == pytest.approx(folded[0] + extra, rel=1e-13)


@pytest.mark.parametrize("name", list(BUILTIN_LOSSES))
def test_policy_mask_drops_the_policy_term_of_its_tokens_only(name):
    """``policy_mask`` m (the top-entropy tokens) multiplies the policy term after the loss's own weighting and
    leaves the KL term alone: loss(weights w, m) = loss(weights w * m) + beta * sum(w (1 - m) k3). For VESPO it
    stays out of the sequence weight w_i, which the tokens of ``mask`` alone make (with w * m as the weights,
    phi is that of the whole sequence)."""
    gen = torch.Generator().manual_seed(11)
    # ratios inside every clip band: the tokens the mask drops carry a policy term
    ratios = (0.05 * torch.randn(2, 3, generator=gen, dtype=F64)).tolist()
    ref = (-1.0 + 0.3 * torch.randn(2, 3, generator=gen, dtype=F64)).tolist()
    w = [[0.2, 0.2, 0.2], [0.2, 0.2, 0.0]]
    m = [[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]
    wm = [[a * b for a, b in zip(x, y)] for x, y in zip(w, m)]
    config = build_loss(name, None, 0.3).config
    fn = BUILTIN_LOSSES[name].fn
    masked = run(fn, config, ratios, [1.0, -0.5], w, mask=[[1, 1, 1], [1, 1, 0]], ref=ref, policy_mask=m)
    folded = run(fn, config, ratios, [1.0, -0.5], wm, mask=[[1, 1, 1], [1, 1, 0]], ref=ref)
    unmasked = run(fn, config, ratios, [1.0, -0.5], w, mask=[[1, 1, 1], [1, 1, 0]], ref=ref)
    logp = [[-1.0 + x for x in row] for row in ratios]
    extra = sum(0.3 * w[i][t] * (1 - m[i][t]) * k3(logp[i][t], ref[i][t]) for i in range(2) for t in range(3))
    assert masked[0] == pytest.approx(folded[0] + extra, rel=1e-13)
    assert masked[0] != pytest.approx(unmasked[0], rel=1e-6)  # the mask drops something


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_an_empty_batch_gives_zero_loss_and_finite_stats(name):
    built = build_loss(name, None, 0.0)
    loss, grad, stats = run(built.fn, built.config, [[0.3, 0.1]], [1.0], [[0.0, 0.0]], mask=[[0, 0]])
    assert loss == 0.0 and grad == [[0.0, 0.0]]
    assert stats["tokens"].item() == 0 and stats["ratio_min"].item() == math.inf


# ------------------------------------------------------------------------------------------------------------
# Entropy terms


ENTROPY = [[1.0, 2.0, 3.0, 4.0], [5.0, 9.0, 9.0, 9.0]]
ENTROPY_MASK = [[1, 1, 1, 1], [1, 0, 0, 0]]


@pytest.mark.parametrize("rho, threshold, kept", [
    (0.2, 4.2, [5.0]),  # the 0.8 quantile of 1..5: rank 0.8 * 4 = 3.2 -> 4 + 0.2 * (5 - 4)
    (0.5, 3.0, [3.0, 4.0, 5.0]),
    (1.0, 1.0, [1.0, 2.0, 3.0, 4.0, 5.0]),
    (0.0, 5.0, [5.0]),  # the highest-entropy token only
])
def test_high_entropy_mask_by_hand(rho, threshold, kept):
    e, m = torch.tensor(ENTROPY), torch.tensor(ENTROPY_MASK)
    assert entropy_threshold(e, m, rho).item() == pytest.approx(threshold, rel=1e-6)
    keep = high_entropy_mask(e, m, rho)
    assert e[keep].tolist() == kept  # padding (9.0) is never kept


def test_one_threshold_over_micro_batches():
    e, m = torch.tensor(ENTROPY), torch.tensor(ENTROPY_MASK)
    split = entropy_threshold([e[:1], e[1:]], [m[:1], m[1:]], 0.2)
    assert split.item() == entropy_threshold(e, m, 0.2).item()
    # the second micro-batch alone would keep its only token; against the batch's threshold it keeps it too, while
    # the first keeps none of its tokens (all below 4.2)
    assert high_entropy_mask(e[:1], m[:1], threshold=split).sum().item() == 0
    assert high_entropy_mask(e[1:], m[1:], threshold=split).tolist() == [[True, False, False, False]]
    assert high_entropy_mask(e, torch.zeros_like(m), 0.2).sum().item() == 0  # no counted token: none kept


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_quantile_is_torchs_bit_for_bit(n, q):
    values = torch.rand(n, generator=torch.Generator().manual_seed(n))
    assert quantile_linear(values, q).item() == torch.quantile(values, q).item()
    assert quantile_linear(values.double(), q).item() == torch.quantile(values.double(), q).item()


def test_entropy_bonus_by_hand():
    e = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]], dtype=F64, requires_grad=True)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]])
    bonus = entropy_bonus(e, m)
    assert bonus.item() == pytest.approx(2.5)
    bonus.backward()
    assert e.grad.tolist() == [[0.25, 0.25, 0.25], [0.25, 0.0, 0.0]]
    # with the batch's token count, the micro-batches' bonuses add up to the batch's
    parts = entropy_bonus(e[:1], m[:1], total_tokens=4) + entropy_bonus(e[1:], m[1:], total_tokens=4)
    assert parts.item() == pytest.approx(2.5)
    assert entropy_bonus(e, torch.zeros_like(m)).item() == 0.0


def test_adaptive_entropy_coefficient_by_hand():
    assert adaptive_entropy_coefficient(0.1, 0.1, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.105)  # at/below: up
    assert adaptive_entropy_coefficient(0.1, 0.2, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.105)
    assert adaptive_entropy_coefficient(0.1, 0.3, 0.2, 0.005, 0.0, 1.0) == pytest.approx(0.095)  # above: down
    assert adaptive_entropy_coefficient(0.999, 0.1, 0.2, 0.005, 0.0, 1.0) == 1.0
    assert adaptive_entropy_coefficient(0.002, 0.3, 0.2, 0.005, 0.0, 1.0) == 0.0
    assert applied_entropy_coefficient(0.3, None, 0.2, adaptive=True) == 0.0  # not measured yet
    assert applied_entropy_coefficient(0.3, 0.1, 0.2, adaptive=True) == 0.3
    assert applied_entropy_coefficient(0.3, 0.5, 0.2, adaptive=True) == 0.0
    assert applied_entropy_coefficient(0.3, 0.5, 0.2, adaptive=False) == 0.3


def test_entropy_options_defaults_and_refusals():
    o = EntropyOptions()
    assert (o.top_entropy_quantile, o.coef, o.adaptive, o.target, o.coef_delta, o.coef_min, o.coef_max) == (
        1.0, 0.0, False, 0.2, 0.005, 0.0, 1.0)  # TRL's GRPOConfig defaults
    assert not o.masks_tokens and not o.bonus_enabled
    assert EntropyOptions(adaptive=True).bonus_enabled and EntropyOptions(top_entropy_quantile=0.2).masks_tokens
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        EntropyOptions(top_entropy_quantile=1.5)
    with pytest.raises(ValueError, match="coef must be a finite number >= 0"):
        EntropyOptions(coef=-0.1)
    with pytest.raises(ValueError, match="coef_min .* must be <= coef_max"):
        EntropyOptions(coef_min=0.5, coef_max=0.1)
    with pytest.raises(ValueError, match=r"coef \(2.0\) must lie in"):
        EntropyOptions(coef=2.0, adaptive=True)
