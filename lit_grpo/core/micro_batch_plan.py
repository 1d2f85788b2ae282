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

Packed (``model.packing``, :mod:`lit_grpo.core.packing`), a micro-batch is fed as ONE row of real tokens in which
each completion carries its own copy of its prompt: its cost is then :func:`packed_tokens`, every row paying
prompt + completion and none paying padding, so a group's prompt counts once per completion rather than once.
The same greedy cut and bisection apply (``packed=True``); the budget then bounds the packed row's length.

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


def packed_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int]) -> int:
    """Tokens the packed row of these rows feeds the model (``lit_grpo.core.packing.packed_layout``): each row its
    prompt and its completion but the last token (nothing for an empty completion), no padding."""
    return sum(p + c - 1 for c, p in zip(completion_lengths, prompt_lengths) if c > 0)


def micro_batch_cost(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
                     packed: bool = False) -> int:
    """A micro-batch's cost in tokens: :func:`packed_tokens` when it is fed packed, else :func:`padded_tokens`."""
    if packed:
        return packed_tokens(completion_lengths, prompt_lengths)
    return padded_tokens(completion_lengths, prompt_lengths, groups)


def length_order(completion_lengths: Sequence[int], groups: Sequence[int]) -> list[int]:
    """Rows longest completion first; ties keep a group's rows together, then the rows' order (deterministic, so
    every process that plans the same batch gets the same micro-batches)."""
    return sorted(range(len(completion_lengths)), key=lambda r: (-completion_lengths[r], groups[r], r))


def _cut(order: list[int], completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
         budget: int, packed: bool = False) -> list[list[int]]:
    """Greedy contiguous runs of ``order``, each within ``budget`` tokens (padded, or ``packed``); a row alone over
    the budget gets a run of its own. Adding a row never lowers a run's cost, so greedy runs are the fewest
    possible."""
    runs: list[list[int]] = []
    current: list[int] = []
    longest = prompt_longest = fed = 0
    prompts: set[int] = set()
    for row in order:
        c, p, g = completion_lengths[row], prompt_lengths[row], groups[row]
        if packed:  # the row's own prompt and completion are appended to the packed row
            grown = fed + packed_tokens([c], [p])
        else:
            grown = (len(current) + 1) * max(longest, c) + len(prompts | {g}) * max(prompt_longest, p)
        if current and grown > budget:
            runs.append(current)
            current, longest, prompt_longest, fed, prompts = [], 0, 0, 0, set()
        current.append(row)
        longest, prompt_longest = max(longest, c), max(prompt_longest, p)
        fed += packed_tokens([c], [p])
        prompts.add(g)
    if current:
        runs.append(current)
    return runs


def plan_by_tokens(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
                   budget: int, packed: bool = False) -> list[list[int]]:
    """The fewest micro-batches of at most ``budget`` tokens each (padded tokens, or with ``packed`` the packed
    row's; a longer single row: one of its own), cut from the rows sorted by :func:`length_order`. Each
    micro-batch lists its rows in ascending order."""
    if budget < 1:
        raise ValueError(f"micro-batch token budget must be >= 1, got {budget}")
    _check_lengths(completion_lengths, prompt_lengths, groups)
    order = length_order(completion_lengths, groups)
    return [sorted(run) for run in _cut(order, completion_lengths, prompt_lengths, groups, budget, packed)]


def split_into(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int],
               parts: int, packed: bool = False) -> list[list[int]]:
    """Exactly ``parts`` micro-batches (``1 <= parts <= rows``) of the length-sorted rows, contiguous in that order,
    whose largest cost (padded, or ``packed``) is the smallest any such cut reaches (the least budget under which
    the greedy cut needs at most ``parts`` runs, found by bisection; then the runs with most rows are halved until
    there are ``parts``)."""
    _check_lengths(completion_lengths, prompt_lengths, groups)
    rows = len(completion_lengths)
    if not 1 <= parts <= rows:
        raise ValueError(f"cannot cut {rows} completions into {parts} micro-batches; expected 1 <= parts <= {rows}")
    order = length_order(completion_lengths, groups)
    low = max(micro_batch_cost([completion_lengths[r]], [prompt_lengths[r]], [groups[r]], packed) for r in order)
    high = micro_batch_cost(completion_lengths, prompt_lengths, groups, packed)
    while low < high:
        middle = (low + high) // 2
        if len(_cut(order, completion_lengths, prompt_lengths, groups, middle, packed)) <= parts:
            high = middle
        else:
            low = middle + 1
    runs = _cut(order, completion_lengths, prompt_lengths, groups, low, packed)
    while len(runs) < parts:
        widest = max(range(len(runs)), key=lambda i: (len(runs[i]), -i))
        run = runs[widest]
        runs[widest: widest + 1] = [run[: len(run) // 2], run[len(run) // 2:]]
    return [sorted(run) for run in runs]


def _check_lengths(completion_lengths: Sequence[int], prompt_lengths: Sequence[int], groups: Sequence[int]) -> None:
    if not (len(completion_lengths) == len(prompt_lengths) == len(groups)) or not completion_lengths:
        raise ValueError(f"a plan needs one completion length, prompt length and group per row, got "
                         f"{len(completion_lengths)}, {len(prompt_lengths)} and {len(groups)}")
