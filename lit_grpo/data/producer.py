"""Where the rollout requests of ``AsyncRollouts`` run: ``RolloutProducer``, a background thread, while the trainer
updates (asynchronous off-policy GRPO, ``data.max_staleness`` = K >= 1), or ``InlineProducer``, the training thread
itself when the batch is taken (K = 0: synchronous rollouts).

The producer is deliberately small and knows nothing of GRPO: it runs the jobs it is given, one at a time and in
the order given, on one daemon thread, and keeps their results until the training thread takes them. The jobs do
HTTP only; every collective (the ranks' lockstep check, the gathers of a weight push) stays on the training thread,
so no collective can interleave with a transfer in flight.

Which batches may be requested, and when, is ``AsyncRollouts``' decision (``lit_grpo.data.async_rollouts``): batch
b + K is handed over when the trainer takes batch b, and every weight push first waits for the jobs handed over so far
(``drain``). Every batch is therefore sampled with a version fixed by the schedule, not by thread timing: a run is
reproducible and resumes exactly. With partial rollouts (``data.partial_rollouts``) pushes do not drain: the server
keeps the generations in flight across the swap, and each token carries its version instead; the hand-over rule alone
still bounds every token's staleness (``lit_grpo.data.async_rollouts``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class ProducerClosed(RuntimeError):
    """The producer was closed while the training thread waited for one of its jobs."""


class Producer(Protocol):
    """What ``AsyncRollouts`` asks of a producer: keyed jobs submitted, then taken as ``(result, error)``."""

    #: seconds the training thread spent blocked in ``take`` and ``drain``
    waited_s: float

    def submit(self, key: Any, job: Callable[[], Any]) -> None: ...

    def known(self, key: Any) -> bool: ...

    def idle(self) -> bool: ...

    def take(self, key: Any) -> tuple[Any, BaseException | None]: ...

    def drain(self) -> None: ...

    def finished(self) -> dict[Any, tuple[Any, BaseException | None]]: ...

    def close(self) -> None: ...


class InlineProducer:
    """The producer of synchronous rollouts (K = 0): a job runs on the training thread when it is taken, so a batch
    is generated when the trainer needs it, with the engine's weights of that moment. An exception the job raises
    propagates from ``take``, as from a direct call."""

    def __init__(self) -> None:
        self._jobs: dict[Any, Callable[[], Any]] = {}
        self.waited_s = 0.0  # nothing runs ahead: the trainer never waits for another thread

    def submit(self, key: Any, job: Callable[[], Any]) -> None:
        if key in self._jobs:
            raise ValueError(f"rollout job {key!r} was already submitted")
        self._jobs[key] = job

    def known(self, key: Any) -> bool:
        return key in self._jobs

    def idle(self) -> bool:
        return not self._jobs

    def take(self, key: Any) -> tuple[Any, BaseException | None]:
        if key not in self._jobs:
            raise KeyError(f"rollout job {key!r} was never submitted")
        return self._jobs.pop(key)(), None

    def drain(self) -> None:
        """Nothing runs before it is taken."""

    def finished(self) -> dict[Any, tuple[Any, BaseException | None]]:
        return {}

    def close(self) -> None:
        self._jobs.clear()


class RolloutProducer:
    """One worker thread, a FIFO of keyed jobs, and the results (or exceptions) waiting to be taken.

    ``submit(key, job)`` queues ``job()``; ``take(key)`` blocks until it has run and returns
    ``(result, error)``: exactly one of them is ``None``. An exception a job raises is not raised on the worker
    thread: the training thread receives it from ``take`` and decides, together with the other ranks, how to stop.
    """

    def __init__(self, name: str = "rollout-producer") -> None:
        self._lock = threading.Condition()
        self._queue: list[tuple[Any, Callable[[], Any]]] = []
        self._running: Any = None  # the key of the job on the worker now
        self._done: dict[Any, tuple[Any, BaseException | None]] = {}
        self._closed = False
        #: seconds the training thread spent blocked in ``take`` and ``drain`` (the part of generation the update
        #: did not hide)
        self.waited_s = 0.0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # ---- the training thread's side ---------------------------------------------------------------------
    def submit(self, key: Any, job: Callable[[], Any]) -> None:
        with self._lock:
            if self._closed:
                raise ProducerClosed("the rollout producer is closed")
            if key in self._done or key == self._running or any(k == key for k, _ in self._queue):
                raise ValueError(f"rollout job {key!r} was already submitted")
            self._queue.append((key, job))
            self._lock.notify_all()

    def known(self, key: Any) -> bool:
        """Whether ``key`` is queued, running or done and not yet taken."""
        with self._lock:
            return key in self._done or key == self._running or any(k == key for k, _ in self._queue)

    def idle(self) -> bool:
        """Nothing queued or running: the worker has done all it was allowed to."""
        with self._lock:
            return not self._queue and self._running is None

    def take(self, key: Any) -> tuple[Any, BaseException | None]:
        """Wait for job ``key`` and hand its outcome over (it is forgotten afterwards)."""
        start = time.perf_counter()
        with self._lock:
            if not (key in self._done or key == self._running or any(k == key for k, _ in self._queue)):
                raise KeyError(f"rollout job {key!r} was never submitted")
            while key not in self._done:
                if self._closed:
                    raise ProducerClosed(f"the rollout producer was closed before job {key!r} finished")
                self._lock.wait()
            outcome = self._done.pop(key)
        self.waited_s += time.perf_counter() - start
        return outcome

    def drain(self) -> None:
        """Wait until every submitted job has run (their outcomes stay until taken). Called before each weight
        push, so that no batch handed over under the old weights is sampled with the new ones."""
        start = time.perf_counter()
        with self._lock:
            while (self._queue or self._running is not None) and not self._closed:
                self._lock.wait()
        self.waited_s += time.perf_counter() - start

    def finished(self) -> dict[Any, tuple[Any, BaseException | None]]:
        """The outcomes run but not yet taken, by key (a copy; call ``drain`` first for all of them)."""
        with self._lock:
            return dict(self._done)

    def close(self) -> None:
        """Stop after the job running now (if any); queued jobs are dropped and ``take`` stops waiting."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._lock.notify_all()

    # ---- the worker thread -------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                key, job = self._queue.pop(0)
                self._running = key
            try:
                outcome: tuple[Any, BaseException | None] = (job(), None)
            except BaseException as err:  # noqa: BLE001 (handed to the training thread, which raises it)
                outcome = (None, err)
            with self._lock:
                self._done[key] = outcome
                self._running = None
                self._lock.notify_all()
