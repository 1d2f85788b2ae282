"""REC / REP / RED losses (Yao et al. 2025) against hand computations on a tiny batch."""

import math

import pytest
import torch

from lit_grpo.math import group_advantages, grpo_loss, red_drop_advantages, red_weights
from lit_grpo.math.objective import GRPOOptions, LossConfig
from lit_grpo.math.rec import ClipOptions, REDWeightOptions, RingOptions, TauOptions
from lit_grpo.training.losses import BUILTIN_LOSSES, build_loss

# the losses as the trainer gets them: through the registry
LOSSES = {name: entry.fn for name, entry in BUILTIN_LOSSES.items()}

# Two sequences x 4 tokens. alpha puts 0.2 on every sampled token and pi = 0.2 * r, with ratios chosen so that
# each branch of the three masks (defaults: inner band [0.8, 1.2], ring edges 0.4 and 3.0) is hit:
#   seq 0, A = +1.5: r = 0.3 (ring outer keeps), 0.6 (between ring and band), 1.1 (inside), 1.5 (above band)
#   seq 1, A = -0.5: r = 0.5 (below band), 0.9 (inside), 1.5 (between band and ring), 3.5 (ring outer keeps)
RATIOS = [[0.3, 0.6, 1.1, 1.5], [0.5, 0.9, 1.5, 3.5]]
ADV = [1.5, -0.5]
# Last token of seq 1 is padding: weight 0, and it must not count in the stats.
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]
W = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.0]]
# Masks written out from the definitions in peers.md (not computed by the code under test).
M_ONE_SIDE = [[1, 1, 1, 0], [0, 1, 1, 1]]  # A>=0: r<=1.2 ; A<=0: r>=0.8
M_TWO_SIDE = [[0, 0, 1, 0], [0, 1, 0, 0]]  # 0.8<=r<=1.2
M_RING = [[1, 0, 1, 0], [0, 1, 0, 1]]  # two-side, or A>=0: r<=0.4, or A<=0: r>=3.0
ONES = [[1, 1, 1, 1], [1, 1, 1, 1]]


def _batch(requires_grad=True):
    pi = [[0.2 * r for r in row] for row in RATIOS]
    logp = torch.log(torch.tensor(pi, dtype=torch.float64)).requires_grad_(requires_grad)
    alpha = torch.log(torch.full((2, 4), 0.2, dtype=torch.float64))
    return dict(
        logp=logp,
        alpha_logp=alpha,
        advantages=torch.tensor(ADV, dtype=torch.float64),
        weights=torch.tensor(W, dtype=torch.float64),
        mask=torch.tensor(MASK),
    )


def _hand_reinforce(keep, coef, importance_sampling):
    """sum_t w_t * (-M_t * c_s * W_t * log pi_t) in python floats; returns (loss, d loss / d logp)."""
    loss, grad = 0.0, []
    for s in range(2):
        row = []
        for t in range(4):
            r = RATIOS[s][t]
            factor = keep[s][t] * coef[s] * (r if importance_sampling else 1.0)
            loss += W[s][t] * (-factor * math.log(0.2 * r))
            row.append(-factor * W[s][t])
        grad.append(row)
    return loss, grad


def _clip_counts(keep):
    low = sum(1 for s in range(2) for t in range(4) if MASK[s][t] and not keep[s][t] and ADV[s] < 0)
    high = sum(1 for s in range(2) for t in range(4) if MASK[s][t] and not keep[s][t] and ADV[s] > 0)
    return low, high


REC_CASES = [
    ("rec_oneside_nois", ClipOptions(), M_ONE_SIDE, False, (1, 1)),
    ("rec_oneside_is", ClipOptions(), M_ONE_SIDE, True, (1, 1)),
    ("rec_twoside_is", ClipOptions(), M_TWO_SIDE, True, (2, 3)),
    ("rec_ring", RingOptions(), M_RING, False, (2, 2)),
]


@pytest.mark.parametrize("name, config, keep, use_is, clips", REC_CASES, ids=[case[0] for case in REC_CASES])
def test_rec_losses_hand_value_gradient_and_clip_counts(name, config, keep, use_is, clips):
    b = _batch()
    loss, stats = LOSSES[name](**b, config=config)
    expected, grad = _hand_reinforce(keep, ADV, use_is)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    # REINFORCE: d loss / d logp = -A * M * w (times r with importance sampling) on kept tokens, 0 elsewhere
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-12) for row in grad]
    # clip counts written out by hand (padding token of seq 1 excluded) and checked against the helper
    assert (stats["clip_low"].item(), stats["clip_high"].item()) == clips == _clip_counts(keep)
    assert stats["tokens"].item() == 7
    assert stats["ratio_sum"].item() == pytest.approx(0.3 + 0.6 + 1.1 + 1.5 + 0.5 + 0.9 + 1.5)
    assert stats["ratio_min"].item() == pytest.approx(0.3) and stats["ratio_max"].item() == pytest.approx(1.5)
    assert stats["kl_sum"].item() == 0.0


