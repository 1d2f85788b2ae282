"""Theorem-1 monitors (TV estimate, group reward std) against hand computations."""

import math

import pytest
import torch

from lit_grpo.math import group_reward_std, tv_estimate, tv_from_sum_count


def test_tv_is_zero_when_log_probs_agree():
    logp = torch.log(torch.tensor([[0.3, 0.5, 0.9]]))
    est = tv_estimate(logp, logp.clone(), torch.ones(1, 3))
    assert est.value.item() == 0.0 and est.sum.item() == 0.0 and est.count.item() == 3


def test_tv_hand_value_and_masked_tokens_ignored():
    a = torch.log(torch.tensor([[0.3, 0.1, 0.9], [0.25, 0.2, 0.2]]))
    b = torch.log(torch.tensor([[0.2, 0.2, 0.01], [0.5, 0.2, 0.2]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])  # the ratio-90 token is padding
    est = tv_estimate(a, b, mask)
    # ratios 1.5, 0.5, 0.5, 1, 1 on the counted tokens
    halves = [0.5 * abs(1.5 - 1), 0.5 * abs(0.5 - 1), 0.5 * abs(0.5 - 1), 0.0, 0.0]
    assert est.count.item() == 5
    assert est.sum.item() == pytest.approx(sum(halves), rel=1e-6)
    assert est.value.item() == pytest.approx(sum(halves) / 5, rel=1e-6)


def test_tv_sums_merge_across_micro_batches():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 5, generator=g) - 2, torch.randn(6, 5, generator=g) - 2
    mask = torch.rand(6, 5, generator=g) > 0.3
    full = tv_estimate(a, b, mask)
    parts = [tv_estimate(a[i : i + 2], b[i : i + 2], mask[i : i + 2]) for i in range(0, 6, 2)]
    merged = tv_from_sum_count(sum(p.sum for p in parts), sum(p.count for p in parts))
    assert merged.item() == pytest.approx(full.value.item(), rel=1e-12)


def test_tv_of_full_distributions_is_exact_in_expectation():
    # E_{y ~ b}[0.5 |a(y)/b(y) - 1|] = 0.5 sum |a - b|: weight each "sampled" token by b(y)
    pa, pb = [0.7, 0.2, 0.1], [0.4, 0.4, 0.2]
    expected = 0.5 * sum(abs(x - y) for x, y in zip(pa, pb))
    halves = [0.5 * abs(x / y - 1) for x, y in zip(pa, pb)]
    assert sum(y * h for y, h in zip(pb, halves)) == pytest.approx(expected)
    est = tv_estimate(torch.tensor(pa).log().unsqueeze(0), torch.tensor(pb).log().unsqueeze(0), torch.ones(1, 3))
    assert est.sum.item() == pytest.approx(sum(halves), rel=1e-6)


def test_tv_empty_mask_is_zero_not_nan_and_shapes_checked():
    est = tv_estimate(torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3))
    assert est.value.item() == 0.0 and est.count.item() == 0
    with pytest.raises(ValueError, match="same shape"):
        tv_estimate(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))


def test_tv_keeps_no_gradient():
    a = torch.zeros(1, 2, requires_grad=True)
    assert not tv_estimate(a, torch.ones(1, 2), torch.ones(1, 2)).value.requires_grad


def test_group_reward_std_population_mean_over_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 2.0]])
    # population stds 0.5, 0, sqrt(0.75)
    assert group_reward_std(rewards).item() == pytest.approx((0.5 + 0.0 + math.sqrt(0.75)) / 3)
    with pytest.raises(ValueError, match="num_groups, G"):
        group_reward_std(torch.tensor([1.0, 0.0]))
