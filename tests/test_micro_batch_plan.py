"""Token-budget micro-batches (``data.micro_batch_tokens``): the plan is the best contiguous cut of the length-sorted
rows (checked by brute force), the views cover every row once with its own data, padding falls on uneven
lengths, and the update is the one of today's row slicing."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from dist_worker import run_job
from test_multiprocess import equality_job

from lit_grpo.core.batch import micro_batch_views, padding_tokens
from lit_grpo.core.micro_batch_plan import (
    LAYOUTS,
    micro_batch_cost,
    packed_tokens,
    padded_tokens,
    plan_by_tokens,
    plan_order,
    split_into,
    tree_tokens,
)
from lit_grpo.core.packing import packed_token_count


def random_rows(seed: int, rows: int) -> tuple[list[int], list[int], list[int]]:
    rng = random.Random(seed)
    groups = sorted(rng.randrange(3) for _ in range(rows))
    prompt_of_group = {g: rng.randint(1, 9) for g in set(groups)}
    return [rng.randint(1, 30) for _ in range(rows)], [prompt_of_group[g] for g in groups], groups


def cost(rows: list[int], c: list[int], p: list[int], g: list[int], layout: str = "padded") -> int:
    return micro_batch_cost([c[r] for r in rows], [p[r] for r in rows], [g[r] for r in rows], layout)


def contiguous_cuts(order: list[int]):
    """Every cut of ``order`` into contiguous non-empty runs."""
    for mask in itertools.product((False, True), repeat=len(order) - 1):
        runs, current = [], [order[0]]
        for row, cut in zip(order[1:], mask):
            if cut:
                runs.append(current)
                current = []
            current.append(row)
        yield runs + [current]


def test_padded_tokens_counts_rows_times_longest_plus_prompts_times_longest_prompt():
    # rows 5, 2, 3 of prompts a (4 tokens), a, b (7 tokens): 3 rows x 5 + 2 prompts x 7
    assert padded_tokens([5, 2, 3], [4, 4, 7], [0, 0, 1]) == 3 * 5 + 2 * 7
    assert padded_tokens([], [], []) == 0


def test_packed_tokens_counts_each_row_with_its_own_prompt_and_no_padding():
    # rows 5, 2, 3 of prompts of 4, 4 and 7 tokens: each fed as prompt + completion but its last token
    assert packed_tokens([5, 2, 3], [4, 4, 7]) == (4 + 5 - 1) + (4 + 2 - 1) + (7 + 3 - 1)
    assert packed_tokens([0, 3], [4, 4]) == 4 + 3 - 1  # an empty completion is not fed at all
    assert packed_tokens([], []) == 0


def least_cost_by_brute_force(c: list[int], p: list[int], g: list[int], budget: int, layout: str
                              ) -> tuple[int, int]:
    """The least (total cost, micro-batches) over every contiguous cut of the sorted rows in which each run is
    within the budget or a single row."""
    return min((sum(cost(run, c, p, g, layout) for run in cuts), len(cuts))
               for cuts in contiguous_cuts(plan_order(c, g, layout))
               if all(cost(run, c, p, g, layout) <= budget or len(run) == 1 for run in cuts))


def check_plan(plan: list[list[int]], c: list[int], p: list[int], g: list[int], budget: int, layout: str) -> None:
    rows = len(c)
    assert sorted(r for run in plan for r in run) == list(range(rows))
    assert all(run == sorted(run) for run in plan)
    assert all(cost(run, c, p, g, layout) <= budget or len(run) == 1 for run in plan)
    # rows of one micro-batch are neighbours in the plan's order (by length; a tree's, group by group)
    position = {row: i for i, row in enumerate(plan_order(c, g, layout))}
    for run in plan:
        places = sorted(position[r] for r in run)
        assert places == list(range(places[0], places[0] + len(run)))
    got = (sum(cost(run, c, p, g, layout) for run in plan), len(plan))
    assert got == least_cost_by_brute_force(c, p, g, budget, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed", range(40))
def test_plan_is_the_least_cost_contiguous_cut_then_the_fewest(seed, layout):
    """Against every contiguous cut of the sorted order (2^(n-1) of them): the least total cost, then the fewest
    micro-batches; budgets from one that leaves most rows alone over it (20) to one that never binds (10^6)."""
    rng = random.Random(seed)
    c, p, g = random_rows(seed, rng.randint(1, 9))
    budget = rng.choice([20, rng.randint(30, 120), rng.randint(120, 400), 10**6])
    check_plan(plan_by_tokens(c, p, g, budget, layout=layout), c, p, g, budget, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_row_alone_over_the_budget_and_the_rest_by_least_cost(layout):
    # the 60-token row cannot share (or fit); the others then split by cost, not by the fewest passes
    c, p, g = [60, 30, 29, 4, 3, 3], [5, 5, 5, 9, 9, 9], [0, 0, 0, 1, 1, 1]
    check_plan(plan_by_tokens(c, p, g, 70, layout=layout), c, p, g, 70, layout)


def test_least_cost_cut_by_hand():
    """One group, prompt of 10 tokens, completions 40, 38, 5, 4 under a budget of 1,000 (it never binds): one pass
    computes 4 x 40 + 10 = 170 tokens; [40, 38] and [5, 4] compute (2 x 40 + 10) + (2 x 5 + 10) = 110, the least of
    the 8 cuts (each apart: 40 + 38 + 5 + 4 + 4 x 10 = 127; [40], [38], [5, 4]: 50 + 48 + 20 = 118). The greedy
    cut, the fewest passes, was the single 170-token one."""
    c, p, g = [5, 40, 4, 38], [10] * 4, [0] * 4
    assert plan_by_tokens(c, p, g, 1000) == [[1, 3], [0, 2]]
    assert sum(padded_tokens([c[r] for r in run], [10] * len(run), [0] * len(run))
               for run in plan_by_tokens(c, p, g, 1000)) == 110
    # a budget of 89 tokens rules the [40, 38] pair out (90): then [40], [38], [5, 4], 118 tokens
    assert plan_by_tokens(c, p, g, 89) == [[1], [3], [0, 2]]


def test_equal_costs_take_the_fewest_micro_batches_then_the_longest_first_run():
    # completions of 5 tokens, each with a 1-token prompt of its own: together 3 x 5 + 3 x 1 = 18 tokens, apart
    # 3 x (5 + 1) = 18, two and one 12 + 6 = 18: a tie on cost, so the fewest runs, one
    assert plan_by_tokens([5, 5, 5], [1, 1, 1], [0, 1, 2], 100) == [[0, 1, 2]]
    # packed, every cut feeds the same tokens: the fewest runs, each first run as long as the budget lets it be
    # (the greedy cut): 4 rows of 2 + 3 - 1 = 4 tokens under a budget of 12: [3 rows], [1 row], not [2], [2]
    assert plan_by_tokens([3] * 4, [2] * 4, [0] * 4, 12, layout="packed") == [[0, 1, 2], [3]]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plan_is_the_same_for_the_same_lengths(layout):
    """Every process plans its batch itself: the same lengths give the same plan, call after call, and a ranks'
    copy of the lengths (a list or a tuple) changes nothing."""
    c, p, g = random_rows(11, 40)
    first = plan_by_tokens(c, p, g, 300, layout=layout)
    assert all(plan_by_tokens(c, p, g, 300, layout=layout) == first for _ in range(3))
    assert plan_by_tokens(tuple(c), tuple(p), tuple(g), 300, layout=layout) == first


def test_a_few_hundred_rows_plan_in_quadratic_steps():
    """O(n^2) at most: 400 rows under a budget that never binds (every run considered) plan without trouble, and
    the plan is never worse than one pass or every row apart."""
    c, p, g = random_rows(5, 400)
    plan = plan_by_tokens(c, p, g, 10**9)
    total = sum(cost(run, c, p, g) for run in plan)
    assert total <= cost(list(range(400)), c, p, g)
    assert total <= sum(cost([r], c, p, g) for r in range(400))


def test_a_row_longer_than_the_budget_gets_a_micro_batch_of_its_own():
    plan = plan_by_tokens([50, 3, 2], [4, 4, 4], [0, 0, 0], budget=20)
    assert plan[0] == [0] and sorted(r for run in plan for r in run) == [0, 1, 2]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seed,parts", [(s, k) for s in range(4) for k in (1, 2, 3, 5, 8)])
def test_split_into_gives_exactly_parts_with_the_smallest_largest_cost(seed, parts, layout):
    c, p, g = random_rows(seed, 8)
    plan = split_into(c, p, g, parts, layout=layout)
    assert len(plan) == parts and all(plan)
    assert sorted(r for run in plan for r in run) == list(range(8))
    best = min(max(cost(run, c, p, g, layout) for run in cuts)
               for cuts in contiguous_cuts(plan_order(c, g, layout)) if len(cuts) == parts)
    assert max(cost(run, c, p, g, layout) for run in plan) == best


def test_a_packed_plan_pays_for_each_rows_prompt_and_a_tree_for_each_group():
    """A group of 4 rows of 5 tokens after a 100-token prompt: 120 padded tokens (the prompt once), but 416 packed
    as copies (each row carries its own prompt) and 116 as a prefix tree (the prompt once, no padding); a 150-token
    budget holds the group in one padded forward and one tree, one row per packed row of copies."""
    c, p, g = [5] * 4, [100] * 4, [0] * 4
    assert plan_by_tokens(c, p, g, 150) == [[0, 1, 2, 3]]
    assert plan_by_tokens(c, p, g, 150, layout="packed") == [[0], [1], [2], [3]]
    assert plan_by_tokens(c, p, g, 208, layout="packed") == [[0, 1], [2, 3]]
    assert tree_tokens(c, p, g) == 100 + 4 * 4
    assert plan_by_tokens(c, p, g, 150, layout="packed_tree") == [[0, 1, 2, 3]]
    assert plan_by_tokens(c, p, g, 115, layout="packed_tree") == [[0, 1, 2], [3]]  # 112, then 104


def test_tree_tokens_counts_each_prompt_with_a_completion_once():
    # groups 0 (prompt 4: completions 5, 2), 1 (prompt 7: 3), 2 (prompt 9: only an empty completion)
    assert tree_tokens([5, 2, 3, 0], [4, 4, 7, 9], [0, 0, 1, 2]) == 4 + 7 + (5 - 1) + (2 - 1) + (3 - 1)
    assert tree_tokens([], [], []) == 0


def test_a_tree_plan_keeps_groups_whole_where_the_budget_lets_it():
    """Two groups of 3 (prompts 50 and 60), completions interleaved by length: the length order would mix them
    and pay both prompts twice; the tree's order cuts between the groups."""
    c, p, g = [10, 9, 8, 7, 6, 5], [50, 60, 50, 60, 50, 60], [0, 1, 0, 1, 0, 1]
    assert plan_by_tokens(c, p, g, 90, layout="packed_tree") == [[0, 2, 4], [1, 3, 5]]  # 71 and 78 tokens


