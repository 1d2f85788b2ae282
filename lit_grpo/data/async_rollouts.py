"""`AsyncRollouts`: which rollout batches are requested and when (``data.max_staleness`` = K), taking them, and the
batches generated ahead as checkpoint data.

Every batch goes the same way, whatever K: batch b + K is handed over to the producer when the trainer takes batch b,
and the trainer then takes batch b. With K >= 1 the producer is a background thread (``RolloutProducer``), which
generates up to K batches ahead while the trainer updates; K = 0 is the degenerate case, in which nothing is ahead
and the request runs on the training thread when the batch is taken (``InlineProducer``). The request itself (one
rank's completions for one batch) is the data module's, given to the constructor.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from lit_grpo.core.distributed import all_gather_objects
from lit_grpo.data.dynamic_sampling import Formed
from lit_grpo.data.producer import InlineProducer, Producer, RolloutProducer
from lit_grpo.data.staleness import groups_from_state, groups_to_state
from lit_grpo.engines.base import Completion, Rollouts

#: what a batch's request brings back: the rollouts and the seconds the completions took, and how dynamic sampling
#: formed the batch when it did (``lit_grpo.data.dynamic_sampling``)
Requested = tuple[Rollouts, float] | tuple[Rollouts, float, Formed]
#: a batch generated and not yet trained on: its groups and seconds, and how dynamic sampling formed it (if it did)
Generated = tuple[list[list[Completion]], float] | tuple[list[list[Completion]], float, Formed]


class AsyncRollouts:
    """The batches of one rank, requested ``max_staleness`` ahead of the trainer.

    Args:
        max_staleness: K, how many batches are requested ahead of the one the trainer takes.
        request: batch index -> the job that requests that batch (no collective: it may run on a background thread).
    """

    def __init__(self, max_staleness: int, request: Callable[[int], Callable[[], Requested]]) -> None:
        self.max_staleness = max_staleness
        self.request = request
        self.producer: Producer | None = None  # made at the first batch taken
        #: generated batches restored from a checkpoint or kept from an earlier fit, not yet trained on:
        #: batch index -> (groups, seconds), or (groups, seconds, formed) for a batch formed by dynamic sampling
        self.restored: dict[int, Generated] = {}
        #: how often the producer had generated all it may and waited for the trainer (the staleness bound)
        self.producer_waits = 0

    def ensure_producer(self) -> Producer:
        if self.producer is None:
            self.producer = RolloutProducer() if self.max_staleness else InlineProducer()
        return self.producer

    def drain(self) -> None:
        """Wait for the batches already requested (every weight push does first, on every rank: no batch handed over
        under the old weights is sampled with the new ones). Not with partial rollouts, whose pushes keep the requests
        in flight: a batch handed over when the trainer takes batch b starts after the push of version b returned,
        so none of its tokens is older than b, and the staleness bound holds per token without waiting."""
        if self.producer is not None:
            self.producer.drain()

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
            producer.submit(j, self.request(j))

    def take(self, index: int) -> tuple[Rollouts, float, float]:
        """Batch ``index`` as requested (K batches earlier, or now at K = 0), after handing the next ones over: its
        rollouts (a failed request as ``Rollouts.error``, for the ranks to stop together), the seconds its
        completions took, and the seconds the trainer waited for it."""
        return self.take_formed(index)[:3]

    def take_formed(self, index: int) -> tuple[Rollouts, float, float, Formed | None]:
        """``take``, and how dynamic sampling formed the batch (``None``: it did not)."""
        producer = self.ensure_producer()
        waited = producer.waited_s
        self.hand_over(index)
        formed: list[Formed] = []
        if index in self.restored:
            groups, seconds, *formed = self.restored.pop(index)
            rollouts = Rollouts(groups)
        else:
            result, error = producer.take(index)
            if error is None:
                rollouts, seconds, *formed = result
            else:
                rollouts, seconds = Rollouts(None, f"{type(error).__name__}: {error}"), 0.0
        return rollouts, seconds, producer.waited_s - waited, (formed[0] if formed else None)

    def generated(self) -> dict[int, Generated]:
        """The batches generated ahead and not yet taken (after the requests running now), with the restored ones:
        ``(groups, seconds)``, and the ``Formed`` record third for a batch formed by dynamic sampling."""
        kept = dict(self.restored)
        if self.producer is not None:
            self.producer.drain()
            for index, (result, error) in self.producer.finished().items():
                if error is None and result[0].error is None:
                    kept[index] = (result[0].groups, *result[1:])
        return kept

    def keep_generated(self) -> None:
        """At the end of a fit: keep the batches generated ahead (a checkpoint saved after ``fit`` holds them, and a
        further ``fit`` trains on them), then stop the producer."""
        if self.producer is not None:
            self.restored = self.generated()
            self.stop()

    def stop(self) -> None:
        """Stop the producer without waiting: a request running now ends on its daemon thread, within its timeout."""
        if self.producer is not None:
            self.producer.close()
            self.producer = None

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state(self, world: int) -> dict[str, Any]:
        """Every rank's batches generated ahead and not yet trained on, as plain lists (a checkpoint needs them for
        an exact resume: their weights are gone from the server). Waits for the requests running now; the gather is
        a collective, and ``state_dict`` runs on every rank when a checkpoint is saved."""
        mine = {index: {"groups": groups_to_state(groups), "seconds": seconds,
                        **({"formed": formed[0].to_state()} if formed else {})}
                for index, (groups, seconds, *formed) in self.generated().items()}
        everyone = all_gather_objects(mine) if world > 1 else [mine]
        return {"world_size": world, "max_staleness": self.max_staleness, "ranks": everyone}

    def restore(self, state: dict[str, Any] | None, rank: int, world: int) -> None:
        """Replace the batches generated ahead by the checkpoint's ``state`` (none when it holds none, or when it came
        from another world size)."""
        self.restored = {}
        if not state:
            return
        if int(state["world_size"]) != world:
            warnings.warn(f"the checkpoint's batches generated ahead come from {state['world_size']} ranks and this "
                          f"run has {world}: they are regenerated, so the run is not an exact continuation",
                          stacklevel=2)
            return
        self.restored = {int(index): (groups_from_state(item["groups"]), float(item["seconds"]))
                         + ((Formed.from_state(item["formed"]),) if "formed" in item else ())
                         for index, item in state["ranks"][rank].items()}
