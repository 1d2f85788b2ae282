"""Datasets and rule-based rewards."""

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
