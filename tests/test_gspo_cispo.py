"""GSPO's sequence-level ratio and CISPO's clipped importance weight against hand computations on 2 sequences x 3
tokens, their invariants, their options and their registry entries."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.math import (
    CISPOOptions,
    GRPOOptions,
    GSPOOptions,
    LossConfig,
    cispo_loss,
    cispo_weight,
    grpo_loss,
    gspo_loss,
    red_drop_loss,
    sequence_log_ratio,
)
from lit_grpo.training.losses import BUILTIN_LOSSES, LossOptions, build_loss

# log alpha of each token, and d = log pi - log alpha. The last token of sequence 1 is padding: its d (5.0) is
# garbage that must not reach the sequence ratio, and its weight is 0.
ALPHA = [[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]]
D = [[0.1, -0.05, 0.2], [-0.3, 0.1, 5.0]]
MASK = [[1, 1, 1], [1, 1, 0]]
W = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]]
ADV = [1.0, -2.0]
REF = [[-1.2, -1.8, -0.4], [-1.1, -0.9, -3.0]]  # log pi_ref, for the KL term


def batch(d=D, requires_grad=True) -> dict[str, torch.Tensor]:
    alpha = torch.tensor(ALPHA, dtype=torch.float64)
    logp = (alpha + torch.tensor(d, dtype=torch.float64)).requires_grad_(requires_grad)
    return dict(logp=logp, alpha_logp=alpha, advantages=torch.tensor(ADV, dtype=torch.float64),
                weights=torch.tensor(W, dtype=torch.float64), mask=torch.tensor(MASK))


def logp_value(s: int, t: int) -> float:
    return ALPHA[s][t] + D[s][t]


def k3(s: int, t: int) -> tuple[float, float]:
    """k3 KL of one token and its derivative w.r.t. log pi, by hand: exp(x) - x - 1 with x = log pi_ref - log pi."""
    x = REF[s][t] - logp_value(s, t)
    return math.exp(x) - x - 1.0, 1.0 - math.exp(x)


# ---------------------------------------------------------------------------------------------------------
# GSPO


def hand_gspo(eps_low: float, eps_high: float, beta: float = 0.0, centre: list[float] | None = None):
    """GSPO's loss and d loss / d logp in python floats: s_i = exp(mean of d over the counted tokens), f_i =
    min(s_i A_i, clip(s_i, c_i - eps_low, c_i + eps_high) A_i), loss = sum_t w_t (-f_i + beta k3_t)."""
    loss, grad, ratios = 0.0, [[0.0] * 3 for _ in range(2)], []
    for s in range(2):
        n = sum(MASK[s])
        ratio = math.exp(sum(D[s][t] for t in range(3) if MASK[s][t]) / n)
        ratios.append(ratio)
        c = 1.0 if centre is None else centre[s]
        clipped = min(max(ratio, c - eps_low), c + eps_high)
        a = ADV[s]
        unclipped_branch = ratio * a <= clipped * a  # the min picks r A: its gradient flows
        f = min(ratio * a, clipped * a)
        w_sum = sum(W[s])
        loss += -f * w_sum
        for t in range(3):
            if not MASK[s][t]:
                continue
            # d s_i / d logp_t = s_i / n; the whole sequence's weight multiplies it
            grad[s][t] = -w_sum * a * ratio / n if unclipped_branch else 0.0
            if beta:
                kl, dkl = k3(s, t)
                loss += W[s][t] * beta * kl
                grad[s][t] += W[s][t] * beta * dkl
    return loss, grad, ratios


def test_sequence_log_ratio_is_the_mean_over_counted_tokens_only():
    b = batch()
    got = sequence_log_ratio(b["logp"], b["alpha_logp"], b["mask"])
    assert got.shape == (2, 1)
    assert got[:, 0].tolist() == pytest.approx([(0.1 - 0.05 + 0.2) / 3, (-0.3 + 0.1) / 2], abs=1e-15)
    # a row with no counted token: ratio 1, no NaN, even with -inf log-probs in its padding
    empty = sequence_log_ratio(torch.tensor([[-math.inf, 0.0]]), torch.zeros(1, 2), torch.zeros(1, 2))
    assert empty.tolist() == [[0.0]]


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_gspo_loss_and_gradient_by_hand(beta):
    # eps: s_0 = exp(0.0833) = 1.087 > 1.05 with A > 0 is clipped; s_1 = exp(-0.1) = 0.905 > 0.8 is not
    options = GSPOOptions(eps_low=0.2, eps_high=0.05).with_beta(beta)
    b = batch()
    ref = torch.tensor(REF, dtype=torch.float64) if beta else None
    loss, stats = gspo_loss(**b, config=options, pik_logp=None, ref_logp=ref)
    loss.backward()
    want, want_grad, ratios = hand_gspo(0.2, 0.05, beta)
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-14) for row in want_grad]
    if not beta:
        assert b["logp"].grad[0].abs().max() == 0  # the clipped sequence moves only through the KL term
    assert ratios[0] > 1.05 and 0.8 < ratios[1] < 1.0  # the example covers both branches
    # statistics: the sequence ratio on each counted token; the clipped sequence's 3 tokens on the high side
    assert stats["tokens"].item() == 5
    assert stats["ratio_sum"].item() == pytest.approx(3 * ratios[0] + 2 * ratios[1], abs=1e-14)
    assert stats["ratio_min"].item() == pytest.approx(ratios[1]) and stats["ratio_max"].item() == pytest.approx(
        ratios[0])
    assert (stats["clip_low"].item(), stats["clip_high"].item()) == (0, 3)
    if beta:
        assert stats["kl_sum"].item() == pytest.approx(sum(k3(s, t)[0] for s in range(2) for t in range(3)
                                                           if MASK[s][t]), abs=1e-14)


def test_gspo_negative_advantage_clipped_from_below():
    # s_1 = 0.905 < 1 - 0.05 with A < 0: clipped, no gradient; s_0 = 1.087 < 1 + 0.2 with A > 0: flows
    b = batch()
    loss, stats = gspo_loss(**b, config=GSPOOptions(eps_low=0.05, eps_high=0.2))
    loss.backward()
    want, want_grad, _ = hand_gspo(0.05, 0.2)
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-14) for row in want_grad]
    assert b["logp"].grad[1].abs().max() == 0 and b["logp"].grad[0].abs().min() > 0
    assert (stats["clip_low"].item(), stats["clip_high"].item()) == (2, 0)


def test_gspo_exact_ref_ratio_clips_around_the_sequence_ratio_of_pi_k():
    # pi_k sits where pi is on sequence 0 (so its band is centred on s_0: no clip) and at alpha on sequence 1
    pik = torch.tensor(ALPHA, dtype=torch.float64) + torch.tensor([D[0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    b = batch()
    options = GSPOOptions(eps_low=0.2, eps_high=0.05, exact_ref_ratio=True)
    loss, stats = gspo_loss(**b, config=options, pik_logp=pik)
    loss.backward()
    s0 = math.exp(sum(D[0]) / 3)
    want, want_grad, _ = hand_gspo(0.2, 0.05, centre=[s0, 1.0])
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-14) for row in want_grad]
    assert b["logp"].grad[0].abs().min() > 0  # around 1 this sequence was clipped (previous tests); here it moves
    assert stats["clip_high"].item() == 0
    with pytest.raises(ValueError, match="exact_ref_ratio needs pik_logp"):
        gspo_loss(**batch(), config=options, pik_logp=None)


def test_gspo_at_pi_equal_alpha_has_ratio_exactly_one_and_reinforces():
    # pi = alpha exactly: every sequence ratio is exactly 1 (whatever is in the padding), the value is
    # -sum_i A_i sum_t w_it, and with weights constant within a sequence the gradient is REINFORCE's and GRPO's
    d = [[0.0, 0.0, 0.0], [0.0, 0.0, 5.0]]
    weights = torch.tensor([[1 / 6, 1 / 6, 1 / 6], [1 / 4, 1 / 4, 0.0]], dtype=torch.float64)
    grads = {}
    for name, fn, config in [("gspo", gspo_loss, GSPOOptions()), ("grpo", grpo_loss, GRPOOptions()),
                             ("reinforce", red_drop_loss, LossConfig())]:
        b = batch(d)
        b["weights"] = weights
        loss, stats = fn(**b, config=config, pik_logp=None, ref_logp=None)
        loss.backward()
        grads[name] = b["logp"].grad
        if name == "gspo":
            assert stats["ratio_min"].item() == 1.0 and stats["ratio_max"].item() == 1.0
            assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0
            assert loss.item() == pytest.approx(-(1.0 * 0.5) - (-2.0 * 0.5), abs=1e-15)
    want = [[-1.0 / 6] * 3, [2.0 / 4, 2.0 / 4, 0.0]]  # -A_i w_it
    for name, grad in grads.items():
        assert grad.tolist() == [pytest.approx(row, abs=1e-15) for row in want], name


def test_gspo_ratio_cap_truncates_the_sequence_ratio():
    # cap 1.02 < s_0: the capped ratio is constant (gradient 0) and sits below the clip edge 1.05, so f_0 = 1.02 A
    b = batch()
    loss, _ = gspo_loss(**b, config=GSPOOptions(eps_low=0.2, eps_high=0.05, ratio_cap=1.02))
    loss.backward()
    s1 = math.exp(-0.1)
    assert loss.item() == pytest.approx(-1.02 * 1.0 * sum(W[0]) - s1 * -2.0 * sum(W[1]), abs=1e-14)
    assert b["logp"].grad[0].abs().max() == 0


# ---------------------------------------------------------------------------------------------------------
# CISPO


def hand_cispo(low: float | None, high: float, beta: float = 0.0):
    """CISPO's loss and d loss / d logp in python floats: weight_t = clip(exp(d_t), low, high) held constant,
    loss = sum_t w_t (-weight_t A log pi_t + beta k3_t), gradient -w_t weight_t A (+ w_t beta dk3_t)."""
    loss, grad, clips = 0.0, [[0.0] * 3 for _ in range(2)], [0, 0]
    for s in range(2):
        for t in range(3):
            if not MASK[s][t]:
                continue
            r = math.exp(D[s][t])
            weight = min(r, high) if low is None else min(max(r, low), high)
            clips[0] += low is not None and r < low
            clips[1] += r > high
            loss += W[s][t] * (-weight * ADV[s] * logp_value(s, t))
            grad[s][t] = -W[s][t] * weight * ADV[s]
            if beta:
                kl, dkl = k3(s, t)
                loss += W[s][t] * beta * kl
                grad[s][t] += W[s][t] * beta * dkl
    return loss, grad, clips


@pytest.mark.parametrize("eps_low, beta", [(None, 0.0), (0.2, 0.0), (0.2, 0.1)])
def test_cispo_loss_and_gradient_by_hand(eps_low, beta):
    # upper edge 1.1 clips r = exp(0.2) = 1.221 and exp(0.1) = 1.105 (twice); lower edge 0.8 clips exp(-0.3) = 0.741
    options = CISPOOptions(eps_high=0.1, eps_low=eps_low).with_beta(beta)
    b = batch()
    ref = torch.tensor(REF, dtype=torch.float64) if beta else None
    loss, stats = cispo_loss(**b, config=options, ref_logp=ref)
    loss.backward()
    want, want_grad, clips = hand_cispo(None if eps_low is None else 1 - eps_low, 1.1, beta)
    assert loss.item() == pytest.approx(want, abs=1e-14)
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-14) for row in want_grad]
    assert clips == [0 if eps_low is None else 1, 3]
    assert [stats["clip_low"].item(), stats["clip_high"].item()] == clips
    assert stats["ratio_max"].item() == pytest.approx(math.exp(0.2))  # the raw ratio, not the clipped weight


def test_cispo_gradient_flows_only_through_log_pi():
    # the weight is a constant of the loss: alpha (even with a gradient of its own) gets none, and the gradient
    # w.r.t. log pi is -w * weight * A, not the -w * A * r (1 + log pi) a differentiated ratio would add
    b = batch()
    b["alpha_logp"] = b["alpha_logp"].clone().requires_grad_(True)
    loss, _ = cispo_loss(**b, config=CISPOOptions(eps_high=0.1))
    loss.backward()
    assert b["alpha_logp"].grad is None
    _, want_grad, _ = hand_cispo(None, 1.1)
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-14) for row in want_grad]
    ratio = torch.tensor([[1.5, 0.5]], dtype=torch.float64, requires_grad=True)
    assert not cispo_weight(ratio, 0.8, 1.2).requires_grad
    assert cispo_weight(ratio, None, 1.2).tolist() == [[1.2, 0.5]]


def test_cispo_zero_advantage_tokens_are_not_counted_as_clipped():
    b = batch()
    b["advantages"] = torch.tensor([0.0, -2.0], dtype=torch.float64)
    _, stats = cispo_loss(**b, config=CISPOOptions(eps_high=0.1))
    assert stats["clip_high"].item() == 1  # sequence 1's exp(0.1); sequence 0's two are at A = 0


# ---------------------------------------------------------------------------------------------------------
# Options and registry


@pytest.mark.parametrize("cls, kwargs, match", [
    (GSPOOptions, dict(eps_low=0.0), r"^eps_low must be > 0 \(the clip half-width of GSPO's sequence ratio\), got 0"),
    (GSPOOptions, dict(eps_high=-1e-4), r"^eps_high must be > 0 .*got -0.0001"),
    (GSPOOptions, dict(ratio_cap=0.0), r"^ratio_cap must be > 0 or None, got 0"),
    (CISPOOptions, dict(eps_high=0.0), r"^eps_high must be > 0 \(CISPO's weight edge 1 \+ eps_high\), got 0"),
    (CISPOOptions, dict(eps_low=1.5), r"^eps_low must be in \(0, 1\] or None .*got 1.5"),
])
def test_bad_options_are_refused_in_one_line(cls, kwargs, match):
    with pytest.raises(ValueError, match=match) as error:
        cls(**kwargs)
    assert "\n" not in str(error.value)


def test_defaults_are_the_papers():
    assert (GSPOOptions().eps_low, GSPOOptions().eps_upper) == (3e-4, 4e-4)  # GSPO's clip ranges
    assert CISPOOptions().bounds == (None, 5.0)  # no lower edge; TRL's recommended epsilon_high (the edge) 5.0
    assert GSPOOptions(eps_low=1e-3, eps_high=None).eps_upper == 1e-3  # None: symmetric, as for grpo


def test_registry_builds_gspo_and_cispo_from_their_sections():
    gspo = build_loss("gspo", {"gspo": {"eps_low": 1e-3, "exact_ref_ratio": True}}, beta=0.1)
    assert gspo.fn is BUILTIN_LOSSES["gspo"].fn is gspo_loss
    assert gspo.config == GSPOOptions(eps_low=1e-3, exact_ref_ratio=True).with_beta(0.1) and gspo.config.beta == 0.1
    cispo = build_loss("cispo", {"cispo": {"eps_high": 2.0, "eps_low": 0.5}}, beta=0.0)
    assert cispo.fn is cispo_loss and cispo.config == CISPOOptions(eps_high=2.0, eps_low=0.5)
    assert isinstance(LossOptions().gspo, GSPOOptions) and isinstance(LossOptions().cispo, CISPOOptions)
    with pytest.raises(ValueError, match=r"^loss_options.cispo: eps_low must be in \(0, 1\]"):
        build_loss("cispo", {"cispo": {"eps_low": 2.0}}, 0.0)
    with pytest.raises(ValueError, match=r"loss_options.gspo is set .* but model.loss 'grpo' reads loss_options.grpo"):
        build_loss("grpo", {"gspo": {"eps_low": 1e-3}}, 0.0)


def test_cli_takes_the_losses_and_their_options(monkeypatch, capsys):
    import sys
    from pathlib import Path

    import yaml

    from lit_grpo.cli.lightning_cli import main

    config = Path(__file__).resolve().parents[1] / "configs" / "demo_cpu.yaml"
    monkeypatch.setattr(sys, "argv", ["lit_grpo"])
    for loss, option, value in [("gspo", "eps_low", 0.001), ("cispo", "eps_high", 2.5)]:
        with pytest.raises(SystemExit) as exit_:
            main(["fit", "--config", str(config), "--model.loss", loss,
                  f"--model.loss_options.{loss}.{option}", str(value), "--print_config"])
        assert exit_.value.code in (0, None), capsys.readouterr().err[-2000:]
        model = yaml.safe_load(capsys.readouterr().out)["model"]
        assert model["loss"] == loss and model["loss_options"][loss][option] == value
