"""What ``RolloutDataModule`` refuses when it is built, before any model loads or prompt is sampled: the numbers that
shape a rollout batch, the first-push check's settings, and an overlong penalty that cannot apply. Each refusal is
one line naming the option, the value and what was expected. The engine's options are checked in
``lit_grpo.data.engine_setup``; what needs the LightningModule and the trainer, when the fit starts, in
``lit_grpo.data.fit_checks``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line runs these checks before the training stack loads: nothing heavy here
    from lit_grpo.data.dynamic_sampling import OverlongPenalty


def check_sampler_check_options(max_gap: float | None, sequences: int) -> None:
    """``sampler_check_max_gap`` (nats per token, or ``None`` for no check) and ``sampler_check_sequences``."""
    if max_gap is not None and (isinstance(max_gap, bool) or not max_gap > 0):
        raise ValueError(f"sampler_check_max_gap must be a number > 0 (nats per token) or null, got {max_gap!r}")
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise ValueError(f"sampler_check_sequences must be an integer >= 1, got {sequences!r}")


def check_batch_numbers(num_generations: int, prompts_per_step: int, micro_batch_size: int,
                        micro_batch_tokens: int | None, advantage_eps: float, max_prompts: int | None) -> None:
    """The sizes of a rollout batch and its micro-batches, eq. 2's epsilon and the prompts a run may use."""
    if num_generations < 2:
        raise ValueError(f"num_generations (G) must be >= 2 to form a group advantage, got {num_generations}")
    if prompts_per_step < 1:
        raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if micro_batch_tokens is not None and (isinstance(micro_batch_tokens, bool)
                                           or not isinstance(micro_batch_tokens, int) or micro_batch_tokens < 1):
        raise ValueError(f"micro_batch_tokens must be an integer >= 1 or None, got {micro_batch_tokens!r}")
    if advantage_eps <= 0:
        raise ValueError(f"advantage_eps must be > 0 (inside the square root of eq. 2), got {advantage_eps}")
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1 or None, got {max_prompts}")


def check_advantage_std(std: str) -> None:
    """How eq. 2's std is taken: the names of :data:`lit_grpo.math.advantages.ADVANTAGE_STDS`, spelled out here
    because this module must not import torch (a test holds the two equal)."""
    if std not in ("population", "bessel"):
        raise ValueError(f"advantage_std must be one of population, bessel, got {std!r}")


def check_overlong_penalty(option: OverlongPenalty, max_new_tokens: int, multi_turn: bool) -> None:
    """DAPO's overlong penalty scores one completion's length against ``max_new_tokens``: refused on multi-turn
    trajectories (``multi_turn``: an environment or tools are given), and with a buffer not below the limit."""
    if option.enabled and multi_turn:
        raise ValueError("overlong_penalty scores one completion's length against max_new_tokens; a multi-turn "
                         "trajectory (data.environment / data.tools) has several: turn it off, or cap "
                         "multi_turn.max_total_tokens")
    if option.buffer >= max_new_tokens:
        raise ValueError(f"overlong_penalty.buffer={option.buffer} must be below "
                         f"max_new_tokens={max_new_tokens} (the penalty's buffer lies inside the length limit)")
