"""`HostMemory`: the memory a CPU update frees goes back to the system; the process holds little more than is live."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lit_grpo.core.host_memory import check_threshold_kb, fix_mmap_threshold

#: 1 MiB: a layer's activations at long context (MiBs each) get their own mappings, returned when freed, while the
#: many small tensors (a row's log-probs, the optimizer's scalars) stay in the heap. SmolLM2-135M at 4,096 new
#: tokens with activation checkpointing peaks at 3.3 GB with it against 4.7-4.9 with glibc's default; 4 MiB keeps
#: less of that saving (at 2,048 tokens: 3.1 GB against 2.8 and 3.8), 16 MiB none (docs/speed.md)
DEFAULT_MMAP_THRESHOLD_KB = 1024


class HostMemory(Callback):
    """Fix glibc's ``mmap`` threshold at ``mmap_threshold_kb`` KiB when a fit, validation or prediction on a CPU
    sets up (``lit_grpo.core.host_memory``): freed activations then leave the process instead of staying in its
    heap. Left alone on an accelerator, where the update's tensors are not in host memory. ``None`` keeps glibc's
    dynamic threshold. Where it cannot apply (not glibc, or ``MALLOC_MMAP_THRESHOLD_`` already set) one line says
    why and the fit goes on. It is process-wide: every allocation of the process from then on follows it.

    The price is the kernel's: every freed block that left the process is a fresh mapping, faulted in page by page,
    the next time. On SmolLM2-135M at 2,048 tokens with activation checkpointing an update took 12-25 % longer
    (system time 15.7 s against 6.3 s a process, user time unchanged), on Qwen2.5-0.5B's shape at 1,024 tokens
    up to 43 % longer in single runs, so the command line leaves it off
    (``host_memory.mmap_threshold_kb: null``). It lowers what the process holds above what is alive, never what is
    alive: the memory check's bound (``lit_grpo.training.memory_check``) stays as it was.
    """

    def __init__(self, mmap_threshold_kb: int | None = DEFAULT_MMAP_THRESHOLD_KB) -> None:
        check_threshold_kb(mmap_threshold_kb)
        self.mmap_threshold_kb = mmap_threshold_kb
        #: None until set up; then True when the threshold was fixed, False when left to glibc
        self.applied: bool | None = None

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.mmap_threshold_kb is None or trainer.strategy.root_device.type != "cpu":
            self.applied = False
            return
        why_not = fix_mmap_threshold(self.mmap_threshold_kb)
        self.applied = why_not is None
        if why_not is not None:
            rank_zero_info(f"host_memory.mmap_threshold_kb: not applied, {why_not}")
