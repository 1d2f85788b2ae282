"""Each formula against an independent hand computation on small tensors."""

import math

import pytest
import torch

from lit_grpo.math import (
    GRPOOptions,
    clip_bounds,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    k3_kl,
    pass_at_k,
    selective_log_softmax,
    token_entropy,
    token_weights,
    truncate_ratio,
    zero_variance_mask,
)


def test_group_advantages_eq2_population_std_with_eps_inside_sqrt():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 2.0]])
    eps = 0.01
    adv = group_advantages(rewards, eps=eps)
    # group 0: mean 0.5, population variance 0.25 -> denominator sqrt(0.26)
    d0 = math.sqrt(0.25 + eps)
    assert adv[0].tolist() == pytest.approx([0.5 / d0, -0.5 / d0, -0.5 / d0, 0.5 / d0])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: mean 0.5, variance ((0.25*3) + 2.25)/4 = 0.75
    d2 = math.sqrt(0.75 + eps)
    assert adv[2].tolist() == pytest.approx([-0.5 / d2] * 3 + [1.5 / d2])


def test_group_advantages_bessel_is_trls_sample_std_with_eps_outside_sqrt():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 2.0]])
    eps = 0.01
    adv = group_advantages(rewards, eps=eps, std="bessel")
    # group 0: mean 0.5, sum of squares 1.0 over G - 1 = 3 -> denominator sqrt(1/3) + eps
    d0 = math.sqrt(1.0 / 3.0) + eps
    assert adv[0].tolist() == pytest.approx([0.5 / d0, -0.5 / d0, -0.5 / d0, 0.5 / d0])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]
    # group 2: sum of squares 0.25 * 3 + 2.25 = 3.0 over 3 -> std 1
    assert adv[2].tolist() == pytest.approx([-0.5 / (1 + eps)] * 3 + [1.5 / (1 + eps)])
    # centring alone does not depend on the std's definition
    assert torch.equal(group_advantages(rewards, scale=False, std="bessel"), group_advantages(rewards, scale=False))


def test_group_advantages_refuses_an_unknown_std():
    with pytest.raises(ValueError, match="std must be one of population, bessel, got 'sample'"):
        group_advantages(torch.ones(1, 4), std="sample")


def test_the_data_modules_advantage_std_names_are_the_maths():
    """option_checks spells the names out (it imports no torch): they must stay the math's."""
    from lit_grpo.data.option_checks import check_advantage_std
    from lit_grpo.math.advantages import ADVANTAGE_STDS

    for name in ADVANTAGE_STDS:
        check_advantage_std(name)
    with pytest.raises(ValueError, match="advantage_std must be one of population, bessel, got 'trl'"):
        check_advantage_std("trl")


def test_group_advantages_without_std_scaling_is_dr_grpo_centring():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert group_advantages(rewards, scale=False)[0].tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_group_advantages_rejects_flat_rewards():
    with pytest.raises(ValueError, match="num_groups, G"):
        group_advantages(torch.tensor([1.0, 0.0]))


def test_zero_variance_mask_eq8():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.50001]])
    assert zero_variance_mask(rewards).tolist() == [0.0, 1.0, 0.0, 1.0]


