"""Sampler corrections (lit_grpo.math.corrections): every mode against values written out by hand, padding and NaN,
the options' refusals, the mismatch statistics, and the on-policy invariant (weight exactly 1)."""

from __future__ import annotations

import math

import pytest
import torch

from lit_grpo.math.corrections import (
    CORRECTION_MODES,
    CorrectionOptions,
    correction_weight,
    mismatch_stats,
)
from lit_grpo.training.stat_reduction import MICRO_BATCHES, reduction

F64 = torch.float64
# two sequences of three tokens; the second has two counted tokens and one padded position
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
COUNTED = MASK.bool()
# pi_old and mu as probabilities of the sampled tokens; the padded position holds garbage (mu = 0, log mu = -inf)
P_OLD = [[0.4, 0.9, 0.2], [0.3, 0.5, 1.0]]
P_MU = [[0.1, 0.6, 0.5], [0.3, 0.05, 0.0]]
# rho = pi_old / mu on the counted tokens: [[4, 1.5, 0.4], [1, 10, -]]


def logs(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else -math.inf for p in row] for row in probs], dtype=F64)


OLD, MU = logs(P_OLD), logs(P_MU)


def weight(mode: str, logp: torch.Tensor | None = None, advantages: tuple[float, float] = (1.0, -1.0),
           **bounds: float):
    options = CorrectionOptions(mode, **bounds)
    logp = OLD if logp is None else logp
    out = correction_weight(options, OLD, MU, logp, torch.tensor(advantages, dtype=F64), MASK)
    assert out.weight.dtype == logp.dtype and out.weight.shape == MASK.shape
    assert torch.isfinite(out.weight).all(), out.weight  # the padded position's -inf must not leak
    assert not out.weight.requires_grad
    return out


def assert_weight(out, expected: list[list[float]]) -> None:
    # compare on counted tokens; the padded position's weight only has to be finite (checked in `weight`)
    got = torch.where(COUNTED, out.weight, 0.0)
    want = torch.where(COUNTED, torch.tensor(expected, dtype=F64), 0.0)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (got, want)


def flags(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "x" for c in row] for row in rows])


def test_none_is_all_ones_in_logps_dtype():
    logp = OLD.to(torch.float32)
    out = correction_weight(CorrectionOptions(), OLD, MU, logp, torch.zeros(2), MASK)
    assert out.weight.dtype == torch.float32 and (out.weight == 1).all()
    assert not out.masked.any() and not out.truncated.any()


def test_token_truncate():
    # default (None, 3.0): rho 4 and 10 clamp to 3
    out = weight("token_truncate")
    assert_weight(out, [[3.0, 1.5, 0.4], [1.0, 3.0, 0]])
    assert torch.equal(out.truncated, flags(["x..", ".x."]))
    assert not out.masked.any()
    # with a lower bound too: 0.4 rises to 0.5
    out = weight("token_truncate", low=0.5, high=2.0)
    assert_weight(out, [[2.0, 1.5, 0.5], [1.0, 2.0, 0]])
    assert torch.equal(out.truncated, flags(["x.x", ".x."]))


