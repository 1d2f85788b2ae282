"""How a statistic of the training step is merged: the one rule, by the statistic's name.

A step's statistics merge along three axes: over the micro-batches of one iteration (in one process, in sequence),
over the iterations of the step (the paper's i optimizer steps, in sequence) and over ranks (side by side).
:func:`reduction` says how, for every axis, and every place that merges statistics asks it: :func:`merge_stats`
(micro-batches, on the device), :func:`over_iterations` (iterations, on the host) and
:func:`reduce_stats` (ranks, one collective per kind).

=====================================  ==============  ==========  ======================
statistic's name                       micro-batches   iterations  ranks
=====================================  ==============  ==========  ======================
``*_min``                              min             min         min
``*_max``                              max             max         max
``*_seconds``                          sum             sum         max (the slowest rank)
``rollout/<count>`` (ROLLOUT_COUNTS)   n/a             n/a         sum
``rollout/*`` (any other)              n/a             n/a         mean
any other (token sums and counts)      sum             sum         sum
=====================================  ==============  ==========  ======================

The suffixes come first: ``rollout/staleness_max`` is a maximum, ``rollout/generate_seconds`` the slowest rank's.
A rollout statistic (``RolloutBatch.stats``) is one number per rank's batch, never split into micro-batches or
iterations: most are means over the rank's sequences, which average over ranks (every rank holds the same number
of sequences), and the counts add. Statistics of an iteration are named with its prefix, :func:`iteration_key`.

Pure Python and torch (no Lightning); :func:`reduce_stats` uses the process-group plumbing of
``lit_grpo.core.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from lit_grpo.core.distributed import all_reduce, is_distributed, stack_to_host

MICRO_BATCHES, ITERATIONS, RANKS = "micro_batches", "iterations", "ranks"
AXES = (MICRO_BATCHES, ITERATIONS, RANKS)
#: the rollout statistics that are counts over the rank's batch (or its data module's run), so they add over ranks
ROLLOUT_COUNTS = ("generated_tokens", "reward_errors", "reward_timeouts", "env_errors", "tool_errors",
                  "template_mismatch")
ROLLOUT_PREFIX = "rollout/"

# on the device, per micro-batch: float64 0-d tensors, no host sync
_TENSOR_MERGE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sum": torch.add, "min": torch.minimum, "max": torch.maximum}
# on the host, per iteration: Python floats; `sum` keeps the float order of a plain left-to-right addition
_FLOAT_MERGE: dict[str, Callable[[list[float]], float]] = {"sum": sum, "min": min, "max": max}


def reduction(key: str, axis: str) -> str:
    """How the statistic named ``key`` merges over ``axis`` (``micro_batches``, ``iterations`` or ``ranks``):
    ``sum``, ``min``, ``max`` or, over ranks only, ``mean`` (the module docstring's table)."""
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; expected one of {AXES}")
    if key.endswith("_min"):
        return "min"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_seconds"):
        # one process's work runs in sequence and adds up; ranks run side by side, so the step waits for the slowest
        return "max" if axis == RANKS else "sum"
    if axis == RANKS and key.startswith(ROLLOUT_PREFIX) and key.removeprefix(ROLLOUT_PREFIX) not in ROLLOUT_COUNTS:
        return "mean"
    return "sum"


def iteration_key(iteration: int, name: str) -> str:
    """The name of statistic ``name`` of the step's iteration ``iteration`` (0-based), ``it{i}/name``, once the
    iterations' statistics share one dict (the one reduced over ranks)."""
    return f"it{iteration}/{name}"


def merge_stats(into: dict[str, torch.Tensor], stats: Mapping[str, torch.Tensor]) -> None:
    """Fold one micro-batch's statistics into running totals of the iteration, by :func:`reduction`, in float64 on
    the statistics' own device: no host sync per micro-batch, the totals reach the host once per step."""
    for key, value in stats.items():
        value = value.detach().to(torch.float64)
        into[key] = value if key not in into else _TENSOR_MERGE[reduction(key, MICRO_BATCHES)](into[key], value)


def over_iterations(values: Mapping[str, float], name: str, iterations: int) -> float:
    """Statistic ``name`` merged over the step's ``iterations`` (held as ``values[iteration_key(i, name)]``), by
    :func:`reduction`: sums and counts add, extrema combine."""
    per_iteration = [values[iteration_key(i, name)] for i in range(iterations)]
    return _FLOAT_MERGE[reduction(name, ITERATIONS)](per_iteration)


def reduce_stats(stats: dict[str, torch.Tensor | float]) -> dict[str, torch.Tensor]:
    """Reduce a dict of scalar statistics over ranks in three collectives (min, max, sum), each key as the one
    rule says (:func:`reduction` over ``ranks``): ``*_min`` the minimum, ``*_max`` and
    ``*_seconds`` the maximum, a rollout mean the mean (a sum of each rank's share), every other key the sum
    (counts and sums, which merge exactly).

    Values may be Python numbers or 0-d tensors on any device; the result is float64 on the host. Device values
    come over in one transfer (:func:`lit_grpo.core.distributed.stack_to_host`), so a trainer can keep its statistics
    on the
    device for a
    whole step and pay one host sync here, instead of one per value."""
    keys = sorted(stats)
    values = dict(zip(keys, stack_to_host([stats[k] for k in keys]).unbind()))
    if not is_distributed():
        return values
    world = dist.get_world_size()
    ops = {k: reduction(k, RANKS) for k in keys}
    values.update({k: values[k] / world for k in keys if ops[k] == "mean"})
    out: dict[str, torch.Tensor] = {}
    for op in ("min", "max", "sum"):
        group = [k for k in keys if ops[k] == op or (op == "sum" and ops[k] == "mean")]
        if group:
            reduced = all_reduce(torch.stack([values[k] for k in group]), op)
            out.update(zip(group, reduced.unbind()))
    return out
