"""The rows a run's tasks come from (``data.dataset``): GSM8K's format for single-turn runs, plain dicts for an
environment, and procedurally generated tasks.

- Single-turn (no ``data.environment``): GSM8K rows ``{question, answer, gold}``, checked
  (:func:`lit_grpo.data.gsm8k.load_gsm8k`: the bundled copy, a file, a directory, a Hub id, ``synthetic:<task>``).
- With ``data.environment``: each row is handed to the environment's factory as it is, any fields (a file, a
  directory, a Hub id; ``synthetic:<task>`` rows too); only that each is a mapping is checked.
- ``reasoning_gym:<task>``: tasks from the ``reasoning-gym`` package, whose own environment, scorer and system prompt
  come with them (:mod:`lit_grpo.environments.reasoning_gym`).

An environment's reward is the trajectory's: ``data.rewards`` beside it would add to it (a right reasoning-gym answer
would score 1 + a GSM8K reward's 1), so they are refused unless ``data.add_rewards_to_environment`` asks for the sum
(:func:`check_environment_rewards`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lit_grpo.data.gsm8k import SPLITS, load_gsm8k, read_rows
from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT

REASONING_GYM = "reasoning_gym:"


def load_task_rows(source: str, split: str = "train", environment: bool = False, config: str | None = None,
                   numeric_gold: bool = True) -> list[dict[str, Any]]:
    """The rows of ``source``'s ``split``: checked GSM8K rows, or with an ``environment`` the rows as dicts.
    ``config``: a Hub dataset's config (``None``: its default); ``numeric_gold``: as
    :func:`lit_grpo.data.gsm8k.validate_rows` takes it."""
    if isinstance(source, str) and source.startswith(REASONING_GYM):
        from lit_grpo.environments.reasoning_gym import load_rows

        return load_rows(source, split)
    if not environment or source == "bundled" or source.startswith("synthetic:"):
        return load_gsm8k(source, split, config, numeric_gold)
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(repr(s) for s in SPLITS)}")
    rows, described = read_rows(source, split, config)
    for index, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{described}: row {index} is a {type(row).__name__}; an environment's task rows must be "
                             f"mappings (dicts), handed to data.environment's factory")
    if not rows:
        raise ValueError(f"{described}: no rows")
    return [dict(row) for row in rows]


def default_environment(source: str) -> str | None:
    """The environment that comes with a dataset (``reasoning_gym:<task>``: its single-turn scorer), or None."""
    if isinstance(source, str) and source.startswith(REASONING_GYM):
        return "lit_grpo.environments.reasoning_gym:ReasoningGymEnvironment"
    return None


def system_prompt_for(source: str, system_prompt: str | None) -> str | None:
    """The system prompt a run of ``source`` samples with: for ``reasoning_gym:<task>``, reasoning-gym's own prompt
    (:func:`lit_grpo.environments.reasoning_gym.system_prompt`) when ``system_prompt`` is GSM8K's default, the value
    ``data.system_prompt`` has when left unset (its ``#### <answer>`` format contradicts the ``<answer>`` tags the
    task's scorer reads); any other value, ``None`` (no system message) included, as given."""
    if isinstance(source, str) and source.startswith(REASONING_GYM) and system_prompt == DEFAULT_SYSTEM_PROMPT:
        from lit_grpo.environments.reasoning_gym import system_prompt as task_prompt

        return task_prompt()
    return system_prompt


def check_environment_rewards(rewards: list[str] | None, environment: str | Callable[..., Any] | None,
                              add: bool) -> None:
    """Refuse reward functions beside an environment unless ``add`` asks for their sum: the environment's reward
    (a reasoning-gym task's score, in [0, 1]) is the trajectory's, and ``data.rewards`` (a base config's
    ``[correctness]``, say) would add to it silently, so that a right answer scores 2. ``rewards`` are the reward
    names (``None`` or empty: none given); ``environment`` is ``data.environment`` (``None``: there is none)."""
    if environment is None or not rewards or add:
        return
    name = environment if isinstance(environment, str) else getattr(environment, "__qualname__",
                                                                     type(environment).__name__)
    raise ValueError(f"data.rewards {list(rewards)} would add to the reward of data.environment {name} (its "
                     f"reward is the trajectory's; a right answer would score more than its 1); expected "
                     f"data.rewards: [] to score with the environment alone, or data.add_rewards_to_environment: "
                     f"true to add them on purpose")
