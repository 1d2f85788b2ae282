"""Rollout batches built by hand (chosen rewards, random tokens) and one update's loss and gradients.

Tests that need a group with reward spread next to one without cannot rely on a random model's samples; these
batches need no engine, and the loss loop is the one ``GRPOModule.training_step`` runs for its first iteration.
"""

from __future__ import annotations

import torch

from lit_grpo.core.batch import RolloutBatch
from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.math import group_advantages, grpo_loss, zero_variance_mask


def handmade_batch(rewards: list[list[float]], vocab_size: int, micro_batch_size: int = 4, seed: int = 0,
                   prompt_len: int = 6, completion_len: int = 5) -> RolloutBatch:
    """One group per row of ``rewards`` (G = its length): left-padded prompts and right-padded completions of
    random non-special tokens (ids from 4 up: 0-3 are the tiny tokenizer's specials), lengths varying by row."""
    gen = torch.Generator().manual_seed(seed)
    group_rewards = torch.tensor(rewards, dtype=torch.float32)
    num_groups, group_size = group_rewards.shape
    prompt_ids = torch.randint(4, vocab_size, (num_groups, prompt_len), generator=gen)
    prompt_mask = torch.ones(num_groups, prompt_len, dtype=torch.long)
    for g in range(num_groups):
        prompt_mask[g, : g % 3] = 0  # left padding
    prompt_ids = prompt_ids * prompt_mask
    s = num_groups * group_size
    completion_ids = torch.randint(4, vocab_size, (s, completion_len), generator=gen)
    lengths = torch.randint(1, completion_len + 1, (s,), generator=gen)
    lengths[0] = completion_len  # the batch uses its full width
    completion_mask = (torch.arange(completion_len) < lengths.unsqueeze(1)).long()
    completion_ids = completion_ids * completion_mask
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        group_index=torch.arange(num_groups).repeat_interleave(group_size),
        completion_ids=completion_ids, completion_mask=completion_mask,
        rewards=group_rewards.flatten(), advantages=group_advantages(group_rewards).flatten(),
        group_mask=zero_variance_mask(group_rewards).repeat_interleave(group_size),
        truncated=torch.zeros(s, dtype=torch.bool), group_size=group_size, micro_batch_size=micro_batch_size,
    )


def select_groups(batch: RolloutBatch, groups: list[int]) -> tuple[RolloutBatch, torch.Tensor]:
    """The sub-batch of the given groups (renumbered from 0), and the parent's rows it holds."""
    rows = torch.cat([(batch.group_index == g).nonzero().flatten() for g in groups])
    remap = {g: i for i, g in enumerate(groups)}
    sub = RolloutBatch(
        prompt_ids=batch.prompt_ids[groups], prompt_mask=batch.prompt_mask[groups],
        group_index=torch.tensor([remap[int(g)] for g in batch.group_index[rows]]),
        completion_ids=batch.completion_ids[rows], completion_mask=batch.completion_mask[rows],
        rewards=batch.rewards[rows], advantages=batch.advantages[rows], group_mask=batch.group_mask[rows],
        truncated=batch.truncated[rows], group_size=batch.group_size, micro_batch_size=batch.micro_batch_size,
    )
    return sub, rows


def loss_and_grads(module, batch: RolloutBatch, weights: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and policy gradients of the first iteration of a training step (alpha = pi_k: the engine in sync)."""
    module.policy.zero_grad(set_to_none=True)
    micro_batches = list(batch.micro_batches())
    ref_logps = module.reference_logprobs(batch, micro_batches)
    total = 0.0
    for j, mb in enumerate(micro_batches):
        logp, _ = completion_logprobs(module.policy, mb, module.hparams.temperature)
        loss, _ = grpo_loss(logp, logp.detach(), mb.take(batch.advantages), mb.take(weights), mb.completion_mask,
                            module.loss_config, pik_logp=logp.detach(), ref_logp=ref_logps[j])
        loss.backward()
        total += float(loss.detach())
    grads = {name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
             for name, p in module.policy.named_parameters()}
    module.policy.zero_grad(set_to_none=True)
    return total, grads


def perturb(model: torch.nn.Module, scale: float = 0.05, seed: int = 1) -> None:
    """Move every parameter by seeded noise: a reference that differs from the policy (KL > 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
