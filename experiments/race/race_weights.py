"""Saving a side's weights at the evaluation steps, and the training clock that leaves the saving out."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from safetensors.torch import save_file


class TrainingClock:
    """Seconds of training so far: wall time since :meth:`start`, less the time spent saving weights."""

    def __init__(self) -> None:
        self.began = 0.0
        self.paused = 0.0

    def start(self) -> None:
        self.began = time.perf_counter()

    def seconds(self) -> float:
        return time.perf_counter() - self.began - self.paused

    def save(self, model: torch.nn.Module, path: Path) -> None:
        """Write ``model``'s weights to ``path`` (safetensors), off the clock."""
        began = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        # tied embeddings share storage: safetensors refuses shared tensors, the evaluator re-ties them on load
        seen: set[int] = set()
        unique = {}
        for key, tensor in state.items():
            if tensor.data_ptr() in seen:
                continue
            seen.add(tensor.data_ptr())
            unique[key] = tensor
        save_file(unique, str(path))
        self.paused += time.perf_counter() - began
