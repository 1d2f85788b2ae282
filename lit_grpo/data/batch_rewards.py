"""The rewards of a rollout batch (Algorithm 1, line 11): the data module's reward functions, chosen and weighed
when it is built, and each completion's reward: the reward functions' score of its text (a trajectory's last model
turn), plus its environment's reward, plus DAPO's soft overlong penalty (eq. 13) when it is on. The rewards are flat
and prompt-major, as ``collate_rollouts`` whitens them into eq. 2's advantages.

Where the prompt opened a reasoning model's thought (``lit_grpo.data.thinking``), a completion's text is judged after
that ``<think>``, and a single-turn completion whose thought never ends is flagged truncated before the penalty.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lit_grpo.data.dynamic_sampling import OverlongPenalty, Scored
from lit_grpo.data.rewards import RewardFn, RewardRunner, reward_name
from lit_grpo.data.tasks import check_environment_rewards
from lit_grpo.data.thinking import judged_text, unfinished_thought
from lit_grpo.engines.base import Completion
from lit_grpo.math.overlong import soft_overlong_penalty


@dataclass(frozen=True)
class BatchScores:
    """What the sampled-completions table shows of a rollout batch's scoring besides its rewards: each prompt's
    gold answer and each reward function's unweighted score of each completion (flat, prompt-major; empty when the
    batch was formed over several rounds)."""

    batch_index: int
    answers: list[str]
    per_function: dict[str, list[float]]


def batch_reward_runner(rewards: list[str | RewardFn] | None, reward_weights: list[float] | None, timeout_s: float,
                        environment: str | Callable[[dict], Any] | None, add_to_environment: bool) -> RewardRunner:
    """The data module's weighted reward functions (``data.rewards``, ``data.reward_weights``). An environment's
    reward is the trajectory's: rewards beside it add to it only when asked for (a base config's ``[correctness]``
    would make a right reasoning-gym answer score 2); tools alone keep ``correctness``, the default."""
    default_rewards = [] if environment is not None else ["correctness"]
    specs = list(rewards) if rewards is not None else default_rewards
    names = [reward_name(s) if isinstance(s, str) or callable(s) else s for s in specs]
    check_environment_rewards(names, environment, add_to_environment)
    if reward_weights is not None and len(reward_weights) != len(specs):
        raise ValueError(f"reward_weights has {len(reward_weights)} entries for {len(specs)} rewards {names}")
    weights = reward_weights or [1.0] * len(specs)
    return RewardRunner(list(zip(specs, weights)), timeout_s=timeout_s, allow_empty=environment is not None)


def overlong_penalties(groups: list[list[Completion]], option: OverlongPenalty,
                       max_new_tokens: int) -> torch.Tensor | None:
    """DAPO eq. 13 per completion (``data.overlong_penalty``), ``None`` when it is off. A truncated completion counts
    as ``max_new_tokens`` long: one whose thought never ended (:func:`flag_unfinished_thoughts`) is penalised as one
    cut at the limit, which a truncated one is."""
    if not option.enabled:
        return None
    lengths = torch.tensor([max_new_tokens if c.truncated else len(c.token_ids) for g in groups for c in g])
    return soft_overlong_penalty(lengths, max_new_tokens, option.buffer, option.factor)


def flag_unfinished_thoughts(completions: list[Completion], texts: list[str | None], opened_thought: bool) -> int:
    """Flag as truncated, in place, each single-turn completion whose thought never ends (``texts``: their decoded
    text, ``None`` for a multi-turn trajectory, left as it is; :func:`lit_grpo.data.thinking.unfinished_thought`): it
    stopped before its answer, so ``model.mask_truncated_completions`` leaves it out as one cut at
    ``max_new_tokens``. Returns how many it flagged."""
    flagged = 0
    for c, text in zip(completions, texts):
        if text is not None and not c.truncated and unfinished_thought(text, opened_thought):
            c.truncated, flagged = True, flagged + 1
    return flagged


def score_completions(runner: RewardRunner, completions: list[Completion], answers: list[str], tokenizer: Any,
                      penalties: Callable[[], torch.Tensor | None] | None = None,
                      opened_thought: bool = False) -> Scored:
    """The rewards of ``completions`` (flat, prompt-major; ``answers``: one each): the reward functions' score of
    the text (a trajectory's final text; a completion's after the ``<think>`` its prompt opened, ``opened_thought``),
    plus a trajectory's environment reward, plus the overlong ``penalties``, asked for once unfinished thoughts are
    flagged truncated (:func:`flag_unfinished_thoughts`)."""
    decoded = [None if c.trajectory is not None else tokenizer.decode(c.token_ids, skip_special_tokens=True)
               for c in completions]
    flag_unfinished_thoughts(completions, decoded, opened_thought)
    texts = [c.trajectory["final_text"] if text is None else judged_text(text, opened_thought)
             for c, text in zip(completions, decoded)]
    scored = runner(texts, answers)
    rewards = [r + (c.trajectory["env_reward"] if c.trajectory is not None else 0.0)
               for r, c in zip(scored.rewards, completions)]
    penalty = penalties() if penalties is not None else None
    if penalty is not None:
        rewards = [r + p for r, p in zip(rewards, penalty.tolist())]
    return Scored(rewards, scored.errors, scored.timeouts, scored.per_function)
