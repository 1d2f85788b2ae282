"""Token-budget micro-batches: which completions of a rollout batch go into which forward pass.

A micro-batch is computed padded: its distinct prompts as a ``[u, P']`` block (left-padded to its longest prompt)
and its completions as an ``[s, C']`` block (right-padded to its longest completion). Its cost is the tokens of
those two blocks (:func:`padded_tokens`), real or padding. Today's micro-batches take ``micro_batch_size``
completions in order, so on uneven lengths each pays for its longest completion on every row. A token budget
instead sorts the completions by length (longest first, so the largest forward, which sets the memory peak, comes
first) and cuts the sorted order into contiguous runs, each within the budget, whose padded tokens add up to the
least total: rows of similar length share a micro-batch, and short ones are many to a pass.

The cut is dynamic programming over the sorted order ``o_0 .. o_{n-1}``. With ``cost(i, j)`` the cost of the run
``o_i .. o_{j-1}``, the best cut of the rows from ``i`` on is

    T(n) = 0,    T(i) = min over j in (i, n] with cost(i, j) <= budget or j = i + 1 of  cost(i, j) + T(j),

compared as the pair (total tokens, micro-batches), so that among cuts of equal total the fewest passes win, and
on a full tie the longest first run (the largest ``j``): the same plan on every process for the same lengths. A
run's cost never falls when it takes one more row, so the scan over ``j`` stops at the first run over the budget:
O(n x rows per run) <= O(n^2) steps. A single row over the budget gets a run of its own. The cut with the fewest
micro-batches (the greedy one, before this cut) can pay much more: it fills each pass to the budget, padding short
rows to the longest of their pass. On the recorded steps of ``benchmarks/uneven_lengths.py`` at 4,096 tokens
(``benchmarks/plan_padding.py``) the greedy cut made 2 passes a batch with 38 % padding, this one 6.4 with 6.5 %,
0.75 of the tokens. The budget bounds a pass; it is not a target: a prompt's tokens, paid once per pass that holds
its rows, are what stops a cut from going finer, and nothing here counts a pass's own fixed cost (launches, a
sharded model's parameter gathers).

Only the partition changes: the loss weights divide by totals of the whole batch (``lit_grpo.math.aggregation``),
so the update is the same sum over rows, whatever micro-batch each row is in.

Packed (``model.packing``), a micro-batch is fed as ONE row of real tokens (no padding) in one of two layouts
(:data:`LAYOUTS`). ``"packed"`` (:mod:`lit_grpo.core.packing`, flash attention): each completion carries its own copy
of its prompt, so its cost, :func:`packed_tokens`, counts a group's prompt once per completion. ``"packed_tree"``
(:mod:`lit_grpo.core.prefix_tree`, sdpa, eager and flex attention): a prefix tree, each distinct prompt once, so its
cost, :func:`tree_tokens`, is the padded cost without the padding. The same dynamic programming applies. As no
packed cut pads, the copies layout's cuts all have the same total and its plan is the fewest micro-batches, each
first run as long as the budget lets it be (the greedy cut); the tree's total grows with each group split across
micro-batches (its prompt paid again), so its rows are ordered group by group (:func:`tree_order`) and the cut keeps
groups whole where the budget lets it.

Sharded ranks (FSDP) must make the same number of forwards (each one gathers parameters together), so a plan can
be asked for an exact number of micro-batches (:func:`split_into`): the ranks agree on the largest count any of
them needs, and each cuts its own rows into that many runs with the smallest possible largest cost. It stays that
cut (a bisection over the greedy cut), not the least total among the cuts with that count and that largest cost:
measured with ``benchmarks/plan_padding.py`` on the uneven workload at 2 and 4 ranks of 1 to 8 prompts x 8, the
least total would save 0.2 to 2.3 % of the ranks' tokens at the same largest cost (the memory peak), for a second
dynamic program over (parts, rows) on every forced rank at every step, 3 to 5.5 times this one's time at 256 and
512 rows (0.27 s against 0.05 s at 512).
"""

from __future__ import annotations

from collections.abc import Sequence

#: how a micro-batch is fed, and so what it costs: padded blocks, a packed row of prompt copies, a packed prefix tree
LAYOUTS = ("padded", "packed", "packed_tree")


def padded_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int]) -> int:
    """Tokens a micro-batch of these rows computes, padding included: ``rows x longest completion`` plus
    ``distinct prompts x longest prompt`` (a row's prompt is ``groups[i]``; ``prompt_lengths[i]`` its length)."""
    if not completion_lengths:
        return 0
    return len(completion_lengths) * max(completion_lengths) + len(set(groups)) * max(prompt_lengths)


