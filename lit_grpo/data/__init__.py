"""The rollout data path: prompts and datasets (GSM8K bundled), rule-based rewards, the ``RolloutDataModule`` that
asks an engine for completions (in step or K batches ahead), scores and collates them, and the checks a fit runs on
its data. It imports ``core``, ``math``, ``models`` and the engines' contract; never training, the server or the
command line."""

from __future__ import annotations

import importlib
from typing import Any

# Imported on first use: the command line imports ``lit_grpo.data.option_checks`` to refuse a bad number before
# anything heavy loads, and the rewards import math-verify and sympy.
_EXPORTS = {"load_gsm8k": "lit_grpo.data.gsm8k", "RewardRunner": "lit_grpo.data.rewards",
            "correctness_reward": "lit_grpo.data.rewards", "extract_final_answer": "lit_grpo.data.rewards",
            "format_reward": "lit_grpo.data.rewards", "math_verify_reward": "lit_grpo.data.rewards",
            "resolve_reward": "lit_grpo.data.rewards"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
