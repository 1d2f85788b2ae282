"""A benchmark reward that gives every group a spread of rewards whatever the policy's weights.

``coin`` scores a completion 0.0 or 1.0 from a checksum of its text: deterministic (the same text always gets the
same score), unrelated to the answer, and about half of any group of distinct completions scores 1. A timing run
with a model that cannot solve the task (a random-init model, or a small one on hard prompts) would otherwise see
all-zero rewards, zero advantages and an update whose loss has no policy-gradient term; with this reward the update
does the work it does in real training. It measures nothing about the model.

    python benchmarks/step_time.py --reward benchmarks.coin_reward:coin ...
"""

from __future__ import annotations

import zlib


def coin(completion: str, answer: str, **kwargs: object) -> float:
    """0.0 or 1.0 from the CRC-32 of the completion's text (``answer`` is ignored)."""
    return float(zlib.crc32(completion.encode()) % 2)
