"""The rows a run's tasks come from (``data.dataset``): GSM8K's format for single-turn runs, plain dicts for an
environment, and procedurally generated tasks.

- Single-turn (no ``data.environment``): GSM8K rows ``{question, answer, gold}``, checked
  (:func:`lit_grpo.data.gsm8k.load_gsm8k`: the bundled copy, a file, a directory, a Hub id, ``synthetic:<task>``).
- With ``data.environment``: each row is handed to the environment's factory as it is, any fields (a file, a
  directory, a Hub id; ``synthetic:<task>`` rows too); only that each is a mapping is checked.
- ``reasoning_gym:<task>``: tasks from the ``reasoning-gym`` package, whose own environment and scorer come with them
  (:mod:`lit_grpo.environments.reasoning_gym`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lit_grpo.data.gsm8k import SPLITS, load_gsm8k, read_rows

REASONING_GYM = "reasoning_gym:"


def load_task_rows(source: str, split: str = "train", environment: bool = False) -> list[dict[str, Any]]:
    """The rows of ``source``'s ``split``: checked GSM8K rows, or with an ``environment`` the rows as dicts."""
    if isinstance(source, str) and source.startswith(REASONING_GYM):
        from lit_grpo.environments.reasoning_gym import load_rows

        return load_rows(source, split)
    if not environment or source == "bundled" or source.startswith("synthetic:"):
        return load_gsm8k(source, split)
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: expected one of {', '.join(repr(s) for s in SPLITS)}")
    rows, described = read_rows(source, split)
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
