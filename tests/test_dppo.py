"""DPPO's losses (lit_grpo.math.dppo): value, gradient and statistics written out by hand, the KL term and the
correction, the options and the registry."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.math.dppo import DPPOKLOptions, DPPOOptions, bernoulli_kl, dppo_kl_loss, dppo_tv_loss
from lit_grpo.training.losses import BUILTIN_LOSSES, LossOptions, build_loss, check_loss_output

F64 = torch.float64
# pi and alpha as probabilities; A = (+1.5, -0.5); the second sequence's last position is padding
P_PI = [[0.35, 0.75, 0.2], [0.05, 0.01, 0.9]]
P_ALPHA = [[0.1, 0.6, 0.5], [0.3, 0.05, 0.9]]
ADV = (1.5, -0.5)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
WEIGHTS = torch.tensor([[0.1, 0.2, 0.3], [0.15, 0.25, 0.0]], dtype=F64)


def logs(probs):
    return torch.tensor([[math.log(p) for p in row] for row in probs], dtype=F64)


def run(loss_fn, config, beta=0.0, ref=None, correction=None):
    logp = logs(P_PI).requires_grad_(True)
    loss, stats = loss_fn(logp=logp, alpha_logp=logs(P_ALPHA), advantages=torch.tensor(ADV, dtype=F64),
                          weights=WEIGHTS, mask=MASK, config=config.with_beta(beta), pik_logp=None, ref_logp=ref,
                          correction=correction)
    loss.backward()
    return float(loss.detach()), logp.grad, stats


def expected(keep):
    """Value and gradient of sum w * -(pi / alpha) A M written out: the gradient w.r.t. log pi is the same term."""
    value, grad = 0.0, [[0.0] * 3 for _ in range(2)]
    for s in range(2):
        for t in range(3):
            term = -(P_PI[s][t] / P_ALPHA[s][t]) * ADV[s] * keep[s][t] * float(WEIGHTS[s, t])
            value += term
            grad[s][t] = term
    return value, torch.tensor(grad, dtype=F64)


def test_dppo_tv_value_gradient_and_stats():
    # pi - alpha: [[0.25, 0.15, -0.3], [-0.25, -0.04]] (delta 0.2): token (0, 0) dropped (A > 0, rose by 0.25),
    # token (1, 0) dropped (A < 0, fell by 0.25); (0, 2) fell with A > 0: kept
    keep = [[0, 1, 1], [0, 1, 1]]
    value, grad, stats = run(dppo_tv_loss, DPPOOptions())
    want_value, want_grad = expected(keep)
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    # the numbers once, in full: -(0.75/0.6)*1.5*0.2 - (0.2/0.5)*1.5*0.3 + (0.01/0.05)*0.5*0.25
    assert want_value == pytest.approx(-0.375 - 0.18 + 0.025, rel=1e-12)
    assert float(stats["tokens"]) == 5 and float(stats["clip_high"]) == 1 and float(stats["clip_low"]) == 1
    assert float(stats["ratio_max"]) == pytest.approx(3.5, rel=1e-12)
    assert float(stats["ratio_sum"]) == pytest.approx(3.5 + 1.25 + 0.4 + 1 / 6 + 0.2, rel=1e-12)


def test_dppo_kl_value_gradient_and_stats():
    # KL(alpha || pi) per token: 0.1676, 0.0541 and 0.3237 beyond 0.05 in the advantage's direction: dropped
    # float32 inputs: the KL is a difference of logs (cancellation), so a few float32 ulps of the inputs show as
    # 1.5e-6 relative on one CPU (Intel, AVX-512) and below 1e-6 on another; a wrong formula is off by far more
    assert bernoulli_kl(torch.tensor(math.log(0.6)), torch.tensor(math.log(0.75))) == pytest.approx(
        0.6 * math.log(0.6 / 0.75) + 0.4 * math.log(0.4 / 0.25), rel=1e-5)
    keep = [[0, 0, 1], [0, 1, 1]]
    value, grad, stats = run(dppo_kl_loss, DPPOKLOptions())
    want_value, want_grad = expected(keep)
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert float(stats["clip_high"]) == 2 and float(stats["clip_low"]) == 1


def test_kl_term_and_correction():
    # beta * k3 on every token, the correction on the policy term only
    ref = logs([[0.3, 0.7, 0.25], [0.1, 0.02, 0.5]])
    correction = torch.tensor([[0.5, 2.0, 1.0], [1.0, 0.0, 1.0]], dtype=F64)
    beta = 0.1
    value, grad, stats = run(dppo_tv_loss, DPPOOptions(), beta=beta, ref=ref, correction=correction)
    keep = [[0, 1, 1], [0, 1, 1]]
    want_value, want_grad = 0.0, torch.zeros(2, 3, dtype=F64)
    for s in range(2):
        for t in range(3):
            w = float(WEIGHTS[s, t])
            policy = -(P_PI[s][t] / P_ALPHA[s][t]) * ADV[s] * keep[s][t] * float(correction[s, t])
            d = float(ref[s, t]) - math.log(P_PI[s][t])
            k3 = math.exp(d) - d - 1
            want_value += w * (policy + beta * k3)
            want_grad[s, t] = w * (policy + beta * (1 - math.exp(d)))  # d k3 / d log pi = 1 - pi_ref / pi
    assert value == pytest.approx(want_value, rel=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-12, atol=1e-15)
    assert float(stats["kl_sum"]) > 0


def test_on_policy_is_reinforce():
    # pi == alpha: nothing is dropped and the gradient is -w A, REINFORCE's
    logp = logs(P_ALPHA).requires_grad_(True)
    loss, stats = dppo_tv_loss(logp=logp, alpha_logp=logs(P_ALPHA), advantages=torch.tensor(ADV, dtype=F64),
                               weights=WEIGHTS, mask=MASK, config=DPPOOptions())
    loss.backward()
    torch.testing.assert_close(logp.grad, -WEIGHTS * torch.tensor(ADV, dtype=F64).unsqueeze(-1))
    assert float(stats["clip_low"] + stats["clip_high"]) == 0


def test_options_refuse_negative_thresholds():
    with pytest.raises(ValueError, match="delta_low must be >= 0.*-0.1"):
        DPPOOptions(delta_low=-0.1)
    with pytest.raises(ValueError, match="delta_high"):
        DPPOKLOptions(delta_high=float("nan"))
    assert (DPPOOptions().delta_low, DPPOOptions().delta_high) == (0.2, 0.2)
    assert (DPPOKLOptions().delta_low, DPPOKLOptions().delta_high) == (0.05, 0.05)


@pytest.mark.parametrize("name, kind", [("dppo_tv", DPPOOptions), ("dppo_kl", DPPOKLOptions)])
def test_registered(name, kind):
    assert name in BUILTIN_LOSSES and isinstance(getattr(LossOptions(), name), kind)
    loss = build_loss(name, {name: {"delta_low": 0.1}}, 0.04)
    assert type(loss.config) is kind and loss.config.delta_low == 0.1 and loss.config.beta == 0.04
    logp = logs(P_PI)
    out = loss.fn(logp=logp, alpha_logp=logs(P_ALPHA), advantages=torch.tensor(ADV, dtype=F64), weights=WEIGHTS,
                  mask=MASK, config=loss.config, pik_logp=logp, ref_logp=logp, correction=None)
    check_loss_output(name, out)