def test_an_unknown_layout_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"micro-batch layout must be one of padded, packed, packed_tree, got 'x'"):
        plan_by_tokens([1], [1], [0], 10, layout="x")


@pytest.mark.parametrize("call, message", [
    (lambda: plan_by_tokens([1], [1], [0], 0), r"micro-batch token budget must be >= 1, got 0"),
    (lambda: split_into([1, 2], [1, 1], [0, 0], 3), r"cannot cut 2 completions into 3 micro-batches"),
    (lambda: plan_by_tokens([1, 2], [1], [0, 0], 5), r"one completion length, prompt length and group per row"),
])
def test_bad_plans_are_refused_in_one_line(call, message):
    with pytest.raises(ValueError, match=message) as raised:
        call()
    assert "\n" not in str(raised.value)


def uneven_layout(seed: int = 0, prompts: int = 3, group: int = 4, prompt_range: tuple[int, int] = (2, 10)):
    """A padded layout of uneven completions (1..40 tokens) and prompts (2..9 tokens, or ``prompt_range``)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(*prompt_range, (prompts,), generator=gen)
    width = int(prompt_lengths.max())
    prompt_ids = torch.randint(3, 50, (prompts, width), generator=gen)
    prompt_mask = (torch.arange(width) >= width - prompt_lengths.unsqueeze(1)).long()
    lengths = torch.randint(1, 41, (prompts * group,), generator=gen)
    completion_mask = (torch.arange(40) < lengths.unsqueeze(1)).long()
    completion_ids = torch.randint(3, 50, (prompts * group, 40), generator=gen) * completion_mask
    group_index = torch.arange(prompts).repeat_interleave(group)
    return prompt_ids * prompt_mask, prompt_mask, group_index, completion_ids, completion_mask


def test_token_budget_views_hold_every_row_once_with_its_own_tokens():
    prompt_ids, prompt_mask, group_index, completion_ids, completion_mask = uneven_layout()
    loss_mask = completion_mask.clone()
    loss_mask[:, ::3] = 0
    views = list(micro_batch_views(prompt_ids, prompt_mask, group_index, completion_ids, completion_mask, 4,
                                   loss_mask, micro_batch_tokens=120))
    rows = torch.cat([mb.rows for mb in views])
    assert sorted(rows.tolist()) == list(range(12)) and len(views) > 1
    for mb in views:
        width = mb.completion_ids.shape[1]
        assert width == int(completion_mask[mb.rows].sum(1).max())
        assert torch.equal(mb.completion_ids, completion_ids[mb.rows][:, :width])
        assert torch.equal(mb.loss_mask, loss_mask[mb.rows][:, :width])
        # each row's prompt, with the micro-batch's own left padding trimmed
        for i, row in enumerate(mb.rows.tolist()):
            mine = mb.prompt_ids[mb.prompt_index[i]][mb.prompt_mask[mb.prompt_index[i]].bool()]
            theirs = prompt_ids[group_index[row]][prompt_mask[group_index[row]].bool()]
            assert torch.equal(mine, theirs)
        assert torch.equal(mb.take(completion_mask.float()), completion_mask[mb.rows][:, :width].float())


def test_sorting_by_length_pays_less_padding_than_slicing_in_order():
    layout = uneven_layout(seed=3, prompts=4, group=8)
    by_rows = list(micro_batch_views(*layout, 8))
    by_tokens = list(micro_batch_views(*layout, 8, micro_batch_tokens=200))
    padded_rows, total_rows = padding_tokens(by_rows).tolist()
    padded_tokens_, total_tokens = padding_tokens(by_tokens).tolist()
    assert padded_tokens_ / total_tokens < 0.5 * padded_rows / total_rows
    # the completions' real tokens are the same either way (a prompt may be run by more micro-batches: mixing
    # groups is the price of sorting, counted in the cost the budget bounds)
    assert sum(int(mb.completion_mask.sum()) for mb in by_tokens) == sum(int(mb.completion_mask.sum())
                                                                           for mb in by_rows)
    assert padding_tokens(by_tokens)[0] == sum(mb.prompt_mask.numel() - mb.prompt_mask.sum()
                                               + mb.completion_mask.numel() - mb.completion_mask.sum()
                                               for mb in by_tokens)


@pytest.mark.parametrize("kind", ["packed", "packed_tree"])
@pytest.mark.parametrize("budget", [60, 150, 400])
def test_no_packed_row_is_longer_than_the_budget(budget, kind):
    """Under packing each micro-batch is fed as one row (``packed_token_count``), as prompt copies or a prefix tree
    (prompts here 40 to 99 tokens): the budget bounds that row, unless one sequence alone is longer; forced into
    more parts, the longest packed row is no longer."""
    layout = uneven_layout(seed=2, prompt_range=(40, 100))
    views = list(micro_batch_views(*layout, 4, micro_batch_tokens=budget, layout=kind))
    assert sorted(torch.cat([mb.rows for mb in views]).tolist()) == list(range(12))
    for mb in views:
        assert int(packed_token_count(mb, kind)) <= budget or mb.rows.numel() == 1, (budget, mb.rows)
    parts = min(len(views) + 1, 12)
    more = list(micro_batch_views(*layout, 4, micro_batch_tokens=budget, layout=kind, parts=parts))
    assert len(more) == parts
    assert (max(int(packed_token_count(mb, kind)) for mb in more)
            <= max(int(packed_token_count(mb, kind)) for mb in views))


def test_forced_parts_are_what_the_ranks_agree_on():
    layout = uneven_layout(seed=1)
    own = list(micro_batch_views(*layout, 4, micro_batch_tokens=150))
    more = list(micro_batch_views(*layout, 4, micro_batch_tokens=150, parts=len(own) + 2))
    assert len(more) == len(own) + 2
    assert sorted(torch.cat([mb.rows for mb in more]).tolist()) == list(range(12))


# ---- the update is today's: one process here, two ranks in tests/test_multiprocess.py ----------------------

@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("mask,aggregation", [(True, "token_mean"), (False, "seq_mean_token_mean"),
                                               (True, "constant")])
def test_token_budget_update_equals_row_slicing(tmp_path, monkeypatch, mask, aggregation, packing):
    """Two steps of the same fit with today's micro-batches of 4 rows and with a token budget small enough to cut
    another way: the same weights (1e-5, the suite's tolerance for 2 ranks against 1: AdamW's first steps move a
    parameter by about lr whatever its gradient's size, so float noise in a tiny gradient shows) and the same
    logged loss, KL, ratios and gradient norm. Packed (``model.packing``): the same, with no padding at all."""
    rows = equality_job(mask, aggregation, 2, str(tmp_path / "rows.pt"), "single")
    tokens = equality_job(mask, aggregation, 2, str(tmp_path / "tokens.pt"), "single", micro_batch_tokens=200)
    tokens["module"]["packing"] = packing
    import lit_grpo.core.scoring as scoring

    packed_calls = []
    packed = scoring.packed_completion_logprobs
    monkeypatch.setattr(scoring, "packed_completion_logprobs",
                        lambda *args, **kwargs: packed_calls.append(1) or packed(*args, **kwargs))
    a = run_job(rows, str(tmp_path / "a"))
    assert not packed_calls  # today's path packs nothing
    b = run_job(tokens, str(tmp_path / "b"))
    assert bool(packed_calls) == packing  # the packed forward is what ran
    expected, got = torch.load(tmp_path / "rows.pt"), torch.load(tmp_path / "tokens.pt")
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= 1e-5
    for x, y in zip(a["steps"], b["steps"], strict=True):
        for key in ("train/loss", "train/kl", "train/ratio_mean", "train/entropy", "train/grad_norm",
                    "train/clip_low_fraction", "rollout/reward_mean"):
            assert y[key] == pytest.approx(x[key], abs=1e-6), key
        assert y["train/padded_fraction"] <= x["train/padded_fraction"]
        if packing:
            assert y["train/padded_fraction"] == 0
    # prompts of 140 to 331 tokens: a budget of 200 puts a short prompt's group in one micro-batch and the rows of a
    # long one each in its own, so the cut differs from 4 rows at a time and the padding of step 2 goes
    assert any(y["train/padded_fraction"] < x["train/padded_fraction"] for x, y in zip(a["steps"], b["steps"]))
    assert any(s["train/loss"] != 0 for s in a["steps"])


def test_bad_token_budget_is_refused_before_anything_loads():
    from conftest import tiny_data

    for bad in (0, -5, 2.5, True, "4096"):
        with pytest.raises(ValueError, match=r"micro_batch_tokens must be an integer >= 1 or None, got ") as raised:
            tiny_data(micro_batch_tokens=bad)
        assert "\n" not in str(raised.value)
