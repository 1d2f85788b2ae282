"""`WeightSync`: push the policy's weights into the rollout engine every v training steps (the paper's v)."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from lit_grpo.callbacks.protocol import engine_of, full_named_tensors, policy_of


class WeightSync(Callback):
    """Every ``every_n_steps`` training steps (rollout batches, Algorithm 1's k), load the policy's weights into
    the rollout engine. v = 1 keeps alpha = pi_k (on-policy); v > 1 lets alpha lag (off-policy GRPO).

    A training step here is one call of ``training_step`` (one rollout batch), however many optimizer steps
    it makes. Each sync is timed (``sync/seconds``). The engine's weights are saved in checkpoints while they
    lag the policy, so a resumed run samples from exactly the weights it would have used.
    """

    def __init__(self, every_n_steps: int = 1, engine: Any = None) -> None:
        if not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps (v) must be an integer >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.engine = engine
        self.steps_since_sync = 0
        self.num_syncs = 0
        self.last_sync_step = 0
        self.last_sync_seconds = 0.0
        self.total_sync_seconds = 0.0
        self._restored_engine_state: dict | None = None
        self._restored = False

    def sync(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = engine_of(trainer, pl_module, self.engine)
        start = time.perf_counter()
        engine.load_weights(full_named_tensors(policy_of(pl_module)), step=trainer.global_step)
        self.last_sync_seconds = time.perf_counter() - start
        self.total_sync_seconds += self.last_sync_seconds
        self.last_sync_step = trainer.global_step
        self.steps_since_sync = 0
        self.num_syncs += 1

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = engine_of(trainer, pl_module, self.engine)
        if self._restored_engine_state is not None:
            engine.load_state_dict(self._restored_engine_state, step=self.last_sync_step)
            self._restored_engine_state = None
            return
        if self._restored and self.last_sync_step != trainer.global_step:
            rank_zero_warn(
                "resuming with a lagging rollout engine whose weights were not saved; it restarts from the "
                "current policy, so this run is not an exact continuation"
            )
        # Fresh start (or checkpoint taken right after a sync): the engine must hold the policy's weights.
        start_step = self.last_sync_step if self._restored else trainer.global_step
        engine.load_weights(full_named_tensors(policy_of(pl_module)), step=start_step)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.every_n_steps:
            self.sync(trainer, pl_module)
            pl_module.log("sync/seconds", self.last_sync_seconds, on_step=True, batch_size=1)
        pl_module.log("sync/count", float(self.num_syncs), on_step=True, batch_size=1)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        engine = engine_of(trainer, pl_module, self.engine)
        if engine.synced_step == trainer.global_step:
            return  # the engine holds the policy's weights: nothing extra to save
        weights = engine.state_dict() if hasattr(engine, "state_dict") else None
        if weights is None:
            rank_zero_warn("the rollout engine lags the policy but cannot export its weights; a resume from this "
                           "checkpoint will not be exact")
            return
        checkpoint["rollout_engine_weights"] = weights

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._restored_engine_state = checkpoint.get("rollout_engine_weights")

    def state_dict(self) -> dict[str, Any]:
        return {
            "every_n_steps": self.every_n_steps,
            "steps_since_sync": self.steps_since_sync,
            "num_syncs": self.num_syncs,
            "last_sync_step": self.last_sync_step,
            "total_sync_seconds": self.total_sync_seconds,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps_since_sync = int(state_dict["steps_since_sync"])
        self.num_syncs = int(state_dict["num_syncs"])
        self.last_sync_step = int(state_dict["last_sync_step"])
        self.total_sync_seconds = float(state_dict["total_sync_seconds"])
        self._restored = True
