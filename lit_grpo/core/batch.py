"""`RolloutBatch`: everything the loss needs for one rollout batch, and its micro-batch views.

Layout: each distinct prompt is stored once (left-padded, ``prompt_ids [num_prompts, P]``); its G completions
are right-padded rows of ``completion_ids [num_prompts * G, C]`` and ``group_index`` maps a completion to its
prompt. Scoring reuses one prompt forward for all completions that share it (see ``lit_grpo.core.scoring``).

A multi-turn trajectory is one such row: after the prompt, the model's tokens exactly as sampled, then the
environment's tokens, and so on. ``completion_mask`` marks every real token (what attention sees); ``loss_mask``
marks the model's tokens only (what the loss and every statistic count). Single-turn batches have no ``loss_mask``:
the two are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from lit_grpo.core.micro_batch_plan import plan_by_tokens, split_into


@dataclass
class MicroBatch:
    """A contiguous slice of completions with the distinct prompts they need, trimmed of padding."""

    prompt_ids: torch.Tensor  # [u, P'] left-padded
    prompt_mask: torch.Tensor  # [u, P']
    prompt_index: torch.Tensor  # [s] row of prompt_ids for each completion
    completion_ids: torch.Tensor  # [s, C'] right-padded
    completion_mask: torch.Tensor  # [s, C'] every real token (attention)
    rows: slice | torch.Tensor  # rows of the parent batch: a slice, or their indices (token-budget micro-batches)
    #: [s, C'] the model's own tokens (the loss's mask): ``completion_mask`` except in multi-turn trajectories, where
    #: the environment's tokens are context with mask 0
    loss_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = self.completion_mask

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The parent batch's per-token ``[S, C]`` (or per-sequence ``[S]``) tensor restricted to this slice."""
        part = tensor[self.rows]
        return part[:, : self.completion_ids.shape[1]] if part.dim() == 2 else part


