"""Peak bytes of tensor storage that torch's operators allocate inside a block, counted at the dispatcher: the
memory a computation needs whatever the allocator caches, on any device. The update's memory check
(:mod:`lit_grpo.training.memory_check`) and ``benchmarks/head_memory.py`` measure with it."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakLiveBytes(TorchDispatchMode):
    """Inside the block: the bytes of every tensor storage an operator allocated (an output that aliases none of
    its inputs), alive at once, and their peak; ``vocab_peak`` counts only storages first made for a tensor whose
    last dimension is ``vocab``. A storage is counted until Python's object for it is freed (torch keeps one object
    per storage, so its finalizer runs when the storage goes)."""

    def __init__(self, vocab: int | None = None) -> None:
        super().__init__()
        self.vocab = vocab
        self.live = self.peak = self.vocab_live = self.vocab_peak = 0
        self._alive: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if _has_storage(t)}
        for t in tree_leaves(out):
            if _has_storage(t) and id(t.untyped_storage()) not in inputs:
                self._count(t)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, size = id(storage), storage.nbytes()
        if key in self._alive or size == 0:
            return
        vocab_sized = self.vocab is not None and tensor.dim() > 0 and tensor.shape[-1] == self.vocab
        self._alive.add(key)
        self.live += size
        self.peak = max(self.peak, self.live)
        if vocab_sized:
            self.vocab_live += size
            self.vocab_peak = max(self.vocab_peak, self.vocab_live)
        weakref.finalize(storage, self._free, key, size, vocab_sized)

    def _free(self, key: int, size: int, vocab_sized: bool) -> None:
        self._alive.discard(key)
        self.live -= size
        if vocab_sized:
            self.vocab_live -= size


def _has_storage(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "meta"
