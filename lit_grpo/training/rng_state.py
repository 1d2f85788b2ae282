"""Every random generator a training process draws from (torch's, CUDA's, numpy's, Python's), saved into a
checkpoint for all ranks and restored on each rank: what makes a resume exact."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lit_grpo.core.distributed import all_gather_objects, rank_and_world


def gathered_rng_states() -> list[dict[str, Any]]:
    """Each rank's generator states, in rank order (a collective: every rank calls it; only rank 0 writes the
    checkpoint, and each rank resumes its own). Plain types only, so the checkpoint loads with
    ``torch.load(weights_only=True)``."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {"torch": torch.get_rng_state(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), int(pos),
           int(has_gauss), float(cached)), "python": random.getstate()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return all_gather_objects(rng)


def restore_rng_states(rng: list[dict[str, Any]] | dict[str, Any]) -> None:
    """This rank's generators from :func:`gathered_rng_states` (or one process's dict, as older checkpoints hold);
    refused in one line when the checkpoint was written by another number of processes."""
    if isinstance(rng, list):
        rank, world = rank_and_world()
        if len(rng) != world:
            raise ValueError(f"checkpoint holds the RNG states of {len(rng)} processes, this run has {world}; "
                             "resume with the same number of processes")
        rng = rng[rank]
    torch.set_rng_state(rng["torch"])
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(rng["python"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