@dataclass(frozen=True)
class RolloutBatch:
    """One rank's rollout batch, built complete by the data module (``lit_grpo.data.rollout.collate_rollouts``) and
    not changed afterwards (a loss that reshapes it makes a new one with ``dataclasses.replace``)."""

    prompt_ids: torch.Tensor  # [num_prompts, P] left-padded
    prompt_mask: torch.Tensor  # [num_prompts, P]
    group_index: torch.Tensor  # [S] long
    completion_ids: torch.Tensor  # [S, C] right-padded
    completion_mask: torch.Tensor  # [S, C] every real token (attention)
    rewards: torch.Tensor  # [S]
    advantages: torch.Tensor  # [S]
    group_mask: torch.Tensor  # [S]: 1 where the completion's group has non-zero reward variance (eq. 8)
    truncated: torch.Tensor  # [S] bool: hit max_new_tokens without an end-of-sequence token
    alpha_logp: torch.Tensor | None = None  # [S, C] log alpha(y_t | ...); None: alpha is pi_k (engine in sync)
    sampler_logp: torch.Tensor | None = None  # [S, C] as reported by the engine while sampling (mu)
    #: what ``alpha_logp`` is: ``"policy"`` (None: alpha is pi_k), ``"recompute"`` (the rollout weights scored in
    #: the trainer's numerics, by the in-process engine or a kept copy of the pushed weights) or ``"sampler"``
    #: (``sampler_logp`` itself: no one could score those weights again)
    alpha_source: str = "policy"
    #: [S, C] log pi_ref(y_t | ...) computed by the rollout server (``data.reference_on_server``), and the version
    #: of pi_ref it used (the trainer's ``reference_version`` when it was pushed); None: the trainer computes them
    reference_logp: torch.Tensor | None = None
    reference_version: str | None = None
    #: the data module asks the rollout server for pi_ref's log-probs (on every rank alike), whether or not this
    #: batch got them: the ranks then agree on whose numbers to use
    reference_offloaded: bool = False
    group_size: int = 1
    micro_batch_size: int = 8
    #: micro-batches cut by padded tokens instead of rows (``lit_grpo.core.micro_batch_plan``); None: by rows
    micro_batch_tokens: int | None = None
    batch_index: int = 0  # position in the prompt stream (for resume)
    rollout_step: int = 0  # optimizer step whose policy weights the engine held when sampling
    advantage_eps: float = 1e-4  # how the advantages were whitened (eq. 2), for losses that recompute them
    scale_rewards: bool = True
    advantage_std: str = "population"  # eq. 2's population std, or TRL's Bessel-corrected one (group_advantages)
    stats: dict[str, float] = field(default_factory=dict)
    #: [S, C] the model's own tokens in multi-turn trajectories (the environment's tokens are 0); None: single-turn,
    #: every completion token is the model's (``token_mask`` is the one to read)
    loss_mask: torch.Tensor | None = None

    @property
    def token_mask(self) -> torch.Tensor:
        """``[S, C]`` the tokens the loss and the statistics count: the model's own."""
        return self.completion_mask if self.loss_mask is None else self.loss_mask

    @property
    def num_sequences(self) -> int:
        return int(self.completion_ids.shape[0])

    def micro_batches(self, parts: int | None = None, layout: str = "padded") -> Iterator[MicroBatch]:
        """Slices of ``micro_batch_size`` completions, in order, or with ``micro_batch_tokens`` the token-budget
        micro-batches (``parts`` of them when given: what sharded ranks agree on; ``layout``: costed as fed, padded
        or in the packed layout ``model.packing`` feeds). A rollout server's pi_ref scoring and an engine's
        recompute of alpha always take the padded ones (``PaddedRollouts.micro_batches``) and the padded forward:
        unpacked, that is the trainer's own cut and pass, so their numbers equal the policy's bit for bit at one
        thread; packed, the trainer's pass (and, under a token budget, its cut) differs, and the values agree
        within float tolerance (1e-5 in float32; ``MicroBatch.take`` reads them by row, so any cut lines up)."""
        return micro_batch_views(self.prompt_ids, self.prompt_mask, self.group_index, self.completion_ids,
                                 self.completion_mask, self.micro_batch_size, self.loss_mask,
                                 self.micro_batch_tokens, parts, layout)


def real_lengths(mask: torch.Tensor, left: bool) -> torch.Tensor:
    """Per row, the number of real tokens of a padded ``mask``; raises if the real tokens are not one contiguous
    run at the right (``left`` padding) or at the left (right padding), which the packed layout relies on."""
    lengths = mask.long().sum(-1)
    columns = torch.arange(mask.shape[-1], device=mask.device)
    expected = columns >= mask.shape[-1] - lengths[:, None] if left else columns < lengths[:, None]
    if not torch.equal(mask.bool(), expected):
        side = "left" if left else "right"
        raise ValueError(f"packing needs {side}-padded rows whose real tokens are contiguous; got a mask with holes")
    return lengths


def left_pad(prompts: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one left-padded ``[num_prompts, P]`` tensor and its mask: the layout of ``RolloutBatch.prompt_ids``
    and of an engine's prefill, so that a prompt's last token sits in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long, device=device)
            mask[row, width - len(prompt) :] = 1
    return ids, mask