def packed_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int]) -> int:
    """Tokens the packed row of these rows feeds the model (``lit_grpo.core.packing.packed_layout``): each row its
    prompt and its completion but the last token (nothing for an empty completion), no padding."""
    return sum(p + c - 1 for c, p in zip(completion_lengths, prompt_lengths) if c > 0)


def tree_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int]) -> int:
    """Tokens budgeted for the prefix tree of these rows (``lit_grpo.core.prefix_tree``): each distinct prompt
    that has a non-empty completion once, and each completion but its last token. An upper bound of the tree's
    nodes: completions that begin alike share their common prefix too, which is not subtracted."""
    prompts = {g: p for c, p, g in zip(completion_lengths, prompt_lengths, groups) if c > 0}
    return sum(prompts.values()) + sum(c - 1 for c in completion_lengths if c > 0)


def micro_batch_cost(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
                     layout: str = "padded") -> int:
    """A micro-batch's cost in tokens as ``layout`` feeds it: :func:`padded_tokens`, :func:`packed_tokens` or
    :func:`tree_tokens`."""
    if layout == "packed":
        return packed_tokens(completion_lengths, prompt_lengths)
    if layout == "packed_tree":
        return tree_tokens(completion_lengths, prompt_lengths, groups)
    return padded_tokens(completion_lengths, prompt_lengths, groups)


def length_order(completion_lengths: Sequence[int], groups: Sequence[int]) -> list[int]:
    """Rows longest completion first; ties keep a group's rows together, then the rows' order (deterministic, so
    every process that plans the same batch gets the same micro-batches)."""
    return sorted(range(len(completion_lengths)), key=lambda r: (-completion_lengths[r], groups[r], r))


def tree_order(completion_lengths: Sequence[int], groups: Sequence[int]) -> list[int]:
    """Rows group by group (the group with the longest completion first), longest completion first within a group:
    a contiguous cut of this order splits a group, and pays its prompt again, only where the budget forces it."""
    longest: dict[int, int] = {}
    for c, g in zip(completion_lengths, groups):
        longest[g] = max(longest.get(g, 0), c)
    return sorted(range(len(completion_lengths)),
                  key=lambda r: (-longest[groups[r]], groups[r], -completion_lengths[r], r))


def plan_order(completion_lengths: Sequence[int], groups: Sequence[int], layout: str) -> list[int]:
    """The order a plan cuts into contiguous runs: :func:`tree_order` for a prefix tree, else
    :func:`length_order`."""
    if layout not in LAYOUTS:
        raise ValueError(f"micro-batch layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    return tree_order(completion_lengths, groups) if layout == "packed_tree" else length_order(completion_lengths,
                                                                                                groups)


def _cut(order: list[int], completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
         budget: int, layout: str = "padded") -> list[list[int]]:
    """Greedy contiguous runs of ``order``, each within ``budget`` tokens as ``layout`` feeds them; a row alone over
    the budget gets a run of its own. Adding a row never lowers a run's cost, so greedy runs are the fewest
    possible: what :func:`split_into`'s bisection asks of a budget."""
    runs: list[list[int]] = []
    current: list[int] = []
    longest = prompt_longest = fed = 0
    prompts: set[int] = set()
    for row in order:
        c, p, g = completion_lengths[row], prompt_lengths[row], groups[row]
        if layout == "padded":
            grown = (len(current) + 1) * max(longest, c) + len(prompts | {g}) * max(prompt_longest, p)
        else:  # the row's tokens are appended to the packed row
            grown = fed + _packed_growth(c, p, g, prompts, layout)
        if current and grown > budget:
            runs.append(current)
            current, longest, prompt_longest, fed, prompts = [], 0, 0, 0, set()
        current.append(row)
        longest, prompt_longest = max(longest, c), max(prompt_longest, p)
        fed += _packed_growth(c, p, g, prompts, layout)
        if c > 0 or layout == "padded":
            prompts.add(g)
    if current:
        runs.append(current)
    return runs


def _packed_growth(c: int, p: int, g: int, prompts: set[int], layout: str) -> int:
    """Tokens a row of completion ``c``, prompt ``p``, group ``g`` adds to a packed row whose groups with a
    non-empty completion are ``prompts``: its prompt copy and completion (``"packed"``), or its completion and,
    when its group is new, its prompt (``"packed_tree"``)."""
    if c == 0:
        return 0
    if layout == "packed_tree":
        return c - 1 + (0 if g in prompts else p)
    return p + c - 1


