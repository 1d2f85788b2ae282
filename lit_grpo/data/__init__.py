"""The rollout data path: prompts and datasets (GSM8K bundled), rule-based rewards, the ``RolloutDataModule`` that
asks an engine for completions (in step or K batches ahead), scores and collates them, and the checks a fit runs on
its data. It imports ``core``, ``math``, ``models`` and the engines' contract; never training, the server or the
command line."""

from lit_grpo.data.gsm8k import load_gsm8k
from lit_grpo.data.rewards import (
    RewardRunner,
    correctness_reward,
    extract_final_answer,
    format_reward,
    resolve_reward,
)

__all__ = [
    "RewardRunner",
    "correctness_reward",
    "extract_final_answer",
    "format_reward",
    "load_gsm8k",
    "resolve_reward",
]