@pytest.mark.parametrize("practical", [True, False])
def test_clipped_surrogate_eq6_both_branches(practical):
    eps = 0.2
    ratio = torch.tensor([0.5, 0.9, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    r_prime = 1.0 if practical else torch.full_like(ratio, 1.3)
    got = clipped_surrogate(ratio, r_prime, adv, eps, eps)
    rp = 1.0 if practical else 1.3
    expected = []
    for r, a in zip(ratio.tolist(), adv.tolist()):
        # the case form of eq. 6 written out below it in the paper
        if a >= 0:
            expected.append(a * min(r, rp + eps))
        else:
            expected.append(a * max(r, max(rp - eps, 0.0)))
    assert got.tolist() == pytest.approx(expected)


def test_clipped_surrogate_floor_at_zero_when_r_prime_below_eps():
    # r' = 0.1 < eps = 0.2: the lower clip bound is max(0.1 - 0.2, 0) = 0, not -0.1
    ratio = torch.tensor([0.05, 0.05])
    adv = torch.tensor([-2.0, 2.0])
    got = clipped_surrogate(ratio, torch.tensor([0.1, 0.1]), adv, 0.2, 0.2)
    # A < 0: A * max(r, 0) = -2 * 0.05 ; A > 0: A * min(r, 0.3) = 2 * 0.05
    assert got.tolist() == pytest.approx([-0.1, 0.1])
    # For r >= 0 the floor cannot show in f_eps's value (A * max(r, low) = A * r whenever low <= 0), so it is
    # checked on the interval itself, on both code paths (tensor r' and the float r' = 1 of the practical choice).
    low, high = clip_bounds(torch.tensor([0.1, 0.5]), 0.2, 0.2)
    assert low[0].item() == 0.0  # floored: r' - eps = -0.1
    assert low[1].item() == pytest.approx(0.3)  # r' >= eps: no floor
    assert high.tolist() == pytest.approx([0.3, 0.7])
    assert clip_bounds(0.1, 0.2, 0.3) == (0.0, pytest.approx(0.4))
    assert clip_bounds(1.0, 0.2, 0.3) == (pytest.approx(0.8), pytest.approx(1.3))


def test_clipped_surrogate_asymmetric_eps():
    ratio = torch.tensor([1.25, 1.25, 0.75, 0.75])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    got = clipped_surrogate(ratio, 1.0, adv, eps_low=0.1, eps_high=0.3)
    # r=1.25 < 1.3: unclipped; r=0.75 < 0.9: A*max(r, 0.9) = -0.9
    assert got.tolist() == pytest.approx([1.25, 1.25, -0.9, -0.9])


def test_clipped_surrogate_gradient_is_zero_where_clipped():
    ratio = torch.tensor([1.5, 0.5, 1.05], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0])
    clipped_surrogate(ratio, 1.0, adv, 0.2, 0.2).sum().backward()
    assert ratio.grad.tolist() == [0.0, 0.0, 1.0]


def test_truncate_ratio():
    r = torch.tensor([0.5, 2.0, 5.0])
    assert truncate_ratio(r, 3.0).tolist() == [0.5, 2.0, 3.0]
    assert truncate_ratio(r, None) is r


def test_k3_kl_matches_formula_and_true_kl_in_expectation():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    got = k3_kl(logp, ref)
    expected = [0.5 - math.log(0.5) - 1, 2.0 - math.log(2.0) - 1]
    assert got.tolist() == pytest.approx(expected)
    assert k3_kl(logp, logp).tolist() == [0.0, 0.0]
    # unbiased: E_{y~pi}[k3] = KL(pi || ref) for full distributions
    pi = torch.tensor([0.7, 0.2, 0.1])
    q = torch.tensor([0.4, 0.4, 0.2])
    estimate = (pi * k3_kl(pi.log(), q.log())).sum()
    assert estimate.item() == pytest.approx((pi * (pi / q).log()).sum().item(), rel=1e-5)


def test_selective_log_softmax_and_entropy_use_temperature():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    tokens = torch.tensor([[1]])
    t = 0.5
    scaled = [4.0, 0.0, -2.0]
    z = math.log(sum(math.exp(s) for s in scaled))
    assert selective_log_softmax(logits, tokens, t).item() == pytest.approx(0.0 - z)
    p = [math.exp(s - z) for s in scaled]
    assert token_entropy(logits, t).item() == pytest.approx(-sum(q * math.log(q) for q in p), rel=1e-5)


def test_token_weights_each_mode():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    per_token = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
    # token mean: (1 + 2 + 3 + 4) / 4 tokens
    assert (token_weights(mask, "token_mean") * per_token).sum().item() == pytest.approx(2.5)
    # seq mean of token means over sequences with tokens: (2 + 4) / 2
    assert (token_weights(mask, "seq_mean_token_mean") * per_token).sum().item() == pytest.approx(3.0)
    # constant: sum / (3 sequences * 5 max tokens)
    assert (token_weights(mask, "constant", 5) * per_token).sum().item() == pytest.approx(10 / 15)
    with pytest.raises(ValueError, match="unknown loss aggregation 'mean'"):
        token_weights(mask, "mean")


def test_token_weights_all_masked_is_zero_not_nan():
    mask = torch.zeros(2, 3)
    for mode in ("token_mean", "seq_mean_token_mean", "constant"):
        w = token_weights(mask, mode, 3)
        assert torch.isfinite(w).all() and w.sum().item() == 0.0


def test_token_weights_sum_over_micro_batches_equals_full_batch():
    torch.manual_seed(0)
    mask = (torch.rand(6, 5) > 0.3).float()
    loss = torch.randn(6, 5)
    for mode in ("token_mean", "seq_mean_token_mean", "constant"):
        w = token_weights(mask, mode, 5)
        full = (w * loss).sum()
        parts = sum((w[i : i + 2] * loss[i : i + 2]).sum() for i in range(0, 6, 2))
        assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_grpo_loss_combines_surrogate_kl_and_weights():
    logp = torch.log(torch.tensor([[0.5, 0.3]])).requires_grad_(True)
    alpha = torch.log(torch.tensor([[0.4, 0.3]]))
    ref = torch.log(torch.tensor([[0.5, 0.6]]))
    adv = torch.tensor([2.0])
    weights = torch.tensor([[0.5, 0.5]])
    cfg = GRPOOptions(eps_low=0.2, eps_high=0.2).with_beta(0.1)
    loss, stats = grpo_loss(logp, alpha, adv, weights, torch.ones(1, 2), cfg, ref_logp=ref)
    r = [0.5 / 0.4, 1.0]
    surrogate = [2.0 * min(r[0], 1.2), 2.0 * min(r[1], 1.2)]
    kl = [0.5 / 0.5 - math.log(1.0) - 1, 0.6 / 0.3 - math.log(2.0) - 1]
    expected = sum(0.5 * (-s + 0.1 * k) for s, k in zip(surrogate, kl))
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["clip_high"].item() == 1.0 and stats["clip_low"].item() == 0.0
    assert stats["ratio_max"].item() == pytest.approx(1.25)
    assert stats["kl_sum"].item() == pytest.approx(sum(kl), rel=1e-6)


def test_grpo_loss_exact_ref_ratio_uses_pik():
    logp = torch.log(torch.tensor([[0.6]]))
    alpha = torch.log(torch.tensor([[0.3]]))
    pik = torch.log(torch.tensor([[0.45]]))  # r' = 1.5
    cfg = GRPOOptions(eps_low=0.2, eps_high=0.2, exact_ref_ratio=True)
    loss, stats = grpo_loss(logp, alpha, torch.tensor([1.0]), torch.ones(1, 1), torch.ones(1, 1), cfg, pik_logp=pik)
    # r = 2.0 > r' + eps = 1.7: clipped to 1.7
    assert loss.item() == pytest.approx(-1.7)
    assert stats["clip_high"].item() == 1.0
    with pytest.raises(ValueError, match="pik_logp"):
        grpo_loss(logp, alpha, torch.tensor([1.0]), torch.ones(1, 1), torch.ones(1, 1), cfg)


def test_grpo_loss_ratio_cap():
    logp = torch.log(torch.tensor([[0.9]]))
    alpha = torch.log(torch.tensor([[0.1]]))  # r = 9
    cfg = GRPOOptions(eps_low=0.2, eps_high=0.2, ratio_cap=2.0)
    loss, _ = grpo_loss(logp, alpha, torch.tensor([-1.0]), torch.ones(1, 1), torch.ones(1, 1), cfg)
    # A < 0: -max(min(r, 2), 0.8) = -2 -> loss = +2 (without the cap it would be +9)
    assert loss.item() == pytest.approx(2.0)


@pytest.mark.parametrize("make, match", [(lambda: GRPOOptions(eps_low=0.0), "eps_low"),
                                         (lambda: GRPOOptions(eps_high=-0.1), "eps_high"),
                                         (lambda: GRPOOptions().with_beta(-1.0), "beta"),
                                         (lambda: GRPOOptions().with_beta(float("nan")), "beta"),
                                         (lambda: GRPOOptions(ratio_cap=0.0), "ratio_cap")])
def test_loss_config_rejects_bad_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_grpo_options_eps_high_defaults_to_eps_low():
    assert GRPOOptions(eps_low=0.1).eps_upper == 0.1 and GRPOOptions(eps_low=0.1, eps_high=0.28).eps_upper == 0.28


def test_pass_at_k_unbiased_estimator():
    n, c = 10, 3
    for k in (1, 2, 5, 8):
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, torch.tensor([c]), k).item() == pytest.approx(expected)
    assert pass_at_k(50, torch.tensor([0, 50, 7]), 1).tolist() == pytest.approx([0.0, 1.0, 0.14])
    with pytest.raises(ValueError, match="pass@5"):
        pass_at_k(4, torch.tensor([1]), 5)