def test_rec_oneside_is_gradient_equals_grpo_clipped_surrogate_gradient():
    # REC-OneSide-IS is PPO's clip as a hard mask: same gradient as eq. 6 with r' = 1 (values differ).
    b1, b2 = _batch(), _batch()
    LOSSES["rec_oneside_is"](**b1, config=ClipOptions())[0].backward()
    grpo_loss(**b2, config=GRPOOptions())[0].backward()
    assert torch.allclose(b1["logp"].grad, b2["logp"].grad, atol=1e-12)


def test_rec_masks_respect_asymmetric_and_ring_edges():
    b = _batch()
    # band [0.8, 1.3], ring edges 0.75 and 1.4: seq 0's r = 0.6 joins the outer ring, r = 1.5 leaves the band;
    # seq 1's r = 1.5 (>= 1.4) joins the outer ring, r = 0.5 stays out.
    cfg = RingOptions(eps_low=0.2, eps_high=0.3, ring_eps_low=0.25, ring_eps_high=0.4)
    loss, stats = LOSSES["rec_ring"](**b, config=cfg)
    keep = [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert loss.item() == pytest.approx(_hand_reinforce(keep, ADV, False)[0], rel=1e-12)
    assert (stats["clip_low"].item(), stats["clip_high"].item()) == (1, 1)


@pytest.mark.parametrize("name", ["rec_oneside_nois", "rec_twoside_is", "opmd", "asymre"])
def test_beta_adds_unmasked_k3_kl_and_needs_ref(name):
    b = _batch(requires_grad=False)
    ref_p = [[0.1, 0.1, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2]]
    ref = torch.log(torch.tensor(ref_p, dtype=torch.float64))
    fn, config = LOSSES[name], build_loss(name, None, 0.0).config
    base, _ = fn(**b, config=config)
    loss, stats = fn(**b, config=config.with_beta(0.1), ref_logp=ref)
    kl_total, kl_sum = 0.0, 0.0
    for s in range(2):
        for t in range(4):
            pi = 0.2 * RATIOS[s][t]
            d = math.log(ref_p[s][t]) - math.log(pi)
            k3 = math.exp(d) - d - 1
            kl_total += W[s][t] * 0.1 * k3  # on every weighted token, REC mask or not
            kl_sum += k3 * MASK[s][t]
    assert loss.item() - base.item() == pytest.approx(kl_total, rel=1e-10)
    assert stats["kl_sum"].item() == pytest.approx(kl_sum, rel=1e-10)
    with pytest.raises(ValueError, match="ref_logp"):
        fn(**b, config=config.with_beta(0.1))


def test_opmd_hand_value_and_gradient():
    b = _batch()
    loss, stats = LOSSES["opmd"](**b, config=TauOptions(tau=0.1))
    expected, grad = 0.0, []
    for s in range(2):
        row = []
        for t in range(4):
            lr = math.log(RATIOS[s][t])  # log pi - log alpha
            expected += W[s][t] * (-ADV[s] * math.log(0.2 * RATIOS[s][t]) + 0.1 * lr * lr)
            row.append(W[s][t] * (-ADV[s] + 2 * 0.1 * lr))
        grad.append(row)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-12) for row in grad]
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0  # no mask


def test_asymre_hand_value_and_gradient():
    b = _batch()
    loss, stats = LOSSES["asymre"](**b, config=TauOptions(tau=0.1))
    expected, grad = _hand_reinforce(ONES, [1.5 + 0.1, -0.5 + 0.1], False)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-12) for row in grad]
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0


def test_tau_zero_reduces_opmd_and_asymre_to_reinforce():
    b = _batch(requires_grad=False)
    cfg = TauOptions(tau=0.0)
    reinforce = _hand_reinforce(ONES, ADV, False)[0]
    assert LOSSES["opmd"](**b, config=cfg)[0].item() == pytest.approx(reinforce, rel=1e-12)
    assert LOSSES["asymre"](**b, config=cfg)[0].item() == pytest.approx(reinforce, rel=1e-12)
    assert LOSSES["red_drop"](**b, config=LossConfig())[0].item() == pytest.approx(reinforce, rel=1e-12)


