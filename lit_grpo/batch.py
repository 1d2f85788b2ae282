"""`RolloutBatch`: everything the loss needs for one rollout batch, and its micro-batch views.

Layout: each distinct prompt is stored once (left-padded, ``prompt_ids [num_prompts, P]``); its G completions
are right-padded rows of ``completion_ids [num_prompts * G, C]`` and ``group_index`` maps a completion to its
prompt. Scoring reuses one prompt forward for all completions that share it (see ``lit_grpo.scoring``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch


@dataclass
class MicroBatch:
    """A contiguous slice of completions with the distinct prompts they need, trimmed of padding."""

    prompt_ids: torch.Tensor  # [u, P'] left-padded
    prompt_mask: torch.Tensor  # [u, P']
    prompt_index: torch.Tensor  # [s] row of prompt_ids for each completion
    completion_ids: torch.Tensor  # [s, C'] right-padded
    completion_mask: torch.Tensor  # [s, C']
    rows: slice  # rows of the parent batch

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parent batch's per-token ``[S, C]`` (or per-sequence ``[S]``) tensor restricted to this slice."""
        part = tensor[self.rows]
        return part[:, : self.completion_ids.shape[1]] if part.dim() == 2 else part


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [num_prompts, P] left-padded
    prompt_mask: torch.Tensor  # [num_prompts, P]
    group_index: torch.Tensor  # [S] long
    completion_ids: torch.Tensor  # [S, C] right-padded
    completion_mask: torch.Tensor  # [S, C]
    rewards: torch.Tensor  # [S]
    advantages: torch.Tensor  # [S]
    group_mask: torch.Tensor  # [S]: 1 where the completion's group has non-zero reward variance (eq. 8)
    truncated: torch.Tensor  # [S] bool: hit max_new_tokens without an end-of-sequence token
    alpha_logp: torch.Tensor | None = None  # [S, C] log alpha(y_t | ...); None: alpha is pi_k (engine in sync)
    sampler_logp: torch.Tensor | None = None  # [S, C] as reported by the engine while sampling
    group_size: int = 1
    micro_batch_size: int = 8
    batch_index: int = 0  # position in the prompt stream (for resume)
    rollout_step: int = 0  # optimizer step whose policy weights the engine held when sampling
    advantage_eps: float = 1e-4  # how the advantages were whitened (eq. 2), for losses that recompute them
    scale_rewards: bool = True
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return int(self.completion_ids.shape[0])

    def micro_batches(self) -> Iterator[MicroBatch]:
        """Slices of ``micro_batch_size`` completions, in order; the same slicing everywhere keeps scoring by
        the rollout engine and by the policy bit-for-bit comparable."""
        for start in range(0, self.num_sequences, self.micro_batch_size):
            rows = slice(start, min(start + self.micro_batch_size, self.num_sequences))
            groups = self.group_index[rows]
            unique, inverse = torch.unique(groups, sorted=True, return_inverse=True)
            p_mask = self.prompt_mask[unique]
            keep_from = int((p_mask.sum(0) > 0).nonzero().min()) if p_mask.any() else 0
            c_mask = self.completion_mask[rows]
            # at least two columns when the batch has them: scoring then always makes the same two forwards,
            # which sharded (FSDP) ranks must make together; a padded column is masked and changes no number
            width = max(int(c_mask.sum(1).max()), min(2, self.completion_ids.shape[1]))
            yield MicroBatch(
                prompt_ids=self.prompt_ids[unique][:, keep_from:],
                prompt_mask=p_mask[:, keep_from:],
                prompt_index=inverse,
                completion_ids=self.completion_ids[rows][:, :width],
                completion_mask=c_mask[:, :width],
                rows=rows,
            )
