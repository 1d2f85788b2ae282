"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
Scale", section 3.4, eq. 13): a length-aware penalty added to the reward of completions that run into the last
``buffer`` tokens before the generation limit."""

from __future__ import annotations

import torch


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13, scaled by ``factor``: with ``L_max = max_length`` and ``L_cache = buffer``,

    ``R_length(y) = 0``                                      if ``|y| <= L_max - L_cache``,
    ``R_length(y) = ((L_max - L_cache) - |y|) / L_cache``    if ``L_max - L_cache < |y| <= L_max``,
    ``R_length(y) = -1``                                     if ``|y| > L_max``;

    returned as ``factor * R_length(y)`` per completion (the value added to its reward; verl's
    ``overlong_buffer.penalty_factor`` is ``factor``). The middle branch falls linearly from 0 to -1 across the
    buffer, so the penalty is continuous at both edges. ``lengths`` holds the completions' token counts ``|y|`` (any
    shape); the result is float32 of the same shape.
    """
    if isinstance(buffer, bool) or not isinstance(buffer, int) or not 0 < buffer < max_length:
        raise ValueError(f"buffer (L_cache) must be an integer in (0, max_length={max_length}), got {buffer!r}")
    lengths = torch.as_tensor(lengths).to(torch.float32)
    expected = float(max_length - buffer)
    inside = (expected - lengths) / float(buffer)
    penalty = torch.where(lengths <= expected, torch.zeros_like(lengths),
                          torch.where(lengths <= max_length, inside, torch.full_like(lengths, -1.0)))
    return factor * penalty
