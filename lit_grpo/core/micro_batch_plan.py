"""Token-budget micro-batches: which completions of a rollout batch go into which forward pass.

A micro-batch is computed padded: its distinct prompts as a ``[u, P']`` block (left-padded to its longest prompt)
and its completions as an ``[s, C']`` block (right-padded to its longest completion). Its cost is the tokens of
those two blocks (:func:`padded_tokens`), real or padding. Today's micro-batches take ``micro_batch_size``
completions in order, so on uneven lengths each pays for its longest completion on every row. A token budget
instead sorts the completions by length (longest first, so the largest forward, which sets the memory peak, comes
first) and cuts the sorted order into contiguous runs whose padded tokens stay within the budget: rows of similar
length share a micro-batch, and short ones are many to a pass.

Only the partition changes: the loss weights divide by totals of the whole batch (``lit_grpo.math.aggregation``),
so the update is the same sum over rows, whatever micro-batch each row is in.

Sharded ranks (FSDP) must make the same number of forwards (each one gathers parameters together), so a plan can
be asked for an exact number of micro-batches (:func:`split_into`): the ranks agree on the largest count any of
them needs, and each cuts its own rows into that many runs with the smallest possible largest cost.
"""

from __future__ import annotations

from collections.abc import Sequence


def padded_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int]) -> int:
    """Tokens a micro-batch of these rows computes, padding included: ``rows x longest completion`` plus
    ``distinct prompts x longest prompt`` (a row's prompt is ``groups[i]``; ``prompt_lengths[i]`` its length)."""
    if not completion_lengths:
        return 0
    return len(completion_lengths) * max(completion_lengths) + len(set(groups)) * max(prompt_lengths)


def length_order(completion_lengths: Sequence[int], groups: Sequence[int]) -> list[int]:
    """Rows longest completion first; ties keep a group's rows together, then the rows' order (deterministic, so
    every process that plans the same batch gets the same micro-batches)."""
    return sorted(range(len(completion_lengths)), key=lambda r: (-completion_lengths[r], groups[r], r))


def _cut(order: list[int], completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
         budget: int) -> list[list[int]]:
    """Greedy contiguous runs of ``order``, each within ``budget`` padded tokens; a row alone over the budget gets
    a run of its own. Adding a row never lowers a run's cost, so greedy runs are the fewest possible."""
    runs: list[list[int]] = []
    current: list[int] = []
    longest = prompt_longest = 0
    prompts: set[int] = set()
    for row in order:
        c, p, g = completion_lengths[row], prompt_lengths[row], groups[row]
        grown = (len(current) + 1) * max(longest, c) + len(prompts | {g}) * max(prompt_longest, p)
        if current and grown > budget:
            runs.append(current)
            current, longest, prompt_longest, prompts = [], 0, 0, set()
        current.append(row)
        longest, prompt_longest = max(longest, c), max(prompt_longest, p)
        prompts.add(g)
    if current:
        runs.append(current)
    return runs


def plan_by_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
                   budget: int) -> list[list[int]]:
    """The fewest micro-batches of at most ``budget`` padded tokens each (a longer single row: one of its own),
    cut from the rows sorted by :func:`length_order`. Each micro-batch lists its rows in ascending order."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    _check_lengths(completion_lengths, prompt_lengths, groups)
    order = length_order(completion_lengths, groups)
    return [sorted(run) for run in _cut(order, completion_lengths, prompt_lengths, groups, budget)]


def split_into(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
               parts: int) -> list[list[int]]:
    """Exactly ``parts`` micro-batches (``1 <= parts <= rows``) of the length-sorted rows, contiguous in that order,
    whose largest padded cost is the smallest any such cut reaches (the least budget under which the greedy cut
    needs at most ``parts`` runs, found by bisection; then the runs with most rows are halved until there are
    ``parts``)."""
    _check_lengths(completion_lengths, prompt_lengths, groups)
    rows = len(completion_lengths)
    if not 1 <= parts <= rows:
        raise ValueError(f"cannot cut {rows} completions into {parts} micro-batches; expected 1 <= parts <= {rows}")
    order = length_order(completion_lengths, groups)
    low = max(padded_tokens([completion_lengths[r]], [prompt_lengths[r]], [groups[r]]) for r in order)
    high = padded_tokens(completion_lengths, prompt_lengths, groups)
    while low < high:
        middle = (low + high) // 2
        if len(_cut(order, completion_lengths, prompt_lengths, groups, middle)) <= parts:
            high = middle
        else:
            low = middle + 1
    runs = _cut(order, completion_lengths, prompt_lengths, groups, low)
    while len(runs) < parts:
        widest = max(range(len(runs)), key=lambda i: (len(runs[i]), -i))
        run = runs[widest]
        runs[widest: widest + 1] = [run[: len(run) // 2], run[len(run) // 2:]]
    return [sorted(run) for run in runs]


def _check_lengths(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int]) -> None:
    if not (len(completion_lengths) == len(prompt_lengths) == len(groups)) or not completion_lengths:
        raise ValueError(f"a plan needs one completion length, prompt length and group per row, got "
                         f"{len(completion_lengths)}, {len(prompt_lengths)} and {len(groups)}")