@pytest.mark.parametrize("temp", [1.0, 0.5])
def test_red_weight_hand_value_and_gradient(temp):
    b = _batch()
    loss, _ = LOSSES["red_weight"](**b, config=REDWeightOptions(temperature=temp))
    coef = [1.5 * math.exp(1.5 / temp), -0.5 * math.exp(-0.5 / temp)]
    expected, grad = _hand_reinforce(ONES, coef, False)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    loss.backward()
    assert b["logp"].grad.tolist() == [pytest.approx(row, abs=1e-12) for row in grad]


def test_red_weights_values():
    adv = torch.tensor([[0.0, 1.0, -2.0]])
    assert red_weights(adv).tolist() == [pytest.approx([1.0, math.e, math.exp(-2.0)])]
    assert red_weights(adv, 2.0).tolist() == [pytest.approx([1.0, math.exp(0.5), math.exp(-1.0)])]
    with pytest.raises(ValueError, match="temperature"):
        red_weights(adv, 0.0)


def test_red_drop_advantages_hand_values():
    eps = 0.01
    rewards = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],  # 1 pos, 3 neg: drop 2 negatives -> kept {1, 0}
            [1.0, 1.0, 0.0, 0.0],  # balanced: nothing dropped
            [1.0, 1.0, 1.0, 0.0],  # more positives: nothing dropped
            [0.5, 0.5, 0.5, 0.5],  # zero variance: all "at the mean", nothing dropped
        ]
    )
    adv, keep = red_drop_advantages(rewards, torch.Generator().manual_seed(0), eps=eps)
    assert keep.sum(dim=1).tolist() == [2, 4, 4, 4]
    assert bool(keep[0, 0])  # the only positive is never dropped
    d = math.sqrt(0.25 + eps)  # kept {1, 0}: mean 0.5, population variance 0.25
    kept0 = [i for i in range(4) if keep[0, i]]
    assert adv[0, kept0].tolist() == pytest.approx([0.5 / d, -0.5 / d])
    assert [adv[0, i].item() for i in range(4) if not keep[0, i]] == [0.0, 0.0]
    assert adv[1].tolist() == pytest.approx([0.5 / d, 0.5 / d, -0.5 / d, -0.5 / d])
    d2 = math.sqrt(0.1875 + eps)  # mean 0.75, variance (3 * 0.0625 + 0.5625) / 4
    assert adv[2].tolist() == pytest.approx([0.25 / d2] * 3 + [-0.75 / d2])
    assert adv[3].tolist() == [0.0] * 4
    # without drops it is exactly eq. 2 (group_advantages)
    assert torch.allclose(adv[1:], group_advantages(rewards[1:], eps=eps), atol=1e-6)


def test_red_drop_recomputes_stats_on_kept_samples_only():
    # mean 0.35: one positive (1.0), three distinct negatives; one negative x is kept at random
    rewards = torch.tensor([[1.0, 0.0, 0.3, 0.1]])
    for seed in range(5):
        adv, keep = red_drop_advantages(rewards, torch.Generator().manual_seed(seed), eps=0.0)
        kept_neg = [i for i in (1, 2, 3) if keep[0, i]]
        assert len(kept_neg) == 1 and bool(keep[0, 0])
        x = rewards[0, kept_neg[0]].item()
        half = (1.0 - x) / 2  # kept pair {1, x}: mean (1 + x) / 2, std (1 - x) / 2
        assert adv[0, 0].item() == pytest.approx(half / half)
        assert adv[0, kept_neg[0]].item() == pytest.approx(-1.0)
        centred, _ = red_drop_advantages(rewards, torch.Generator().manual_seed(seed), scale=False)
        assert centred[0, 0].item() == pytest.approx(half) and centred[0, kept_neg[0]].item() == pytest.approx(-half)


def test_red_drop_is_deterministic_by_seed_and_balanced():
    rewards = (torch.rand(64, 8, generator=torch.Generator().manual_seed(123)) < 0.3).float()
    a1, k1 = red_drop_advantages(rewards, torch.Generator().manual_seed(7))
    a2, k2 = red_drop_advantages(rewards, torch.Generator().manual_seed(7))
    a3, k3 = red_drop_advantages(rewards, torch.Generator().manual_seed(8))
    assert torch.equal(k1, k2) and torch.equal(a1, a2)
    assert not torch.equal(k1, k3)  # another seed drops other samples
    for g in range(64):
        r = rewards[g].tolist()
        mean = sum(r) / 8
        pos = [i for i in range(8) if r[i] >= mean]
        neg = [i for i in range(8) if r[i] < mean]
        assert all(k1[g, i] for i in pos)  # positives are never dropped
        assert sum(int(k1[g, i]) for i in neg) == min(len(neg), len(pos))  # kept negatives balanced
    assert (a1[~k1] == 0).all()


