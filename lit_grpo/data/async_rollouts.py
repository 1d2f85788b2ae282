"""The asynchronous side of `RolloutDataModule` (``data.max_staleness`` = K >= 1): which batches the producer
is asked for and when, taking them, pi_ref's scoring by the server (``data.reference_on_server``), and the
batches generated ahead as checkpoint data.

``AsyncRollouts`` is a part of ``RolloutDataModule``, which holds the state it uses (the engine, the producer, the
batches restored from a checkpoint); the producer thread itself is ``lit_grpo.serving.producer``.
"""

from __future__ import annotations

import time
import warnings
from functools import partial
from typing import TYPE_CHECKING, Any

from lit_grpo.batch import RolloutBatch
from lit_grpo.data.rollout import pad_rollouts, rollout_seed
from lit_grpo.data.staleness import groups_from_state, groups_to_state, staleness_stats
from lit_grpo.distributed import all_gather_objects
from lit_grpo.engines.base import Completion

if TYPE_CHECKING:
    from lit_grpo.data.datamodule import PromptBatch


class AsyncRollouts:
    """Asynchronous rollouts and pi_ref's scoring on the server, for ``RolloutDataModule``."""

    seed: int
    num_generations: int
    micro_batch_size: int
    max_staleness: int
    scores_reference: bool
    reference_temperature: float
    reference_autocast: str | None
    rollout_engine: Any
    tokenizer: Any
    producer: Any
    restored: dict[int, tuple[list[list[Completion]], float]]
    producer_waits: int
    sampling: Any
    trainer: Any

    def stop_producer(self) -> None:
        if self.producer is not None:
            self.producer.close()
            if self.rollout_engine is not None and self.producer.drain in self.rollout_engine.before_push:
                self.rollout_engine.before_push.remove(self.producer.drain)
            self.producer = None

    def in_flight_state(self) -> dict[str, Any]:
        """Every rank's batches generated ahead and not yet trained on, as plain lists (a checkpoint needs them
        for an exact resume: their weights are gone from the server). Waits for the requests running now; the
        gather is a collective, and ``state_dict`` runs on every rank when a checkpoint is saved."""
        mine: dict[int, Any] = {}
        if self.producer is not None:
            self.producer.drain()
            for index, (generated, error) in self.producer.finished().items():
                if error is None and generated[0].error is None:
                    mine[index] = {"groups": groups_to_state(generated[0].groups), "seconds": generated[1]}
        for index, (groups, seconds) in self.restored.items():
            mine[index] = {"groups": groups_to_state(groups), "seconds": seconds}
        rank, world = self.rank_and_world()
        everyone = all_gather_objects(mine) if world > 1 else [mine]
        return {"world_size": world, "max_staleness": self.max_staleness, "ranks": everyone}

    def restore_in_flight(self, state: dict[str, Any]) -> None:
        """Replace the batches generated ahead by the checkpoint's (none when it came from another world size)."""
        self.restored = {}
        rank, world = self.rank_and_world()
        if int(state["world_size"]) != world:
            warnings.warn(f"the checkpoint's batches generated ahead come from {state['world_size']} ranks and this "
                          f"run has {world}: they are regenerated, so the run is not an exact continuation",
                          stacklevel=2)
            return
        self.restored = {int(index): (groups_from_state(item["groups"]), float(item["seconds"]))
                         for index, item in state["ranks"][rank].items()}

    def ensure_producer(self) -> Any:
        if self.producer is None:
            from lit_grpo.serving.producer import RolloutProducer

            self.producer = RolloutProducer()
            # every weight push first waits for the batches already requested (on every rank, then a barrier in
            # the push): no batch handed over under the old weights is sampled with the new ones
            self.rollout_engine.before_push.append(self.producer.drain)
        return self.producer

    def request(self, prompts: list[list[int]], seed: int) -> tuple[Any, float]:
        """The producer's job: one rank's completions for one batch (``Rollouts``), and pi_ref's log-probs of them
        with ``reference_on_server``; HTTP only (no collective)."""
        start = time.perf_counter()
        rollouts = self.rollout_engine.request_rollouts(prompts, self.num_generations, self.sampling, seed=seed)
        seconds = time.perf_counter() - start
        return self.with_reference(prompts, rollouts), seconds

    def with_reference(self, prompts: list[list[int]], rollouts: Any) -> Any:
        """``rollouts`` with pi_ref's log-probs from the server (``Rollouts.reference``), in the layout and
        micro-batches the trainer will use, when the server scores pi_ref and holds a copy; a failed request
        becomes the rollouts' error, so every rank stops together (``check_lockstep``)."""
        engine = self.rollout_engine
        if not self.scores_reference or rollouts.error is not None or engine.reference_version is None:
            return rollouts
        padded = pad_rollouts(prompts, rollouts.groups, self.tokenizer.pad_token_id)
        micro_batches = list(padded.micro_batches(self.micro_batch_size))
        start = time.perf_counter()
        try:
            rollouts.reference = engine.score_reference(micro_batches, *padded.completion_ids.shape,
                                                        self.reference_temperature, self.reference_autocast)
        except Exception as err:  # noqa: BLE001 (an HTTP failure or an odd answer: stop every rank together)
            rollouts.error = f"pi_ref scoring request failed: {type(err).__name__}: {err}"
        rollouts.reference_seconds = time.perf_counter() - start
        return rollouts

    def hand_over(self, index: int) -> None:
        """Request batches ``index .. index + K`` not yet requested: batch b + K goes to the producer when the
        trainer takes batch b. Also at the end of training: a run resumed from its last checkpoint with more steps
        then trains on the very batches the longer run would have (the cost: K batches generated in vain)."""
        producer = self.ensure_producer()
        for j in range(index, index + self.max_staleness + 1):
            if j in self.restored or producer.known(j):
                continue
            if j > index and producer.idle():
                self.producer_waits += 1  # it had generated all it may; the staleness bound held it back
            batch = self.prompt_batch(j)
            prompts = [self.prompt_ids(r) for r in batch.rows]
            seed = rollout_seed(self.seed, j, batch.rank)
            producer.submit(j, partial(self.request, prompts, seed))

    def take_async(self, prompt_batch: PromptBatch) -> RolloutBatch:
        """Batch ``prompt_batch`` as the producer generated it (asked for K batches earlier), after handing the
        next one over; a failed request stops every rank together (one collective, on this thread)."""
        index = prompt_batch.batch_index
        step = self.trainer.global_step
        producer = self.ensure_producer()
        waited = producer.waited_s
        self.hand_over(index)
        from lit_grpo.serving.client import Rollouts

        if index in self.restored:
            groups, seconds = self.restored.pop(index)
            rollouts = Rollouts(groups)
        else:
            result, error = producer.take(index)
            rollouts, seconds = result if error is None else (Rollouts(None, f"{type(error).__name__}: {error}"), 0.0)
        groups = self.rollout_engine.check_lockstep(rollouts)  # every rank raises when any rank's request failed
        batch = self.assemble(prompt_batch, groups, seconds, sampled_step=None, reference=rollouts.reference,
                              reference_seconds=rollouts.reference_seconds)
        batch.stats.update(staleness_stats(groups, step), trainer_wait_seconds=producer.waited_s - waited,
                           producer_waits=float(self.producer_waits))
        return batch
