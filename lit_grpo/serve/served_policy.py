"""`ServedPolicy`: the rollout policy a server holds, its ``weight_version``, and the guard that keeps generation and
a weight swap apart. The generation routes and the weight receiver each hold it; it is the one state they share.

A generation counts itself in ``in_flight`` so that a swap waits for it, and waits for a swap in progress before it
starts; the version it reports is the one it started under, which no swap can change while it runs. ``/pause``
stops new generations (503 until ``/resume``) and, in mode ``abort``, ends the running ones between two decoding
steps (``abort_epoch``). torch is not imported here.

Mode ``keep`` (partial rollouts, ``data.partial_rollouts``) does neither: the running generations stop at their next
token boundary and wait there, holding their KV caches (the decode loop parks, counting the requests it holds in
``parked``: ``DecodeScheduler._park`` in ``serve.scheduler``); the pause returns once every generation in flight is
parked, a swap may then run (it waits for the generations that are not parked only), and ``/resume`` lets them go on
under the new weights, from the token each row had reached.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lit_grpo.wire.protocol import HTTPFailure


class ServedPolicy:
    """The served model (``model``, its ``params`` by name, ``device``, floating ``dtypes``) and its version.

    Thread-safe: HTTP requests are served on threads of their own, and ``cond`` guards ``paused``, ``in_flight``,
    ``swapping``, ``abort_epoch``, ``holding``, ``parked`` and ``weight_version``."""

    def __init__(self, model: Any) -> None:
        self.model = model.eval().requires_grad_(False)
        self.params = dict(model.named_parameters())
        self.device = next(model.parameters()).device
        self.dtypes = sorted({str(p.dtype).split(".")[-1] for p in self.params.values() if p.is_floating_point()})
        self.cond = threading.Condition()
        self.paused = False
        self.in_flight = 0
        self.swapping = False
        self.abort_epoch = 0
        #: a ``keep`` pause is on: generations in flight stop at their next token boundary (read without the lock
        #: once per decoding step by the decode loop: a flag check)
        self.holding = False
        self.parked = 0  # generations in flight parked by the decode loop (``DecodeScheduler._park``)
        self.weight_version: str | None = None

    @contextmanager
    def generating(self) -> Iterator[tuple[int, str | None]]:
        """One generation: refused while paused, started once no swap runs, counted until it ends. Yields the abort
        epoch and the weight version it runs under."""
        with self.cond:
            # paused is checked again after every wait: a /pause?mode=wait that came while this generation waited
            # out a swap has answered already (it counted no generation in flight), so this one must not start
            while True:
                if self.paused:
                    raise HTTPFailure(503, "generation is paused (a weight update is in progress); retry after "
                                           "/resume")
                if not self.swapping:
                    break
                self.cond.wait()
            self.in_flight += 1
            epoch, version = self.abort_epoch, self.weight_version
        try:
            yield epoch, version
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()

    def pause(self, abort: bool, keep: bool = False) -> None:
        """Refuse new generations; ``abort`` ends the running ones at their next step; return once none runs. From
        then until ``resume`` no generation runs: one still waiting for a swap to end is refused when it wakes.

        ``keep``: the running generations stop at their next token boundary instead (the decode loop parks) and the
        pause returns once every one of them waits there; ``resume`` lets them go on. A later pause of another mode
        ends the keep: parked generations go on, and ``wait`` waits for them to end."""
        if abort and keep:
            raise ValueError("a pause either aborts or keeps the generations in flight, not both")
        with self.cond:
            self.paused = True
            self.holding = keep
            if abort:
                self.abort_epoch += 1
            self.cond.notify_all()  # parked generations see an abort, or go on when the keep ends
            while self.in_flight > (self.parked if keep else 0):
                self.cond.wait()

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.holding = False
            self.cond.notify_all()

    @contextmanager
    def swapped(self) -> Iterator[None]:
        """The block changes the weights: it runs once the generations in flight are done or parked (a ``keep``
        pause), and holds new ones back (and parked ones, until ``resume``) until it ends."""
        with self.cond:
            self.swapping = True
            while self.in_flight > self.parked:
                self.cond.wait()
            try:
                yield
            finally:
                self.swapping = False
                self.cond.notify_all()

    @contextmanager
    def settled(self) -> Iterator[None]:
        """The block reads the weights while no swap runs."""
        with self.cond:
            while self.swapping:
                self.cond.wait()
            yield

    def set_model(self, model: Any) -> None:
        """Serve ``model`` (the same network made a LoRA peft model at the first adapter push); call it inside
        ``swapped``."""
        self.model = model.eval().requires_grad_(False)
        self.params = dict(model.named_parameters())

    def set_version(self, version: str) -> None:
        with self.cond:
            self.weight_version = version
