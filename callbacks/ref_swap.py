"""`RefModelSwap`: set pi_ref to the current policy at the end of each stage (Algorithm 1, line 16)."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks.interval import Interval
from lit_grpo.callbacks.protocol import check_ref_swap, policy_of, refuse_second

from lit_grpo.models.lora import is_lora, swap_reference_by_merge


class RefModelSwap(Callback):
    """Copy the policy's weights into ``pl_module.reference`` at the end of each stage (Algorithm 1, line 16), at
    most ``max_swaps`` times (the paper's S stages). A stage is ``every_n_epochs`` epochs (default: 1), or
    ``every_n_batches`` rollout batches, or ``every_n_optimizer_steps`` optimizer steps (one of the three; see
    ``lit_grpo.callbacks.interval`` for the units).

    With a LoRA policy and no reference module (pi_ref is the policy with its adapter off), a swap merges the
    adapter into the base and starts a fresh one (``lit_grpo.models.lora.swap_reference_by_merge``).

    ``reset_optimizer`` also clears the optimizer's moment estimates at each swap. After a swap,
    ``KL(pi || pi_ref)`` is exactly 0 until the next update.

    The module must expose ``policy`` and ``reference`` (``None`` for no reference: stages are counted, nothing
    is swapped); both are checked when the fit starts (``lit_grpo.callbacks.protocol.check_ref_swap``). Logged:
    ``ref/swaps``, the swaps made, and ``ref/stages``, the stages ended.
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

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Hold the module to the protocol before the first batch (``check_ref_swap``): ``policy``, and
        ``reference`` present with the policy's layout, or ``None``; and refuse a second ``RefModelSwap``."""
        refuse_second(self, trainer.callbacks, RefModelSwap)
        check_ref_swap(pl_module)

    @torch.no_grad()
    def swap(self, trainer: L.Trainer, pl_module: L.LightningModule) -> bool:
        """End a stage; set pi_ref to the policy unless ``max_swaps`` swaps were made already. Returns whether a
        swap was made: a copy into ``reference``, or a LoRA merge; with ``reference = None`` and no adapter there
        is nothing to swap, and only the stage is counted."""
        self.stages_done += 1
        if self.max_swaps is not None and self.swaps >= self.max_swaps:
            return False
        swapped = False
        reference = getattr(pl_module, "reference", None)
        if reference is not None:
            policy = policy_of(pl_module, "RefModelSwap")
            for model in (reference, policy):
                if hasattr(model, "reshard"):  # FSDP2: both in their sharded form, so shards copy to shards
                    model.reshard()
            for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
                ref_param.copy_(param)
            swapped = True
        elif is_lora(policy_of(pl_module, "RefModelSwap")) and getattr(pl_module, "uses_reference", True):
            # LoRA: pi_ref is the policy with its adapter off; merge the adapter into the base, start a fresh one
            swap_reference_by_merge(policy_of(pl_module, "RefModelSwap"), list(trainer.optimizers))
            swapped = True
        if not swapped:
            return False
        if hasattr(pl_module, "reference_version"):  # a copy of pi_ref elsewhere (a rollout server) is stale
            pl_module.reference_version += 1
        if self.reset_optimizer:
            for optimizer in trainer.optimizers:
                optimizer.state.clear()
        self.swaps += 1
        self.last_swap_step = trainer.global_step
        return True

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.every_n_epochs is not None and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.swap(trainer, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches_seen += 1
        if self.interval.active and self.interval.boundaries(trainer, self.batches_seen) > self.stages_done:
            self.swap(trainer, pl_module)
        # swaps made (copies or merges) and stages ended are two counts: at beta = 0 stages end but nothing swaps
        pl_module.log("ref/swaps", float(self.swaps), on_step=True, batch_size=1)
        pl_module.log("ref/stages", float(self.stages_done), on_step=True, batch_size=1)

    @property
    def state_key(self) -> str:
        # named by its period, as checkpoints written when two instances could run side by side store it (a fit now
        # takes one: see on_fit_start)
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