def _least_cost_cut(order: list[int], completion_lengths: Sequence[int], prompt_lengths: Sequence[int],
                    groups: Sequence[int], budget: int, layout: str = "padded") -> list[list[int]]:
    """Contiguous runs of ``order``, each within ``budget`` (a row alone over it: a run of its own), of the least
    total cost, then the fewest runs, then the longest first run: the recurrence of the module docstring,
    solved from the last row back."""
    n = len(order)
    total = [0] * (n + 1)  # T(i): the least (total cost, runs) of the rows order[i:]
    runs = [0] * (n + 1)
    end = [n] * (n + 1)  # where T(i)'s first run ends
    for i in range(n - 1, -1, -1):
        best: tuple[int, int] | None = None
        longest = prompt_longest = fed = 0
        prompts: set[int] = set()
        for j in range(i, n):
            row = order[j]
            c, p, g = completion_lengths[row], prompt_lengths[row], groups[row]
            if layout == "padded":  # the running maxima and distinct prompts: O(1) a row, not O(run) from scratch
                longest, prompt_longest = max(longest, c), max(prompt_longest, p)
                prompts.add(g)
                cost = (j - i + 1) * longest + len(prompts) * prompt_longest
            else:
                fed += _packed_growth(c, p, g, prompts, layout)
                if c > 0:
                    prompts.add(g)
                cost = fed
            if j > i and cost > budget:  # a run's cost never falls as it grows: no longer run fits either
                break
            key = (cost + total[j + 1], 1 + runs[j + 1])
            if best is None or key <= best:  # "<=": on a full tie the later end, the longest first run, wins
                best, end[i] = key, j + 1
        assert best is not None  # j = i always gives a run
        total[i], runs[i] = best
    cut, start = [], 0
    while start < n:
        cut.append(order[start:end[start]])
        start = end[start]
    return cut


def plan_by_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
                   budget: int, layout: str = "padded") -> list[list[int]]:
    """Micro-batches of at most ``budget`` tokens each as ``layout`` feeds them (a longer single row: one of its
    own), cut from the rows in :func:`plan_order` into contiguous runs of the least total cost, ``sum of
    cost(run)`` (:func:`micro_batch_cost`), and among those the fewest runs (the dynamic programming of the module
    docstring). Each micro-batch lists its rows in ascending order."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    _check_lengths(completion_lengths, prompt_lengths, groups)
    order = plan_order(completion_lengths, groups, layout)
    return [sorted(run) for run in _least_cost_cut(order, completion_lengths, prompt_lengths, groups, budget,
                                                   layout)]


def split_into(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
               parts: int, layout: str = "padded") -> list[list[int]]:
    """Exactly ``parts`` micro-batches (``1 <= parts <= rows``) of the rows in :func:`plan_order`, contiguous in that
    order, whose largest cost as ``layout`` feeds them is the smallest any such cut reaches (the least budget under
    which the greedy cut needs at most ``parts`` runs, found by bisection; then the runs with most rows are halved
    until there are ``parts``)."""
    _check_lengths(completion_lengths, prompt_lengths, groups)
    rows = len(completion_lengths)
    if not 1 <= parts <= rows:
        raise ValueError(f"cannot cut {rows} completions into {parts} micro-batches; expected 1 <= parts <= {rows}")
    order = plan_order(completion_lengths, groups, layout)
    low = max(micro_batch_cost([completion_lengths[r]], [prompt_lengths[r]], [groups[r]], layout) for r in order)
    high = micro_batch_cost(completion_lengths, prompt_lengths, groups, layout)
    while low < high:
        middle = (low + high) // 2
        if len(_cut(order, completion_lengths, prompt_lengths, groups, middle, layout)) <= parts:
            high = middle
        else:
            low = middle + 1
    runs = _cut(order, completion_lengths, prompt_lengths, groups, low, layout)
    while len(runs) < parts:
        widest = max(range(len(runs)), key=lambda i: (len(runs[i]), -i))
        run = runs[widest]
        runs[widest: widest + 1] = [run[: len(run) // 2], run[len(run) // 2:]]
    return [sorted(run) for run in runs]


def _check_lengths(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int]) -> None:
    if not (len(completion_lengths) == len(prompt_lengths) == len(groups)) or not completion_lengths:
        raise ValueError(f"a plan needs one completion length, prompt length and group per row, got "
                         f"{len(completion_lengths)}, {len(prompt_lengths)} and {len(groups)}")
