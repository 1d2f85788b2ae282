"""Batch shaping on the data side: DAPO's dynamic sampling and soft overlong penalty, as ``RolloutDataModule``
options (``data.dynamic_sampling``, ``data.overlong_penalty``).

Dynamic sampling (Yu et al. 2025, "DAPO", section 3.2; verl's ``algorithm.filter_groups``): a group whose G rewards
are all equal has advantage 0 and gives no gradient, so a batch is formed from groups with a spread only. A rank
samples its own share of the batch (round 0), drops the zero-variance groups, and samples further prompts (rounds 1,
2, ...) until it holds ``prompts_per_step`` groups with a spread or has run ``max_rounds`` rounds. The whole batch is
formed inside one rollout job (``form_batch``), so that with ``max_staleness`` >= 1 the producer thread forms whole
batches, and the rewards are computed there, where the groups are chosen.

Determinism: the extra prompts of round r of batch b on rank k are a seeded draw (``draw_seed``) from the dataset's
rows not yet tried in that batch, and round r samples with its own seed (``sampling_seed``; round 0 keeps the
batch's ordinary seed), so a run resumed from a checkpoint forms the same batches as a run straight through.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from lit_grpo.data.rollout import rollout_seed
from lit_grpo.engines.base import Completion, Rollouts

#: seeds are folded below this bound (the engines keep seeds in int64 buffers)
SEED_MODULUS = 2**62


@dataclass(frozen=True)
class DynamicSampling:
    """DAPO's dynamic sampling (``data.dynamic_sampling``; Yu et al. 2025, section 3.2; verl's
    ``algorithm.filter_groups``): groups whose rewards all equal are dropped and refilled with further prompts.

    Args:
        enabled: form each rank's batch from groups with a reward spread only.
        max_rounds: generation rounds per batch at most (round 0 samples the batch's own prompts, each later round
            draws further prompts); verl's ``max_num_gen_batches``.
        oversample: prompts sampled per round, as a multiple of the groups still missing (round 0: of
            ``prompts_per_step``; the extra prompts are drawn from the dataset); DAPO's recipe samples 3x. Groups
            with a spread beyond the batch's size are discarded (``rollout/dynamic_surplus_groups``).
        at_cap: what a rank does when ``max_rounds`` rounds left it short of ``prompts_per_step`` groups with a
            spread: ``pad`` fills the batch with zero-variance groups from its rounds (advantage 0: no gradient, the
            batch keeps its size, so every rank takes the same number of optimizer steps; counted in
            ``rollout/dynamic_padded_groups``); ``error`` stops the run, as verl does.
    """

    enabled: bool = False
    max_rounds: int = 4
    oversample: float = 1.0
    at_cap: Literal["pad", "error"] = "pad"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"dynamic_sampling.enabled must be true or false, got {self.enabled!r}")
        if isinstance(self.max_rounds, bool) or not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            raise ValueError(f"dynamic_sampling.max_rounds must be an integer >= 1, got {self.max_rounds!r}")
        if isinstance(self.oversample, bool) or not isinstance(self.oversample, (int, float)) \
                or not (math.isfinite(self.oversample) and self.oversample >= 1):
            raise ValueError(f"dynamic_sampling.oversample must be a number >= 1, got {self.oversample!r}")
        if self.at_cap not in ("pad", "error"):
            raise ValueError(f"dynamic_sampling.at_cap must be 'pad' or 'error', got {self.at_cap!r}")


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment (``data.overlong_penalty``; Yu et al. 2025, eq. 13; verl's
    ``reward_model.overlong_buffer``): ``factor * R_length(|y|)`` is added to each completion's reward before the
    advantages, with ``L_max = data.max_new_tokens`` and ``L_cache = buffer`` (``lit_grpo.math.overlong``).

    Args:
        buffer: L_cache, the last tokens before ``max_new_tokens`` over which the penalty falls linearly from 0 to
            ``-factor``; 0 turns the penalty off. Must be below ``max_new_tokens``.
        factor: the penalty's scale (verl's ``penalty_factor``), >= 0.
    """

    buffer: int = 0
    factor: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.buffer, bool) or not isinstance(self.buffer, int) or self.buffer < 0:
            raise ValueError(f"overlong_penalty.buffer must be an integer >= 0 (tokens; 0: off), got {self.buffer!r}")
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)) \
                or not (math.isfinite(self.factor) and self.factor >= 0):
            raise ValueError(f"overlong_penalty.factor must be a finite number >= 0, got {self.factor!r}")

    @property
    def enabled(self) -> bool:
        return self.buffer > 0


class DynamicSamplingError(RuntimeError):
    """A rank ran ``max_rounds`` rounds without enough groups with a spread, and ``at_cap`` is ``error``."""


