"""`WeightSync`: push the policy's weights into the rollout engine every v rollout batches (the paper's v), or
sooner when the policy has drifted from the engine by more than a total-variation budget."""

from __future__ import annotations

import math
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from lit_grpo.callbacks.protocol import (
    check_weight_sync,
    engine_of,
    full_named_tensors,
    policy_of,
    refuse_second,
    shares_policy,
)

from lit_grpo.core.measured_metrics import log_measured
from lit_grpo.engines.base import AdapterEngine, ReferenceServing, RolloutEngine
from lit_grpo.models.lora import adapter_update, is_lora, merged_named_tensors, parameter_bytes


class WeightSync(Callback):
    """Load the policy's weights into the rollout engine every ``every_n_batches`` rollout batches: this is the
    paper's v (Table 1). v = 1 keeps alpha = pi_k (on-policy); v > 1 lets alpha lag (off-policy GRPO).

    Unit: a rollout batch is one call of ``training_step`` (Algorithm 1's k), however many optimizer steps
    (the paper's i) it makes; with i > 1, v = 10 means every 10 batches = 10 i optimizer steps.

    Adaptive sync (``max_tv``): also sync as soon as the measured total variation between the policy and the
    engine's weights exceeds ``max_tv`` (the ``tv_metric`` the LightningModule logs, by default ``tv/pi_alpha``
    of ``GRPOModule``: the estimate of TV(pi, alpha) of Theorem 1 after the batch's update). Whichever comes
    first, the v-batch interval or the TV budget, triggers the sync; ``sync/by_interval`` and ``sync/by_tv``
    count the reasons.

    Stale data (``delay_batches = d``): the weights taken at a sync reach the engine d rollout batches later, so
    every batch is sampled from weights at least d optimizer steps old, as when a rollout worker runs ahead of
    the trainer (Trinity-RFT's ``sync_offset``, the "stale data" setting of Yao et al.; ``v=1, d=1`` is
    one-step-off-policy training). The weights in flight are a full copy each (on the CPU), kept in checkpoints.

    Each sync is timed (``sync/seconds``). The engine's weights are saved in checkpoints while they lag the
    policy, so a resumed run samples from exactly the weights it would have used.

    The module must expose ``policy``, and the engine be a ``RolloutEngine`` (passed as ``engine``, or the data
    module's or the module's ``rollout_engine``): checked when the fit starts (``lit_grpo.callbacks.protocol``).
    """

    syncs_rollout_engine = True  # lit_grpo.engines.base.EngineSyncer: the data module warns when a fit has none
    #: an engine that samples from the policy itself (``shares_policy``) gets no copy: the data module may build one
    skips_shared_pushes = True

    def __init__(self, every_n_batches: int = 1, max_tv: float | None = None, tv_metric: str = "tv/pi_alpha",
                 engine: RolloutEngine | None = None, delay_batches: int = 0) -> None:
        if not isinstance(every_n_batches, int) or every_n_batches < 1:
            raise ValueError(f"every_n_batches (v) must be an integer >= 1, got {every_n_batches!r}")
        if max_tv is not None and not (0 <= max_tv < math.inf):
            raise ValueError(f"max_tv must be a finite number >= 0 or None, got {max_tv!r}")
        if not isinstance(delay_batches, int) or delay_batches < 0:
            raise ValueError(f"delay_batches must be an integer >= 0, got {delay_batches!r}")
        if delay_batches and max_tv is not None:
            raise ValueError(f"max_tv={max_tv} syncs because the policy drifted now; it cannot be combined with "
                             f"delay_batches={delay_batches}, which delivers weights later (use one of the two)")
        self.every_n_batches = every_n_batches
        self.delay_batches = delay_batches
        #: weights taken at a sync and not yet delivered: (batch at which they are due, their step, tensors)
        self.in_flight: list[tuple[int, int, dict[str, Any]]] = []
        self.batches_seen = 0
        self.max_tv = max_tv
        self.tv_metric = tv_metric
        self.engine = engine
        self.batches_since_sync = 0
        self.num_syncs = 0
        self.syncs_by_interval = 0
        self.syncs_by_tv = 0
        self.last_sync_step = 0
        self.last_sync_seconds = 0.0
        self.total_sync_seconds = 0.0
        self._restored_engine_state: dict | None = None
        self._restored = False
        self.last_push_bytes = 0  # `sync/bytes`: bytes of the tensors the last push sent

    def push_reference_if_stale(self, engine: RolloutEngine, pl_module: L.LightningModule) -> None:
        """An engine that scores pi_ref itself (``ReferenceServing`` and ``serves_reference``:
        ``data.reference_on_server``) gets pi_ref before the policy whenever the copy it holds is not the module's
        current one (at the start of a fit, and at the first sync after each ``RefModelSwap``). Until then the module
        computes pi_ref's log-probs."""
        if not (isinstance(engine, ReferenceServing) and engine.serves_reference):
            return
        reference = getattr(pl_module, "reference", None)  # the module's side of the protocol: None at beta = 0
        if reference is None:
            return
        version = str(getattr(pl_module, "reference_version", 0))
        if engine.reference_version != version:
            engine.load_reference(full_named_tensors(reference), version)

    def sync(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        start = time.perf_counter()
        self.push_reference_if_stale(engine_of(trainer, pl_module, self.engine), pl_module)
        if self.delay_batches:  # take the weights now (a collective under FSDP), deliver them later
            weights = {name: t.detach().to("cpu", copy=True) for name, t in self.full_weights(pl_module)}
            self.in_flight.append((self.batches_seen + self.delay_batches, trainer.global_step, weights))
            self.last_push_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        else:
            self.push(engine_of(trainer, pl_module, self.engine), pl_module, trainer.global_step, first=False)
            self.last_sync_step = trainer.global_step
        self.last_sync_seconds = time.perf_counter() - start
        self.total_sync_seconds += self.last_sync_seconds
        self.batches_since_sync = 0
        self.num_syncs += 1

    def deliver_due(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Load the newest weights in flight whose delay has passed (older due ones are superseded)."""
        due = [w for w in self.in_flight if w[0] <= self.batches_seen]
        if not due:
            return
        self.in_flight = [w for w in self.in_flight if w[0] > self.batches_seen]
        _, step, weights = due[-1]
        engine = engine_of(trainer, pl_module, self.engine)
        engine.load_weights(iter(weights.items()), step=step)
        self.push_reference_if_stale(engine, pl_module)  # a server that rejoined in this push (see ``push``)
        self.last_sync_step = step

    def measured_tv(self, trainer: L.Trainer) -> float | None:
        value = trainer.callback_metrics.get(self.tv_metric)
        return None if value is None else float(value)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Hold the module to the protocol before the first batch (``check_weight_sync``: ``policy`` and a
        ``RolloutEngine``), and refuse a second ``WeightSync``."""
        refuse_second(self, trainer.callbacks, WeightSync)
        engine = check_weight_sync(trainer, pl_module, self.engine)
        if shares_policy(engine, pl_module) and (self.every_n_batches != 1 or self.delay_batches):
            raise ValueError(f"WeightSync(every_n_batches={self.every_n_batches}, delay_batches={self.delay_batches}) "
                             "lets the rollout engine lag the policy, but the engine samples from the policy itself "
                             "(shares_policy); expected every_n_batches=1 and delay_batches=0, or "
                             "data.engine_options.weights: copy")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        engine = engine_of(trainer, pl_module, self.engine)
        self.push_reference_if_stale(engine, pl_module)
        if self._restored_engine_state is not None and shares_policy(engine, pl_module):
            # a checkpoint of a run whose copy lagged, resumed on the policy itself: it samples with the policy now
            rank_zero_warn("resuming a checkpoint that holds the rollout engine's lagging weights with an engine that "
                           "samples from the policy itself (data.engine_options.weights); the weights are not "
                           "loaded, so this run is not an exact continuation")
            self._restored_engine_state = None
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
        self.push(engine, pl_module, start_step, first=True)

    def full_weights(self, pl_module: L.LightningModule) -> Any:
        """The policy's full weights under the plain model's names: a LoRA policy's merged view (base plus
        scale * B @ A per layer), so that an engine that takes no adapters samples from the same policy."""
        policy = policy_of(pl_module)
        return merged_named_tensors(policy) if is_lora(policy) else full_named_tensors(policy)

    def push(self, engine: RolloutEngine, pl_module: L.LightningModule, step: int, first: bool) -> None:
        """Load the policy into ``engine``: a LoRA policy sends an engine that takes adapters (``AdapterEngine``)
        only the adapter and the merges it has not applied, with the base's hash at the ``first`` push of a fit and
        with every merge (``lit_grpo.models.lora.adapter_update``); every other engine gets the full weights. Records
        the
        bytes sent (``sync/bytes``)."""
        policy = policy_of(pl_module)
        if shares_policy(engine, pl_module):
            engine.synced_step = int(step)  # it samples from the policy itself: nothing to copy
            self.last_push_bytes = 0
            return
        if self.delay_batches and is_lora(policy) and isinstance(engine, AdapterEngine):
            raise ValueError(f"WeightSync(delay_batches={self.delay_batches}) with a LoRA policy and an engine that "
                             "takes adapters: delayed pushes carry full weights; use data.max_staleness for "
                             "asynchronous rollouts, expected delay_batches=0")
        if is_lora(policy) and isinstance(engine, AdapterEngine):
            if first and getattr(engine, "needs_base_weights", False):
                # an in-process copy of a sharded policy holds no values yet: the policy's own tensors, once
                engine.load_weights(full_named_tensors(policy), step=step)
            update = adapter_update(policy, engine.merges_applied, with_hash=first, step=step)
            engine.load_adapter(update, step)
            self.last_push_bytes = update.nbytes
            return
        engine.load_weights(self.full_weights(pl_module), step=step)
        self.last_push_bytes = parameter_bytes(policy)
        # a server that rejoined in this push holds its own start-up pi_ref: it gets the current one now, before
        # its first batch is scored (the engine's label is None until every server reached holds it)
        self.push_reference_if_stale(engine, pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.batches_since_sync += 1
        self.batches_seen += 1
        by_interval = self.batches_since_sync >= self.every_n_batches
        tv = self.measured_tv(trainer) if self.max_tv is not None else None
        if self.max_tv is not None and tv is None:
            raise RuntimeError(f"WeightSync(max_tv={self.max_tv}) reads the metric {self.tv_metric!r}, which the "
                               "LightningModule did not log this step")
        by_tv = tv is not None and tv > self.max_tv
        if by_interval or by_tv:
            self.sync(trainer, pl_module)
            # the metric is reduced over ranks, so every rank takes the same decision (the sync is a collective)
            self.syncs_by_interval += int(by_interval)
            self.syncs_by_tv += int(by_tv and not by_interval)
            # a sync's time and size exist at the steps that synced only: logged there, never repeated at the
            # steps between syncs (lit_grpo.core.measured_metrics says why self.log alone would repeat them)
            log_measured(pl_module, {"sync/seconds": self.last_sync_seconds, "sync/bytes": float(self.last_push_bytes)})
        self.deliver_due(trainer, pl_module)
        # sync/count and the counts by reason are counters, measured at every step whether it synced or not (0 before
        # the first sync, a step function in the plots, the last value the run's total): logged every step, always
        # current, so Lightning's step cache never repeats a stale one
        pl_module.log("sync/count", float(self.num_syncs), on_step=True, batch_size=1)
        pl_module.log("sync/by_interval", float(self.syncs_by_interval), on_step=True, batch_size=1)
        pl_module.log("sync/by_tv", float(self.syncs_by_tv), on_step=True, batch_size=1)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        engine = engine_of(trainer, pl_module, self.engine)
        if engine.synced_step == trainer.global_step or shares_policy(engine, pl_module):
            return  # the engine holds the policy's weights: nothing extra to save
        weights = engine.state_dict()
        if weights is None:
            rank_zero_warn("the rollout engine lags the policy but cannot export its weights; a resume from this "
                           "checkpoint will not be exact")
            return
        checkpoint["rollout_engine_weights"] = weights

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._restored_engine_state = checkpoint.get("rollout_engine_weights")

    def state_dict(self) -> dict[str, Any]:
        return {
            "every_n_batches": self.every_n_batches,
            "batches_since_sync": self.batches_since_sync,
            "num_syncs": self.num_syncs,
            "syncs_by_interval": self.syncs_by_interval,
            "syncs_by_tv": self.syncs_by_tv,
            "last_sync_step": self.last_sync_step,
            "total_sync_seconds": self.total_sync_seconds,
            "batches_seen": self.batches_seen,
            "in_flight": [(due, step, weights) for due, step, weights in self.in_flight],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.batches_since_sync = int(state_dict["batches_since_sync"])
        self.num_syncs = int(state_dict["num_syncs"])
        self.syncs_by_interval = int(state_dict.get("syncs_by_interval", 0))
        self.syncs_by_tv = int(state_dict.get("syncs_by_tv", 0))
        self.last_sync_step = int(state_dict["last_sync_step"])
        self.total_sync_seconds = float(state_dict["total_sync_seconds"])
        self.batches_seen = int(state_dict.get("batches_seen", 0))
        self.in_flight = [(int(due), int(step), dict(weights))
                          for due, step, weights in state_dict.get("in_flight", [])]
        self._restored = True
