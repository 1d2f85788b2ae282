"""The environment errors of multi-turn rollouts, as the data module counts them (``rollout/env_errors``): a
trajectory whose environment raised or answered out of shape ends there with the rewards it had, the first such
failure is warned about once, and a first batch on which every trajectory failed so stops the run in one line
(:class:`EnvironmentFailure`): it would train on nothing but failures.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.data.multi_turn import row_name
from lit_grpo.engines.base import Completion
from lit_grpo.environments.protocol import EnvironmentFault


class EnvironmentFailure(EnvironmentFault):
    """Every trajectory of the first batch ended in an environment error: the run stops in one line naming the
    environment, the first failing row and its error."""


def trajectory_tasks(completions: list[Completion],
                     rows: list[dict[str, Any]] | None = None) -> list[tuple[dict[str, Any], dict[str, Any] | None]]:
    """Each multi-turn completion's trajectory record with its task row (``rows``: one per completion, or none);
    single-turn completions have no record and are left out."""
    return [(c.trajectory, row) for c, row in zip(completions, rows or [None] * len(completions))
            if c.trajectory is not None]


def new_environment_errors(tasks: list[tuple[dict[str, Any], dict[str, Any] | None]], environment_name: str,
                           first_batch: bool, counted: int) -> int:
    """How many of ``tasks`` (from :func:`trajectory_tasks`) ended in an environment error. Warns on the first error
    of the run (``counted``: the errors counted before), and raises :class:`EnvironmentFailure` when every
    trajectory of the ``first_batch`` failed, naming ``environment_name`` and the first failing task."""
    failed = [(r["env_error"], row) for r, row in tasks if r["env_error"] is not None]
    errors = [error for error, _ in failed]
    if first_batch and errors and len(errors) == len(tasks):
        task = f" on the task {row_name(failed[0][1])}" if failed[0][1] is not None else ""
        raise EnvironmentFailure(f"the environment {environment_name} failed on all {len(tasks)} trajectories of the "
                                 f"first batch (the first{task}: {errors[0]}); expected reset() -> str | list[dict] "
                                 f"and step(completion) -> (reply, reward, done)")
    if errors and counted == 0:
        rank_zero_warn(f"an environment failed ({errors[0]}): its trajectory ends there with the rewards it had; "
                       f"counted in rollout/env_errors (further failures are counted, not warned)")
    return len(errors)