@dataclass(frozen=True)
class Scored:
    """One round's rewards (flat, prompt-major, penalties included) and the reward runner's failures on it."""

    rewards: list[float]
    errors: int = 0
    timeouts: int = 0
    #: each reward function's unweighted score of each completion, by the function's name (empty: not kept, as for
    #: a batch formed over several rounds); for the sampled-completions table, not the loss
    per_function: dict[str, list[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Formed:
    """A batch formed by dynamic sampling: its groups' dataset rows and rewards (flat, in the groups' order), the
    reward failures of all its rounds, and its statistics. Plain data: a checkpoint keeps it for a batch generated
    ahead (``to_state``)."""

    rows: list[int]
    rewards: list[float]
    reward_errors: int = 0
    reward_timeouts: int = 0
    stats: dict[str, float] = field(default_factory=dict)

    def to_state(self) -> dict[str, Any]:
        return {"rows": list(self.rows), "rewards": [float(r) for r in self.rewards],
                "reward_errors": int(self.reward_errors), "reward_timeouts": int(self.reward_timeouts),
                "stats": {k: float(v) for k, v in self.stats.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Formed:
        return cls([int(r) for r in state["rows"]], [float(r) for r in state["rewards"]],
                   int(state["reward_errors"]), int(state["reward_timeouts"]),
                   {str(k): float(v) for k, v in state["stats"].items()})


def _mix(*parts: int | str) -> int:
    # a seed from several numbers that is the same in every process (Python's hash() is salted per process)
    digest = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % SEED_MODULUS


def draw_seed(seed: int, batch_index: int, rank: int, round_: int) -> int:
    """Seed of the draw of round ``round_``'s extra prompts for batch ``batch_index`` on ``rank``."""
    return _mix("dynamic-prompts", seed, batch_index, rank, round_)


def sampling_seed(seed: int, batch_index: int, rank: int, round_: int) -> int:
    """Sampling seed of round ``round_``: round 0 is the batch's ordinary ``rollout_seed``; later rounds get seeds of
    their own, distinct from every batch's."""
    return rollout_seed(seed, batch_index, rank) if round_ == 0 else _mix("dynamic-sampling", seed, batch_index, rank,
                                                                           round_)


def draw_rows(num_rows: int, tried: set[int], count: int, seed: int) -> list[int]:
    """``count`` dataset rows not in ``tried``, in the order of a permutation seeded by ``seed`` (fewer when fewer
    are left)."""
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return [r for r in order if r not in tried][:count]


def has_spread(rewards: list[float]) -> bool:
    """Whether a group's rewards differ (eq. 8's ``sigma != 0``, compared exactly as ``zero_variance_mask`` does)."""
    return max(rewards) != min(rewards)


def form_batch(options: DynamicSampling, needed: int, first_rows: list[int], num_rows: int, seed: int,
               batch_index: int, rank: int, sample: Callable[[list[int], int], Rollouts],
               score: Callable[[list[int], list[list[Completion]]], Scored]) -> tuple[Rollouts, Formed | None]:
    """One rank's batch of ``needed`` groups by dynamic sampling.

    Round 0 samples ``first_rows`` (the batch's own prompts) and, with ``oversample`` > 1, further drawn rows; each
    later round draws ``ceil(oversample * missing)`` rows not tried yet. ``sample(rows, seed)`` generates the groups,
    ``score(rows, groups)`` rewards them; groups with a spread are kept in the order generated, the first ``needed``
    of them form the batch. Short after ``max_rounds`` rounds (or with every row tried): ``pad`` fills the batch with
    the zero-variance groups in the order generated, ``error`` raises ``DynamicSamplingError``. Returns the kept groups
    and their ``Formed`` record; a failed request ends the batch as that error (``Rollouts.error``, no record), for the
    ranks to stop together. No collective: it may run on the producer's thread.
    """
    kept: list[tuple[int, list[Completion], list[float]]] = []
    flat: list[tuple[int, list[Completion], list[float]]] = []  # zero-variance groups, in order
    tried = set(first_rows)
    errors = timeouts = generated = rounds = 0
    for round_ in range(options.max_rounds):
        missing = needed - len(kept)
        count = math.ceil(options.oversample * missing)
        if round_ == 0:
            extra = count - len(first_rows)
            rows = list(first_rows) + (draw_rows(num_rows, tried, extra, draw_seed(seed, batch_index, rank, 0))
                                       if extra > 0 else [])
        else:
            rows = draw_rows(num_rows, tried, count, draw_seed(seed, batch_index, rank, round_))
        if not rows:
            break  # every row of the dataset was tried in this batch
        tried.update(rows)
        rollouts = sample(rows, sampling_seed(seed, batch_index, rank, round_))
        if rollouts.error is not None:
            return Rollouts(None, rollouts.error), None
        groups = rollouts.groups
        scored = score(rows, groups)
        errors, timeouts, rounds, generated = errors + scored.errors, timeouts + scored.timeouts, rounds + 1, \
            generated + len(groups)
        size = len(groups[0])
        for i, (row, group) in enumerate(zip(rows, groups)):
            rewards = scored.rewards[i * size:(i + 1) * size]
            (kept if has_spread(rewards) else flat).append((row, group, rewards))
        if len(kept) >= needed:
            break
    short = max(needed - len(kept), 0)
    if short and options.at_cap == "error":
        raise DynamicSamplingError(
            f"dynamic sampling found {len(kept)} of {needed} groups with a reward spread for batch {batch_index} "
            f"on rank {rank} in {rounds} round(s) (dynamic_sampling.max_rounds={options.max_rounds}); raise "
            "max_rounds or oversample, or set at_cap: pad")
    surplus = max(len(kept) - needed, 0)
    chosen = kept[:needed] + flat[:short]
    stats = {"dynamic_rounds": float(rounds), "dynamic_generated_groups": float(generated),
             "dropped_groups": float(len(flat) - short), "dynamic_surplus_groups": float(surplus),
             "dynamic_padded_groups": float(short), "dynamic_generated_per_kept": generated / needed}
    formed = Formed([row for row, _, _ in chosen], [r for _, _, rewards in chosen for r in rewards], errors,
                    timeouts, stats)
    return Rollouts([group for _, group, _ in chosen]), formed
