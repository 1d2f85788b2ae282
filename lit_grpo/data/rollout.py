"""Assembling sampled completions and their rewards into a padded `RolloutBatch` with advantages."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from lit_grpo.batch import MicroBatch, RolloutBatch, micro_batch_views
from lit_grpo.engines.base import Completion
from lit_grpo.engines.transformers_engine import left_pad
from lit_grpo.math.advantages import group_advantages, zero_variance_mask


def rollout_seed(seed: int, batch_index: int, rank: int) -> int:
    """Sampling seed of one rank's rollouts for one batch: distinct per batch and per rank (rank 0 keeps the
    one-process seed)."""
    return seed * 1_000_003 + batch_index + rank * 1_000_000_007


@dataclass
class PaddedRollouts:
    """Completions in the ``RolloutBatch`` layout: each prompt once, left-padded; completions right-padded."""

    prompt_ids: torch.Tensor  # [num_prompts, P]
    prompt_mask: torch.Tensor
    group_index: torch.Tensor  # [S]
    completion_ids: torch.Tensor  # [S, C]
    completion_mask: torch.Tensor
    sampler_logp: torch.Tensor  # [S, C] float32

    def micro_batches(self, micro_batch_size: int) -> Iterator[MicroBatch]:
        return micro_batch_views(self.prompt_ids, self.prompt_mask, self.group_index, self.completion_ids,
                                 self.completion_mask, micro_batch_size)


def pad_rollouts(prompts: list[list[int]], groups: list[list[Completion]], pad_token_id: int,
                 device: torch.device | str = "cpu") -> PaddedRollouts:
    """Pad prompts (left) and completions (right). Every group must have the same size G."""
    group_size = len(groups[0])
    if any(len(g) != group_size for g in groups):
        raise ValueError("every prompt must have the same number of completions")
    flat = [c for g in groups for c in g]
    prompt_tensor, prompt_mask = left_pad(prompts, pad_token_id, torch.device(device))
    width = max(2, max(len(c.token_ids) for c in flat))  # two columns at least: see RolloutBatch.micro_batches
    completion_ids = torch.full((len(flat), width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(flat), width), dtype=torch.long)
    sampler_logp = torch.zeros((len(flat), width), dtype=torch.float32)
    for row, c in enumerate(flat):
        n = len(c.token_ids)
        completion_ids[row, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        completion_mask[row, :n] = 1
        sampler_logp[row, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    return PaddedRollouts(
        prompt_ids=prompt_tensor,
        prompt_mask=prompt_mask,
        group_index=torch.arange(len(groups), device=device).repeat_interleave(group_size),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        sampler_logp=sampler_logp.to(device),
    )


def collate_rollouts(
    prompts: list[list[int]],
    groups: list[list[Completion]],
    rewards: list[float],
    pad_token_id: int,
    micro_batch_size: int,
    advantage_eps: float = 1e-4,
    scale_rewards: bool = True,
    device: torch.device | str = "cpu",
) -> RolloutBatch:
    """Pad prompts (left) and completions (right), and compute eq. 2 advantages and the eq. 8 group mask.

    ``rewards`` is flat, in the order of ``groups`` (prompt-major). Every group must have the same size G.
    """
    padded = pad_rollouts(prompts, groups, pad_token_id, device)
    flat = [c for g in groups for c in g]
    group_size = len(groups[0])
    if len(rewards) != len(flat):
        raise ValueError(f"got {len(rewards)} rewards for {len(flat)} completions")
    reward_groups = torch.tensor(rewards, dtype=torch.float32).view(len(groups), group_size)
    advantages = group_advantages(reward_groups, eps=advantage_eps, scale=scale_rewards).view(-1)
    group_mask = zero_variance_mask(reward_groups).repeat_interleave(group_size)
    return RolloutBatch(
        prompt_ids=padded.prompt_ids,
        prompt_mask=padded.prompt_mask,
        group_index=padded.group_index,
        completion_ids=padded.completion_ids,
        completion_mask=padded.completion_mask,
        rewards=reward_groups.view(-1).to(device),
        advantages=advantages.to(device),
        group_mask=group_mask.to(device),
        truncated=torch.tensor([c.truncated for c in flat], dtype=torch.bool, device=device),
        sampler_logp=padded.sampler_logp,
        group_size=group_size,
        micro_batch_size=micro_batch_size,
        advantage_eps=advantage_eps,
        scale_rewards=scale_rewards,
    )


def rollout_stats(batch: RolloutBatch) -> dict[str, float]:
    """Reward and length statistics of a rollout batch (for logging)."""
    groups = batch.rewards.view(-1, batch.group_size)
    lengths = batch.completion_mask.sum(1).float()
    return {
        "reward_mean": float(batch.rewards.mean()),
        "reward_std": float(groups.std(dim=1, unbiased=False).mean()),
        "frac_zero_variance": float(1.0 - batch.group_mask.view(-1, batch.group_size)[:, 0].mean()),
        "completion_length": float(lengths.mean()),
        "truncation_rate": float(batch.truncated.float().mean()),
        "generated_tokens": float(lengths.sum()),
    }
