"""Sampled completions and their rewards as a padded `RolloutBatch` with advantages, built in one go."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from lit_grpo.core.batch import MicroBatch, RolloutBatch, left_pad, micro_batch_views
from lit_grpo.engines.base import Completion
from lit_grpo.math.advantages import group_advantages, zero_variance_mask


def rollout_seed(seed: int, batch_index: int, rank: int) -> int:
    """Sampling seed of one rank's rollouts for one batch: distinct per batch and per rank (rank 0 keeps the
    one-process seed)."""
    return seed * 1_000_003 + batch_index + rank * 1_000_000_007


@dataclass
class PaddedRollouts:
    """Completions in the ``RolloutBatch`` layout: each prompt once, left-padded; completions right-padded; cut into
    the padded layout's micro-batches (what an engine's ``score`` and the server's pi_ref scoring run over). Those
    are the trainer's unless ``model.packing`` feeds it packed rows: the values then agree with the trainer's own
    passes within float tolerance, not bit for bit (``RolloutBatch.micro_batches``)."""

    prompt_ids: torch.Tensor  # [num_prompts, P]
    prompt_mask: torch.Tensor
    group_index: torch.Tensor  # [S]
    completion_ids: torch.Tensor  # [S, C]
    completion_mask: torch.Tensor
    sampler_logp: torch.Tensor  # [S, C] float32
    truncated: torch.Tensor  # [S] bool
    group_size: int
    micro_batch_size: int
    #: [S, C] the model's tokens of multi-turn trajectories (``RolloutBatch.loss_mask``); None: single-turn
    loss_mask: torch.Tensor | None = None
    #: micro-batches cut by padded tokens (``RolloutBatch.micro_batch_tokens``); None: by ``micro_batch_size`` rows
    micro_batch_tokens: int | None = None

    def micro_batches(self) -> Iterator[MicroBatch]:
        return micro_batch_views(self.prompt_ids, self.prompt_mask, self.group_index, self.completion_ids,
                                 self.completion_mask, self.micro_batch_size, self.loss_mask, self.micro_batch_tokens)


def pad_rollouts(prompts: list[list[int]], groups: list[list[Completion]], pad_token_id: int, micro_batch_size: int,
                 device: torch.device | str = "cpu", micro_batch_tokens: int | None = None) -> PaddedRollouts:
    """Pad prompts (left) and completions (right). Every group must have the same size G. Multi-turn trajectories
    (``Completion.mask``) also get the loss mask of the model's tokens."""
    group_size = len(groups[0])
    if any(len(g) != group_size for g in groups):
        raise ValueError("every prompt must have the same number of completions")
    flat = [c for g in groups for c in g]
    prompt_tensor, prompt_mask = left_pad(prompts, pad_token_id, torch.device(device))
    width = max(2, max(len(c.token_ids) for c in flat))  # two columns at least: see RolloutBatch.micro_batches
    completion_ids = torch.full((len(flat), width), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((len(flat), width), dtype=torch.long)
    sampler_logp = torch.zeros((len(flat), width), dtype=torch.float32)
    multi_turn = any(c.mask is not None for c in flat)
    loss_mask = torch.zeros((len(flat), width), dtype=torch.long) if multi_turn else None
    for row, c in enumerate(flat):
        n = len(c.token_ids)
        completion_ids[row, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        completion_mask[row, :n] = 1
        sampler_logp[row, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
        if loss_mask is not None:
            loss_mask[row, :n] = torch.tensor(c.mask, dtype=torch.long) if c.mask is not None else 1
    return PaddedRollouts(
        prompt_ids=prompt_tensor,
        prompt_mask=prompt_mask,
        group_index=torch.arange(len(groups), device=device).repeat_interleave(group_size),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        sampler_logp=sampler_logp.to(device),
        truncated=torch.tensor([c.truncated for c in flat], dtype=torch.bool, device=device),
        group_size=group_size,
        micro_batch_size=micro_batch_size,
        loss_mask=None if loss_mask is None else loss_mask.to(device),
        micro_batch_tokens=micro_batch_tokens,
    )


@dataclass(frozen=True)
class BatchOrigin:
    """Where a batch comes from, beyond its completions: what ``RolloutBatch`` records next to the tensors."""

    batch_index: int = 0  # position in the prompt stream
    rollout_step: int = 0  # the weight version (optimizer step) that sampled it
    #: alpha's log-probs ``[S, C]``; ``None``: alpha is pi_k (the engine held the policy's current weights)
    alpha_logp: torch.Tensor | None = None
    alpha_source: str = "policy"  # RolloutBatch.alpha_source: policy, recompute or sampler
    #: pi_ref's log-probs ``[S, C]`` from the rollout server and pi_ref's version (``data.reference_on_server``)
    reference: tuple[torch.Tensor, str] | None = None
    reference_offloaded: bool = False  # the data module asks the server for pi_ref's log-probs (every rank alike)
    stats: dict[str, float] = field(default_factory=dict)  # the rollout's timings and counters, logged after its own


def collate_rollouts(padded: PaddedRollouts, rewards: list[float], advantage_eps: float = 1e-4,
                     scale_rewards: bool = True, origin: BatchOrigin = BatchOrigin(),  # noqa: B008
                     advantage_std: str = "population") -> RolloutBatch:
    """The complete ``RolloutBatch`` of padded completions: eq. 2 advantages and the eq. 8 group mask from
    ``rewards`` (flat, in the completions' prompt-major order), the batch's ``origin``, and its statistics."""
    group_size = padded.group_size
    num_groups = padded.completion_ids.shape[0] // group_size
    if len(rewards) != padded.completion_ids.shape[0]:
        raise ValueError(f"got {len(rewards)} rewards for {padded.completion_ids.shape[0]} completions")
    device = padded.completion_ids.device
    reward_groups = torch.tensor(rewards, dtype=torch.float32).view(num_groups, group_size)
    advantages = group_advantages(reward_groups, eps=advantage_eps, scale=scale_rewards, std=advantage_std).view(-1)
    group_mask = zero_variance_mask(reward_groups).repeat_interleave(group_size).to(device)
    flat_rewards = reward_groups.view(-1).to(device)
    reference_logp, reference_version = (None, None) if origin.reference is None else origin.reference
    return RolloutBatch(
        prompt_ids=padded.prompt_ids,
        prompt_mask=padded.prompt_mask,
        group_index=padded.group_index,
        completion_ids=padded.completion_ids,
        completion_mask=padded.completion_mask,
        rewards=flat_rewards,
        advantages=advantages.to(device),
        group_mask=group_mask,
        truncated=padded.truncated,
        alpha_logp=origin.alpha_logp,
        alpha_source=origin.alpha_source,
        sampler_logp=padded.sampler_logp,
        reference_logp=reference_logp.to(device) if reference_logp is not None else None,
        reference_version=reference_version,
        reference_offloaded=origin.reference_offloaded,
        group_size=group_size,
        micro_batch_size=padded.micro_batch_size,
        micro_batch_tokens=padded.micro_batch_tokens,
        batch_index=origin.batch_index,
        rollout_step=origin.rollout_step,
        advantage_eps=advantage_eps,
        scale_rewards=scale_rewards,
        advantage_std=advantage_std,
        stats={**rollout_stats(flat_rewards, group_mask,
                               padded.completion_mask if padded.loss_mask is None else padded.loss_mask,
                               padded.truncated, group_size),
               **origin.stats},
        loss_mask=padded.loss_mask,
    )


def rollout_stats(rewards: torch.Tensor, group_mask: torch.Tensor, completion_mask: torch.Tensor,
                  truncated: torch.Tensor, group_size: int) -> dict[str, float]:
    """Reward and length statistics of a rollout batch (for logging); ``completion_mask`` is the model's tokens
    (in multi-turn trajectories, lengths count only those)."""
    groups = rewards.view(-1, group_size)
    lengths = completion_mask.sum(1).float()
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(groups.std(dim=1, unbiased=False).mean()),
        "frac_zero_variance": float(1.0 - group_mask.view(-1, group_size)[:, 0].mean()),
        "completion_length": float(lengths.mean()),
        "truncation_rate": float(truncated.float().mean()),
        "generated_tokens": float(lengths.sum()),
    }
