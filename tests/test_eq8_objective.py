"""Eq. 8 as the paper writes it, ``E_x[ 1{sigma(x) != 0} (L(x) - beta KL(x)) ]``, against values worked out by hand.

One rollout batch of three groups of two completions: groups 0 and 2 have a reward spread, group 1 is flat
(both answers right). pi differs from alpha (some ratios are clipped) and from pi_ref, and beta > 0, so the flat
group has a KL term that eq. 7 counts and eq. 8 drops. The expected losses and gradients are computed below in
plain Python floats from the formulas of eqs. 2, 6, 7 and 8, not with the library's functions.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_module

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.math import grpo_loss
from lit_grpo.math.aggregation import (
    AGGREGATION_MODES,
    token_weights,
    zero_variance_dropped_weights,
    zero_variance_masked_weights,
)

BETA, EPS, ADV_EPS, MAX_LEN = 0.1, 0.2, 1e-4, 4
REWARDS = [[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]]  # group 1 is flat
LENGTHS = [3, 1, 2, 3, 2, 2]  # completion tokens of each of the 6 rows
# log pi, and the offsets log pi - log alpha and log pi_ref - log pi, per row and token (padding: unused)
LOGP = [[-0.5, -1.2, -0.3], [-0.9, 0.0, 0.0], [-1.1, -0.4, 0.0],
        [-0.7, -0.2, -1.5], [-0.6, -0.8, 0.0], [-1.3, -0.25, 0.0]]
RATIO_OFFSET = [[0.1, 0.3, -0.1], [-0.3, 0.0, 0.0], [0.05, -0.2, 0.0],
                [0.15, 0.0, -0.05], [-0.25, 0.3, 0.0], [0.1, -0.3, 0.0]]
REF_OFFSET = [[0.2, -0.3, 0.1], [0.4, 0.0, 0.0], [-0.5, 0.3, 0.0],
              [0.25, -0.15, 0.6], [-0.2, 0.1, 0.0], [0.35, -0.4, 0.0]]


def hand_advantage(row: int) -> float:
    """Eq. 2 with the population std and eps under the root, for the group of ``row``."""
    group = REWARDS[row // 2]
    mean = sum(group) / len(group)
    std2 = sum((r - mean) ** 2 for r in group) / len(group)
    return (group[row % 2] - mean) / math.sqrt(std2 + ADV_EPS)


def hand_token_loss_and_grad(row: int, t: int) -> tuple[float, float]:
    """Loss to minimise at one token, ``-f_eps(r, 1, A) + beta * k3``, and its derivative w.r.t. log pi."""
    a = hand_advantage(row)
    r = math.exp(RATIO_OFFSET[row][t])
    clipped = min(max(r, 1 - EPS), 1 + EPS)
    surrogate = min(r * a, clipped * a)
    # the unclipped branch carries the gradient r * A; the clipped one is constant in log pi
    d_surrogate = r * a if r * a <= clipped * a else 0.0
    d = REF_OFFSET[row][t]  # log pi_ref - log pi
    kl = math.exp(d) - d - 1
    d_kl = 1 - math.exp(d)  # d/dlogp of exp(d) - d - 1 with d = ref - logp
    return -surrogate + BETA * kl, -d_surrogate + BETA * d_kl


def spread(row: int) -> bool:
    return len(set(REWARDS[row // 2])) > 1


def hand_weights(mode: str, objective: str) -> list[float]:
    """Weight of every token of each row under ``objective``: ``eq7`` (every group counts), ``eq8`` (flat groups
    weigh 0 but stay in the denominators) or ``drop`` (the DAPO-style renormalised form)."""
    rows = [s for s in range(6) if spread(s) or objective != "drop"]  # the rows that count in the denominators
    weights = []
    for s in range(6):
        if not spread(s) and objective != "eq7":
            weights.append(0.0)
        elif mode == "token_mean":
            weights.append(1 / sum(LENGTHS[q] for q in rows))
        elif mode == "seq_mean_token_mean":
            weights.append(1 / LENGTHS[s] / len(rows))
        elif mode == "seq_mean_token_sum":
            weights.append(1 / len(rows))
        else:  # constant: every sequence counts, masked or not
            weights.append(1 / (6 * MAX_LEN))
    return weights


def hand_loss_and_grad(mode: str, objective: str) -> tuple[float, list[list[float]]]:
    weights = hand_weights(mode, objective)
    loss, grad = 0.0, [[0.0] * 3 for _ in range(6)]
    for s in range(6):
        for t in range(LENGTHS[s]):
            value, slope = hand_token_loss_and_grad(s, t)
            loss += weights[s] * value
            grad[s][t] = weights[s] * slope
    return loss, grad


def batch_and_logps() -> tuple[RolloutBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = torch.tensor([[1 if t < n else 0 for t in range(3)] for n in LENGTHS])
    rewards = torch.tensor(REWARDS).flatten()
    batch = RolloutBatch(
        prompt_ids=torch.ones(3, 2, dtype=torch.long), prompt_mask=torch.ones(3, 2, dtype=torch.long),
        group_index=torch.arange(3).repeat_interleave(2), completion_ids=mask.clone(), completion_mask=mask,
        rewards=rewards, advantages=torch.tensor([hand_advantage(s) for s in range(6)]),
        group_mask=torch.tensor([1.0 if spread(s) else 0.0 for s in range(6)]),
        truncated=torch.zeros(6, dtype=torch.bool), group_size=2, micro_batch_size=6,
    )
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    alpha_logp = torch.tensor(LOGP, dtype=torch.float64) - torch.tensor(RATIO_OFFSET, dtype=torch.float64)
    ref_logp = torch.tensor(LOGP, dtype=torch.float64) + torch.tensor(REF_OFFSET, dtype=torch.float64)
    return batch, logp, alpha_logp, ref_logp


def module_loss_and_grad(mode: str, **zero_variance: bool) -> tuple[float, torch.Tensor]:
    """The batch's loss through ``GRPOModule.loss_weights`` and the library's eq. 7 loss, in float64."""
    module = tiny_module(beta=BETA, loss_aggregation=mode, max_completion_length=MAX_LEN, **zero_variance)
    # the hand values clip at 1 -/+ EPS: the default clip half-widths of eq. 6
    assert (module.loss_config.eps_low, module.loss_config.eps_upper) == (EPS, EPS)
    batch, logp, alpha_logp, ref_logp = batch_and_logps()
    weights = module.loss_weights(batch).to(torch.float64)
    loss, _ = grpo_loss(logp, alpha_logp, batch.advantages.to(torch.float64), weights, batch.completion_mask,
                        module.loss_config, ref_logp=ref_logp)
    loss.backward()
    return float(loss.detach()), logp.grad


def test_hand_values_are_not_degenerate():
    """The case exercises what eq. 8 is about: the flat group has A = 0 but a KL term, and clipping fires."""
    assert all(hand_advantage(s) == 0.0 for s in (2, 3))
    flat_kl = sum(hand_token_loss_and_grad(s, t)[0] for s in (2, 3) for t in range(LENGTHS[s]))
    assert flat_kl > 0.01
    clipped = [(s, t) for s in range(6) for t in range(LENGTHS[s]) if spread(s)
               and hand_token_loss_and_grad(s, t)[1] == BETA * (1 - math.exp(REF_OFFSET[s][t]))]
    assert clipped  # some tokens lose their surrogate gradient to the clip


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_mask_zero_variance_is_eq8_as_written(mode):
    """Flat groups contribute exactly zero, KL included, and keep their place in every denominator.

    On the renormalising form this fails for ``token_mean`` (13 tokens in the denominator, not 8) and for
    ``seq_mean_token_mean`` (6 sequences, not 4); under ``constant`` the two forms agree."""
    expected_loss, expected_grad = hand_loss_and_grad(mode, "eq8")
    loss, grad = module_loss_and_grad(mode, mask_zero_variance=True)
    assert loss == pytest.approx(expected_loss, rel=1e-6, abs=1e-9)
    assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    assert torch.all(grad[2:4] == 0.0)  # the flat group: no surrogate (A = 0) and no KL gradient


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_eq8_is_eq7_with_the_flat_groups_terms_removed(mode):
    """Eq. 7 by hand (the flat group's KL counts), and eq. 8 against it on the same batch: the spread groups'
    terms are unchanged, the flat group's vanish."""
    expected_loss, expected_grad = hand_loss_and_grad(mode, "eq7")
    eq7_loss, eq7_grad = module_loss_and_grad(mode)
    assert eq7_loss == pytest.approx(expected_loss, rel=1e-6, abs=1e-9)
    assert torch.allclose(eq7_grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    eq8_loss, eq8_grad = module_loss_and_grad(mode, mask_zero_variance=True)
    weights = hand_weights(mode, "eq7")
    flat_terms = sum(weights[s] * hand_token_loss_and_grad(s, t)[0] for s in (2, 3) for t in range(LENGTHS[s]))
    assert flat_terms > 1e-4
    assert eq7_loss - eq8_loss == pytest.approx(flat_terms, rel=1e-6)
    assert torch.equal(eq7_grad[[0, 1, 4, 5]], eq8_grad[[0, 1, 4, 5]])


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_drop_zero_variance_is_the_renormalised_dapo_form(mode):
    expected_loss, expected_grad = hand_loss_and_grad(mode, "drop")
    loss, grad = module_loss_and_grad(mode, drop_zero_variance=True)
    assert loss == pytest.approx(expected_loss, rel=1e-6, abs=1e-9)
    assert torch.allclose(grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    eq8_loss, _ = module_loss_and_grad(mode, mask_zero_variance=True)
    # every kept token weighs 13/8 (token_mean) or 6/4 (seq_mean_token_mean) times its eq. 8 weight
    factor = {"token_mean": 13 / 8, "seq_mean_token_mean": 6 / 4, "constant": 1.0, "seq_mean_token_sum": 6 / 4}[mode]
    assert loss == pytest.approx(factor * eq8_loss, rel=1e-6)


def test_mask_and_drop_together_is_refused():
    with pytest.raises(ValueError, match="mask_zero_variance .* drop_zero_variance .* both true"):
        tiny_module(mask_zero_variance=True, drop_zero_variance=True)


def test_group_mask_of_the_wrong_shape_is_refused():
    mask = torch.ones(4, 3)
    for bad in (torch.ones(3), torch.ones(4, 1)):
        with pytest.raises(ValueError, match=r"group_mask must have shape \[4\]"):
            zero_variance_masked_weights(mask, bad, "token_mean")
        with pytest.raises(ValueError, match=r"group_mask must have shape \[4\]"):
            zero_variance_dropped_weights(mask, bad, "token_mean")


def simulated_all_reduce(shares: list[torch.Tensor], weigh) -> list[torch.Tensor]:
    """Run ``weigh(share, global_sum)`` on each rank's share as real ranks would: a first pass records what every
    rank hands to the all-reduce, the second answers each call with the sum of those over ranks."""
    handed: list[list[torch.Tensor]] = [[] for _ in shares]
    for rank, share in enumerate(shares):
        weigh(share, lambda local, rank=rank: handed[rank].append(local.clone()) or local)
    answers = []
    for rank, share in enumerate(shares):
        calls = iter(range(len(handed[rank])))

        def global_sum(local: torch.Tensor, calls=calls) -> torch.Tensor:
            call = next(calls)  # the n-th all-reduce of this rank meets the n-th of every other rank
            return sum(h[call] for h in handed)

        answers.append(weigh(share, global_sum))
    return answers


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_eq8_weights_over_two_ranks_equal_one_process(mode):
    """Rank 1 holds only the flat group: its tokens must still count in the global denominators."""
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]).float()
    group_mask = torch.tensor([1.0, 1.0, 0.0, 0.0])
    full = zero_variance_masked_weights(mask, group_mask, mode, MAX_LEN)
    shares = [(mask[:2], group_mask[:2]), (mask[2:], group_mask[2:])]
    per_rank = simulated_all_reduce(
        shares, lambda share, total: zero_variance_masked_weights(share[0], share[1], mode, MAX_LEN, total))
    assert torch.equal(torch.cat(per_rank), full)
    # by hand: 9 tokens, 4 sequences, 4 x MAX_LEN; rank 1's rows weigh 0
    expected = {"token_mean": [1 / 9, 1 / 9], "seq_mean_token_mean": [1 / 3 / 4, 1 / 4],
                "constant": [1 / 16, 1 / 16], "seq_mean_token_sum": [1 / 4, 1 / 4]}[mode]
    assert per_rank[0][0, 0].item() == pytest.approx(expected[0])
    assert per_rank[0][1, 0].item() == pytest.approx(expected[1])
    assert torch.all(per_rank[1] == 0)
    # eq. 8 without the flat rows in the count would be the renormalised weights: different unless constant
    dropped = zero_variance_dropped_weights(mask, group_mask, mode, MAX_LEN)
    assert torch.equal(dropped, full) == (mode == "constant")
    # and eq. 7's weights on the spread rows are eq. 8's
    assert torch.equal(token_weights(mask, mode, MAX_LEN)[:2], full[:2])