def test_red_drop_loss_with_keep_folded_into_mask():
    # Trainer contract: advantages from red_drop_advantages, keep folded into the mask before the weights.
    b = _batch()
    keep = torch.tensor([True, False])
    mask = b["mask"] * keep.unsqueeze(-1)
    weights = b["weights"] * mask
    loss, stats = LOSSES["red_drop"](**{**b, "mask": mask, "weights": weights}, config=LossConfig())
    expected = sum(W[0][t] * (-1.5 * math.log(0.2 * RATIOS[0][t])) for t in range(4))
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["tokens"].item() == 4


def test_red_drop_advantages_rejects_flat_rewards():
    with pytest.raises(ValueError, match="num_groups, G"):
        red_drop_advantages(torch.tensor([1.0, 0.0]), torch.Generator())


def test_all_masked_batch_gives_zero_loss_and_finite_stats():
    b = _batch()
    zeros = torch.zeros(2, 4)
    for name, fn in LOSSES.items():
        loss, stats = fn(**{**b, "mask": zeros, "weights": zeros}, config=build_loss(name, None, 0.0).config)
        assert loss.item() == 0.0, name
        assert stats["tokens"].item() == 0 and stats["ratio_min"].item() == math.inf, name


def test_registry_names_interface_and_stats_keys():
    assert list(LOSSES) == [
        "grpo", "gspo", "cispo", "rec_oneside_nois", "rec_oneside_is", "rec_twoside_is", "rec_ring", "red_drop",
        "red_weight", "opmd", "asymre", "sapo", "luspo", "vespo", "gmpo", "dppo_tv", "dppo_kl",
    ]
    assert LOSSES["grpo"] is grpo_loss
    b = _batch(requires_grad=False)
    ref = b["alpha_logp"]
    grpo_keys = set(grpo_loss(**b, config=GRPOOptions())[1])
    for name, fn in LOSSES.items():
        cfg = build_loss(name, None, 0.1).config
        # the same keyword call for every loss, as the trainer makes it
        loss, stats = fn(logp=b["logp"], alpha_logp=b["alpha_logp"], advantages=b["advantages"],
                         weights=b["weights"], mask=b["mask"], config=cfg, pik_logp=b["alpha_logp"], ref_logp=ref)
        assert set(stats) == grpo_keys, name
        assert torch.isfinite(loss), name
        assert fn.__name__ == f"{name}_loss" and fn.__doc__, name  # a plain function, documented


def test_each_loss_refuses_another_loss_config():
    with pytest.raises(ValueError, match="rec_ring_loss must be a RingOptions, got GRPOOptions"):
        LOSSES["rec_ring"](**_batch(), config=GRPOOptions())
    with pytest.raises(ValueError, match="opmd_loss must be a TauOptions, got ClipOptions"):
        LOSSES["opmd"](**_batch(), config=ClipOptions())


def test_rec_options_defaults():
    ring = RingOptions()
    assert (ring.eps_low, ring.eps_upper, ring.ring_eps_low, ring.ring_eps_high) == (0.2, 0.2, 0.6, 2.0)
    assert ClipOptions(eps_low=0.3).eps_upper == 0.3 and ClipOptions(eps_low=0.3, eps_high=0.1).eps_upper == 0.1
    assert (TauOptions().tau, REDWeightOptions().temperature, LossConfig().beta) == (0.1, 1.0, 0.0)
    assert LossConfig().with_beta(0.3).beta == 0.3


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ClipOptions(eps_low=0.0), "eps_low"),
        (lambda: ClipOptions(eps_low=1.5), "eps_low"),
        (lambda: ClipOptions(eps_high=-0.1), "eps_high"),
        (lambda: RingOptions(ring_eps_low=0.0), "ring_eps_low"),
        (lambda: RingOptions(ring_eps_high=0.0), "ring_eps_high"),
        (lambda: TauOptions(tau=-0.1), "tau"),
        (lambda: TauOptions(tau=float("nan")), "tau"),
        (lambda: REDWeightOptions(temperature=0.0), "temperature"),
        (lambda: TauOptions().with_beta(-1.0), "beta"),
    ],
)
def test_rec_options_reject_bad_values(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_zero_advantage_tokens_are_counted_on_neither_clip_side():
    b = _batch(requires_grad=False)
    loss, stats = LOSSES["rec_twoside_is"](**{**b, "advantages": torch.zeros(2, dtype=torch.float64)},
                                           config=ClipOptions())
    assert loss.item() == 0.0
    assert stats["clip_low"].item() == 0 and stats["clip_high"].item() == 0
