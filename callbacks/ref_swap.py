"""`RefModelSwap`: set pi_ref to the current policy at the end of each stage (Algorithm 1, line 16)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks.interval import Interval
from lit_grpo.callbacks.protocol import policy_of


class RefModelSwap(Callback):
    """Copy the policy's weights into ``pl_module.reference`` at the end of each stage (Algorithm 1, line 16), at
    most ``max_swaps`` times (the paper's S stages). A stage is ``every_n_epochs`` epochs (default: 1), or
    ``every_n_batches`` rollout batches, or ``every_n_optimizer_steps`` optimizer steps (one of the three; see
    ``lit_grpo.callbacks.interval`` for the units).

    ``reset_optimizer`` also clears the optimizer's moment estimates at each swap. After a swap,
    ``KL(pi || pi_ref)`` is exactly 0 until the next update.
    """

    def __init__(self, every_n_epochs: int | None = None, every_n_batches: int | None = None,
                 every_n_optimizer_steps: int | None = None, max_swaps: int | None = None,
                 reset_optimizer: bool = False) -> None:
        self.interval = Interval("RefModelSwap", every_n_batches, every_n_optimizer_steps)
        if every_n_epochs is not None and self.interval.active:
            raise ValueError("RefModelSwap: set one of every_n_epochs, every_n_batches or every_n_optimizer_steps "
                             "for the stage length, not both")
        if every_n_epochs is None and not self.interval.active:
            every_n_epochs = 1
        if every_n_epochs is not None and every_n_epochs < 1:
            raise ValueError(f"RefModelSwap: every_n_epochs must be >= 1, got {every_n_epochs}")
        if max_swaps is not None and max_swaps < 0:
            raise ValueError(f"max_swaps must be >= 0 or None, got {max_swaps}")
        self.every_n_epochs = every_n_epochs
        self.max_swaps = max_swaps
        self.reset_optimizer = reset_optimizer
        self.swaps = 0
        self.last_swap_step = -1
        self.stages_done = 0
        self.batches_seen = 0

    @torch.no_grad()
    def swap(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.stages_done += 1
        if self.max_swaps is not None and self.swaps >= self.max_swaps:
            return
        reference = getattr(pl_module, "reference", None)
        if reference is not None:
            policy = policy_of(pl_module)
            for model in (reference, policy):
                if hasattr(model, "reshard"):  # FSDP2: both in their sharded form, so shards copy to shards
                    model.reshard()
            for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
                ref_param.copy_(param)
            if hasattr(pl_module, "reference_version"):  # a copy of pi_ref elsewhere (a rollout server) is stale
                pl_module.reference_version += 1
        if self.reset_optimizer:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
        self.swaps += 1
        self.last_swap_step = trainer.global_step

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.swap(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches_seen += 1
        if self.interval.active and self.interval.boundaries(trainer, self.batches_seen) > self.stages_done:
            self.swap(trainer, pl_module)
        pl_module.log("ref/swaps", float(self.swaps), on_step=True, batch_size=1)

    @property
    def state_key(self) -> str:
        # unique per period, so two instances (e.g. different units) can be checkpointed side by side
        return self._generate_state_key(every_n_epochs=self.every_n_epochs,
                                        every_n_batches=self.interval.every_n_batches,
                                        every_n_optimizer_steps=self.interval.every_n_optimizer_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"swaps": self.swaps, "last_swap_step": self.last_swap_step, "stages_done": self.stages_done,
                "batches_seen": self.batches_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.swaps = int(state_dict["swaps"])
        self.last_swap_step = int(state_dict["last_swap_step"])
        self.stages_done = int(state_dict["stages_done"])
        self.batches_seen = int(state_dict.get("batches_seen", 0))