def micro_batch_views(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_index: torch.Tensor,
                      completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                      micro_batch_size: int, loss_mask: torch.Tensor | None = None,
                      micro_batch_tokens: int | None = None, parts: int | None = None,
                      layout: str = "padded") -> Iterator[MicroBatch]:
    """The micro-batches of a padded rollout layout (``RolloutBatch.micro_batches``), each with the distinct
    prompts it needs and trimmed of the padding no row of it uses: contiguous slices of ``micro_batch_size``
    completions, or with ``micro_batch_tokens`` the rows sorted by length and cut by that budget of padded tokens,
    costed as ``layout`` feeds them (``lit_grpo.core.micro_batch_plan.LAYOUTS``; exactly ``parts`` micro-batches
    when given). A rollout server scoring pi_ref and an engine recomputing alpha get the padded ones: the trainer's
    own micro-batches unless ``model.packing`` packs them (see ``RolloutBatch.micro_batches``)."""
    num_sequences = int(completion_ids.shape[0])
    if micro_batch_tokens is None:
        selections: list[slice | torch.Tensor] = [slice(start, min(start + micro_batch_size, num_sequences))
                                                  for start in range(0, num_sequences, micro_batch_size)]
    else:
        selections = [torch.tensor(rows, dtype=torch.long, device=completion_ids.device)
                      for rows in token_budget_rows(prompt_mask, group_index, completion_mask, micro_batch_tokens,
                                                    parts, layout)]
    for rows in selections:
        groups = group_index[rows]
        unique, inverse = torch.unique(groups, sorted=True, return_inverse=True)
        p_mask = prompt_mask[unique]
        keep_from = int((p_mask.sum(0) > 0).nonzero().min()) if p_mask.any() else 0
        c_mask = completion_mask[rows]
        # at least two columns when the batch has them: scoring then always makes the same two forwards,
        # which sharded (FSDP) ranks must make together; a padded column is masked and changes no number
        width = max(int(c_mask.sum(1).max()), min(2, completion_ids.shape[1]))
        yield MicroBatch(
            prompt_ids=prompt_ids[unique][:, keep_from:],
            prompt_mask=p_mask[:, keep_from:],
            prompt_index=inverse,
            completion_ids=completion_ids[rows][:, :width],
            completion_mask=c_mask[:, :width],
            rows=rows,
            loss_mask=None if loss_mask is None else loss_mask[rows][:, :width],
        )


def token_budget_rows(prompt_mask: torch.Tensor, group_index: torch.Tensor, completion_mask: torch.Tensor,
                      budget: int, parts: int | None = None, layout: str = "padded") -> list[list[int]]:
    """The rows of each token-budget micro-batch of a padded layout (``plan_by_tokens``, or ``split_into`` for
    ``parts`` micro-batches), from its real lengths, costed as ``layout`` feeds them."""
    completion_lengths = completion_mask.sum(1).tolist()
    groups = group_index.tolist()
    prompt_lengths = prompt_mask.sum(1)[group_index].tolist()
    if parts is None:
        return plan_by_tokens(completion_lengths, prompt_lengths, groups, budget, layout)
    return split_into(completion_lengths, prompt_lengths, groups, parts, layout)


def padding_tokens(micro_batches: list[MicroBatch]) -> torch.Tensor:
    """``(padded tokens, tokens computed)`` of the forwards over ``micro_batches``, each its distinct prompts'
    ``[u, P']`` block and its completions' ``[s, C']`` block, as a float64 ``[2]`` tensor on the masks' device
    (summed without a host sync); their ratio is the share of the work spent on padding."""
    computed = sum(mb.prompt_mask.numel() + mb.completion_mask.numel() for mb in micro_batches)
    real = torch.stack([mb.prompt_mask.sum() + mb.completion_mask.sum() for mb in micro_batches]).sum()
    total = torch.tensor(float(computed), dtype=torch.float64, device=real.device)
    return torch.stack([total - real.to(torch.float64), total])


def alpha_logprobs(batch: RolloutBatch, mb: MicroBatch, pik_logp: torch.Tensor) -> torch.Tensor:
    """log alpha on ``mb``'s tokens (alpha: the policy that sampled the batch, eq. 6's denominator).

    The batch carries them (``batch.alpha_logp``) unless alpha = pi_k: the engine that sampled it held exactly the
    policy's current weights, so the data module skipped the engine's scoring pass (``alpha_logprobs`` there,
    ``reuse_policy_logprobs``) and the trainer's own first forward on the batch gives those log-probs, ``pik_logp``
    (the ratio pi_k / alpha is then exactly 1). Every use of alpha in the step resolves it here."""
    return pik_logp if batch.alpha_logp is None else mb.take(batch.alpha_logp)