def test_token_mask():
    out = weight("token_mask")
    assert_weight(out, [[0.0, 1.5, 0.4], [1.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["x..", ".x."]))
    assert not out.truncated.any()
    out = weight("token_mask", low=0.5, high=5.0)
    assert_weight(out, [[4.0, 1.5, 0.0], [1.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["..x", ".x."]))


def test_sequence_truncate():
    # products over counted tokens: 4 * 1.5 * 0.4 = 2.4, 1 * 10 = 10 (the padded -inf is not counted)
    out = weight("sequence_truncate")
    assert_weight(out, [[2.4] * 3, [3.0, 3.0, 0]])
    assert torch.equal(out.truncated, flags(["...", "xx."]))
    out = weight("sequence_truncate", low=2.5, high=20.0)
    assert_weight(out, [[2.5] * 3, [10.0, 10.0, 0]])
    assert torch.equal(out.truncated, flags(["xxx", "..."]))


def test_sequence_mask():
    out = weight("sequence_mask")
    assert_weight(out, [[2.4] * 3, [0.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["...", "xx."]))
    out = weight("sequence_mask", low=2.5, high=20.0)
    assert_weight(out, [[0.0] * 3, [10.0, 10.0, 0]])
    assert torch.equal(out.masked, flags(["xxx", "..."]))


def test_icepop_keeps_rho_inside_its_band():
    # IcePop's M(k) = k on [0.5, 5], 0 outside: rho 0.4 and 10 are dropped, 4 keeps its value 4
    out = weight("icepop")
    assert_weight(out, [[4.0, 1.5, 0.0], [1.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["..x", ".x."]))
    assert CorrectionOptions("icepop").bounds() == (0.5, 5.0)


def test_geometric_mask():
    # geometric means: 2.4 ** (1/3) = 1.3389..., 10 ** (1/2) = 3.1623...
    assert 1.33 < 2.4 ** (1 / 3) < 1.34 and 3.16 < math.sqrt(10) < 3.17
    out = weight("geometric_mask")  # [0.99, 1.01]: both out
    assert_weight(out, [[0.0] * 3, [0.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["xxx", "xx."]))
    out = weight("geometric_mask", low=0.5, high=2.0)
    assert_weight(out, [[1.0] * 3, [0.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["...", "xx."]))
    out = weight("geometric_mask", low=1.3, high=3.2)
    assert_weight(out, [[1.0] * 3, [1.0, 1.0, 0]])
    assert not out.masked.any() and not out.truncated.any()


def test_off_policy_mask():
    # pi_theta equals mu on sequence 0 (mean log mu - log pi = 0); on sequence 1 it is [0.1, 0.01] against mu's
    # [0.3, 0.05]: mean (log 3 + log 5) / 2 = 1.354 > delta 0.5
    pi = logs([[0.1, 0.6, 0.5], [0.1, 0.01, 0.7]])
    assert (math.log(3) + math.log(5)) / 2 > 0.5
    out = weight("off_policy_mask", logp=pi, advantages=(-1.0, -1.0))
    assert_weight(out, [[1.0] * 3, [0.0, 0.0, 0]])
    assert torch.equal(out.masked, flags(["...", "xx."]))
    # A >= 0 keeps a sequence whatever its divergence (A = 0 included)
    out = weight("off_policy_mask", logp=pi, advantages=(-1.0, 0.0))
    assert_weight(out, [[1.0] * 3, [1.0, 1.0, 0]])
    # a threshold above the divergence keeps it too
    out = weight("off_policy_mask", logp=pi, advantages=(-1.0, -1.0), high=1.4)
    assert_weight(out, [[1.0] * 3, [1.0, 1.0, 0]])


# pi_theta for the DPPO masks, against mu = [[0.1, 0.6, 0.5], [0.3, 0.05, -]]; A = (+1, -1)
PI_DPPO = [[0.35, 0.75, 0.2], [0.05, 0.01, 0.5]]


def bern_kl(p: float, q: float) -> float:
    return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))


def test_dppo_tv_mask():
    # differences pi - mu: [[0.25, 0.15, -0.3], [-0.25, -0.04]]. A > 0 drops pi - mu > 0.2 (token 0, not token 2,
    # which moved the other way); A < 0 drops mu - pi > 0.2 (token 0)
    out = weight("dppo_tv", logp=logs(PI_DPPO))
    assert_weight(out, [[0.0, 1.0, 1.0], [0.0, 1.0, 0]])
    assert torch.equal(out.masked, flags(["x..", "x.."]))
    out = weight("dppo_tv", logp=logs(PI_DPPO), low=0.3, high=0.1)
    assert_weight(out, [[0.0, 0.0, 1.0], [1.0, 1.0, 0]])


def test_dppo_kl_mask():
    kls = [[bern_kl(0.1, 0.35), bern_kl(0.6, 0.75), bern_kl(0.5, 0.2)], [bern_kl(0.3, 0.05), bern_kl(0.05, 0.01)]]
    # KL(mu || pi) per token: 0.1676, 0.0541 (TV keeps it: 0.15 < 0.2), 0.2231 (but pi < mu with A > 0: kept),
    # 0.3237, 0.0413 (under 0.05: kept)
    assert kls[0][0] > 0.05 and kls[0][1] > 0.05 and kls[1][0] > 0.05 and kls[1][1] < 0.05
    out = weight("dppo_kl", logp=logs(PI_DPPO))
    assert_weight(out, [[0.0, 0.0, 1.0], [0.0, 1.0, 0]])
    assert torch.equal(out.masked, flags(["xx.", "x.."]))
    assert CorrectionOptions("dppo_kl").bounds() == (0.05, 0.05)
    assert CorrectionOptions("dppo_tv").bounds() == (0.2, 0.2)


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_on_policy_weight_is_exactly_one(mode):
    # old == mu == pi_theta: every mode's weight is exactly 1 on counted tokens with its default bounds
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(4, 6, generator=gen, dtype=F64) * 4
    mask = (torch.arange(6) < torch.tensor([[6], [3], [1], [5]])).long()
    advantages = torch.tensor([1.5, -0.5, 0.0, -2.0], dtype=F64)
    out = correction_weight(CorrectionOptions(mode), logp, logp.clone(), logp.clone(), advantages, mask)
    assert (out.weight[mask.bool()] == 1.0).all(), out.weight
    assert not out.masked.any() and not out.truncated.any()


@pytest.mark.parametrize("mode", CORRECTION_MODES)
def test_padding_and_nan_never_give_nan_or_inf(mode):
    # padded positions hold NaN and +-inf in every input; a counted token whose mu is NaN (unscored by the sampler)
    old = torch.tensor([[-0.5, -1.0, math.inf], [-2.0, -0.1, math.nan]], dtype=F64)
    mu = torch.tensor([[-0.6, math.nan, -math.inf], [-2.1, -0.2, math.inf]], dtype=F64)
    pi = torch.tensor([[-0.55, -1.1, math.nan], [-1.9, -0.15, -math.inf]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = correction_weight(CorrectionOptions(mode), old, mu, pi, torch.tensor([1.0, -1.0], dtype=F64), mask)
    assert torch.isfinite(out.weight).all(), out.weight
    assert not (out.masked & ~mask.bool()).any() and not (out.truncated & ~mask.bool()).any()


def test_unscored_sampler_token_gets_rho_one():
    # TRL's rule: a NaN log mu makes that token's log-ratio 0 (rho 1), in the token and the sequence modes
    old = torch.tensor([[math.log(0.4), math.log(0.9)]], dtype=F64)
    mu = torch.tensor([[math.log(0.2), math.nan]], dtype=F64)
    mask = torch.ones(1, 2)
    args = (old, mu, old, torch.tensor([1.0], dtype=F64), mask)
    assert_close = lambda t, v: torch.testing.assert_close(t, torch.tensor([v], dtype=F64))  # noqa: E731
    assert_close(correction_weight(CorrectionOptions("token_truncate"), *args).weight, [2.0, 1.0])
    assert_close(correction_weight(CorrectionOptions("sequence_mask"), *args).weight, [2.0, 2.0])


def test_sequence_weight_is_not_a_view():
    out = weight("sequence_truncate")
    assert out.weight.is_contiguous()
    before = out.weight[0, 1].item()
    out.weight[0, 0] = 7.0
    assert out.weight[0, 1].item() == before


@pytest.mark.parametrize("kwargs, words", [
    (dict(mode="tis"), ["'tis'", "token_truncate", "dppo_kl"]),
    (dict(old_policy="recompute"), ["'recompute'", "proximal", "decoupled"]),
    (dict(mode="token_mask", low=-0.1), ["low", "-0.1"]),
    (dict(mode="token_mask", high=math.nan), ["high", "nan"]),
    (dict(mode="icepop", low=2.0, high=1.0), ["2.0", "1.0", "low <= high"]),
    (dict(mode="token_truncate", low=4.0), ["4.0", "3.0"]),  # above the default high
    (dict(mode="none", high=3.0), ["'none'", "3.0"]),
    (dict(mode="off_policy_mask", low=0.1), ["0.1", "off_policy_mask"]),
])
def test_options_refuse_bad_values_in_one_line(kwargs, words):
    with pytest.raises(ValueError) as info:
        CorrectionOptions(**kwargs)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


def test_dppo_thresholds_are_independent():
    # DPPO's delta_low above delta_high is legitimate: two thresholds, not a band
    assert CorrectionOptions("dppo_tv", low=0.3, high=0.1).bounds() == (0.3, 0.1)
    assert CorrectionOptions("sequence_mask", low=0.5).bounds() == (0.5, 3.0)
    assert CorrectionOptions("off_policy_mask").bounds() == (None, 0.5)
    assert CorrectionOptions("geometric_mask").bounds() == (0.99, 1.01)


def test_mismatch_stats_by_hand():
    trainer = torch.tensor([[math.log(0.4), math.log(0.9), 5.0], [math.log(0.5), 0.0, 0.0]], dtype=torch.float32)
    sampler = torch.tensor([[math.log(0.1), math.log(0.6), -math.inf], [math.log(0.5), 0.0, math.nan]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = mismatch_stats(trainer, sampler, mask)
    # |log rho| = log 4, log 1.5, 0; k3 = rho - 1 - log rho = 3 - log 4, 0.5 - log 1.5, 0
    expected = {
        "mismatch_tokens": 3.0,
        "mismatch_abs_sum": math.log(4) + math.log(1.5),
        "mismatch_abs_max": math.log(4),
        "mismatch_k3_sum": (3 - math.log(4)) + (0.5 - math.log(1.5)),
    }
    assert set(stats) == set(expected)
    for key, value in expected.items():
        assert stats[key].dtype == torch.float64 and stats[key].dim() == 0
        assert float(stats[key]) == pytest.approx(value, rel=1e-6), key  # float32 log-probs
    # the merge rule by name: the maximum as a maximum, the rest as sums
    assert reduction("mismatch_abs_max", MICRO_BATCHES) == "max"
    assert {reduction(k, MICRO_BATCHES) for k in expected if k != "mismatch_abs_max"} == {"sum"}


def test_mismatch_k3_is_kl_of_sampler_from_trainer():
    # on tokens drawn from mu, the mean of k3 estimates KL(mu || pi): exact expectation over a 3-token vocabulary
    mu = [0.5, 0.3, 0.2]
    pi = [0.4, 0.4, 0.2]
    kl_mu_pi = sum(m * math.log(m / p) for m, p in zip(mu, pi))
    k3 = [(p / m) - 1 - math.log(p / m) for m, p in zip(mu, pi)]
    assert sum(m * k for m, k in zip(mu, k3)) == pytest.approx(kl_mu_pi, rel=1e-12)
    stats = mismatch_stats(logs([pi]), logs([mu]), torch.ones(1, 3))
    assert float(stats["mismatch_k3_sum"]) == pytest.approx(sum(k3), rel=1e-12)


def test_mismatch_stats_empty_mask():
    stats = mismatch_stats(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2))
    assert float(stats["mismatch_abs_sum"]) == 0 and float(stats["mismatch_abs_max"]) == -math.inf
