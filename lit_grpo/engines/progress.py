"""How far a generation has come, for whoever shows it: the in-process engine reports the sequences it finished and
the tokens it decoded while it decodes (a remote engine, the sequences and tokens of the requests answered so far,
:func:`wait_reporting`), and a listener (the command line's progress bar, ``lit_grpo.cli.progress``)
shows them, so that a long rollout is not a frozen bar. Reports are at most one per :data:`INTERVAL_S` seconds per
generation, and cost nothing without a listener.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any

#: the least time between two reports of one generation
INTERVAL_S = 1.0


@dataclass(frozen=True)
class GenerationProgress:
    """``sequences_done`` of a request's ``sequences`` completions have finished; ``tokens`` decoded so far (every
    sequence's), after ``seconds``."""

    sequences_done: int
    sequences: int
    tokens: int
    seconds: float


Listener = Callable[[GenerationProgress], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def listen(listener: Listener) -> Callable[[], None]:
    """Call ``listener`` with each report from now on; returns the function that stops it."""
    with _lock:
        _listeners.append(listener)

    def stop() -> None:
        with _lock:
            if listener in _listeners:
                _listeners.remove(listener)

    return stop


class Reporter:
    """One generation's reports: :meth:`update` after each decode step, :meth:`done` at its end (reported only when
    an earlier report was, so the listener can clear what it shows)."""

    def __init__(self, sequences: int, interval_s: float | None = None) -> None:
        self.sequences = sequences
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.start = self.last = time.monotonic()
        self.reported = False

    def update(self, sequences_done: int, tokens: Callable[[], int]) -> None:
        """``tokens``: called only when a report is made (it may synchronise a device)."""
        if not _listeners:
            return
        now = time.monotonic()
        if now - self.last < self.interval_s:
            return
        self.last, self.reported = now, True
        self._send(GenerationProgress(sequences_done, self.sequences, tokens(), now - self.start))

    def done(self, tokens: Callable[[], int]) -> None:
        if self.reported and _listeners:
            self._send(GenerationProgress(self.sequences, self.sequences, tokens(), time.monotonic() - self.start))

    @staticmethod
    def _send(progress: GenerationProgress) -> None:
        with _lock:
            listeners = list(_listeners)
        for listener in listeners:
            listener(progress)


def wait_reporting(futures: Sequence[Future], sequences: int, count: Callable[[Any], tuple[int, int]]) -> list[Any]:
    """The results of ``futures`` in their order, reporting while they run: ``count(result)`` gives the sequences
    and tokens of each finished one, and a report comes at most once per interval even when none finished, so the
    time spent shows while a long request decodes on a server."""
    reporter = Reporter(sequences)
    done = [0, 0]  # sequences, tokens
    pending = set(futures)
    while pending:
        finished, pending = wait(pending, timeout=reporter.interval_s, return_when=FIRST_COMPLETED)
        for future in finished:
            if future.exception() is None:
                done_sequences, done_tokens = count(future.result())
                done[0], done[1] = done[0] + done_sequences, done[1] + done_tokens
        reporter.update(done[0], lambda: done[1])
    reporter.done(lambda: done[1])
    return [future.result() for future in futures]
