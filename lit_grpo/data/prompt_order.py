"""Which prompts make up each rollout batch (Algorithm 1, line 7: a batch D_b from rho_X): the run's task rows, a
seeded permutation of them per epoch, each rank's contiguous share of every global batch, and the stream of
``PromptBatch`` that Lightning's loop iterates. Batches are counted over all epochs, so a resumed run continues with
the next unseen prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from lit_grpo.core.distributed import rank_slice

if TYPE_CHECKING:
    from lit_grpo.data.datamodule import RolloutDataModule


@dataclass
class PromptBatch:
    """Which rows of the dataset make up this rank's share of rollout batch number ``batch_index`` (counted
    over all epochs), and the rank that draws them."""

    rows: list[int]
    batch_index: int
    rank: int = 0


class PromptStream(IterableDataset):
    """Shuffled prompt indices, ``prompts_per_step`` at a time; each epoch is a fresh seeded permutation.

    Iteration resumes from the data module's count of consumed batches, so a restarted run continues with
    the next unseen prompts.
    """

    def __init__(self, owner: RolloutDataModule) -> None:
        self.owner = owner

    def __len__(self) -> int:
        return self.owner.batches_per_epoch

    def __iter__(self) -> Iterator[PromptBatch]:
        owner = self.owner
        per_epoch = owner.batches_per_epoch
        start = owner.consumed
        epoch = start // per_epoch
        for index in range(start, (epoch + 1) * per_epoch):
            yield owner.prompt_batch(index)


class PromptLoader(DataLoader):
    """The data module's loader of :class:`PromptStream`. Lightning warns, on a resume from the middle of an epoch,
    that a loader without ``state_dict`` and ``load_state_dict`` is not resumable and results may be unreliable;
    this one is resumable, by the data module: its own checkpoint state (``lit_grpo.data.checkpoint_state``) holds
    the count of consumed batches the stream starts from. So the loader's own state is empty, and having the two
    methods tells Lightning so (its ``_Stateful`` check)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the data module's ``load_state_dict`` restored the stream's position."""


def used_rows(rows: list[dict[str, Any]], max_prompts: int | None, seed: int, dataset: str,
              prompts_per_step: int) -> list[dict[str, Any]]:
    """The rows a run draws its prompts from: all of ``rows``, or the first ``max_prompts`` after a shuffle seeded
    by the data seed; refused when fewer than one batch's ``prompts_per_step``."""
    if max_prompts is not None:
        keep = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[:max_prompts]
        rows = [rows[i] for i in keep.tolist()]
    if len(rows) < prompts_per_step:
        raise ValueError(f"dataset {dataset!r} has {len(rows)} rows, fewer than prompts_per_step={prompts_per_step}")
    return rows


def epoch_permutation(seed: int, epoch: int, num_rows: int) -> list[int]:
    """The order of the rows in ``epoch``: a permutation seeded by the data seed and the epoch."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_rows, generator=generator).tolist()


def rank_share(order: list[int], batch: int, prompts_per_step: int, rank: int, world: int) -> list[int]:
    """Rank ``rank``'s rows of global batch ``batch`` (within its epoch's ``order``). One global batch holds
    ``world * prompts_per_step`` prompts and each rank takes a contiguous share, so a group never spans two ranks
    and the ranks' prompts are disjoint."""
    global_batch = prompts_per_step * world
    chunk = order[batch * global_batch : (batch + 1) * global_batch]
    return rank_slice(chunk, rank, world, prompts_per_step)
