"""Sticky, least-loaded routing of multi-turn sessions over several rollout servers (``data.engine_options.urls``).

A multi-turn trajectory's later turns resend its whole conversation; a server that sampled its earlier turns may
still hold that prefix in its cache (vLLM's prefix cache), another server never does. So a session (the G trajectories
of one task, which share their prompt) goes to one server for its first turn, the one with the fewest sequences
bound to it, and every later turn of its trajectories goes there too, until the runner releases it when its last
trajectory ends. Consistent hashing alone was reported to drop prefix-cache hits from 98 % to 5 % (prime-rl issue
3255): the load is what picks a new session's server, the binding what keeps it there.

The load is this process's own: each trainer rank routes its own sessions. ``spread_stats`` is what the data module
logs per batch: the sequences each server was sent since the batch before (every turn's).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Sequence


class SessionRouter:
    """Which of ``servers`` servers each session's requests go to.

    ``route(sessions, rows)``: a bound session keeps its server and weighs ``rows`` now (its running trajectories);
    a new one, in the order given, binds to the server with the least weight bound to it (ties: the first from
    server ``first`` on, cyclically: each rank passes its own rank, so that ranks, which do not see each other's
    load, do not all start on the same server). ``release(sessions)`` unbinds them. Thread-safe: the asynchronous
    producer routes on its own thread."""

    def __init__(self, servers: int, first: int = 0) -> None:
        if isinstance(servers, bool) or not isinstance(servers, int) or servers < 1:
            raise ValueError(f"a session router needs at least one server, got {servers!r}")
        self.servers = servers
        self.first = int(first) % servers
        self._bound: dict[Hashable, tuple[int, int]] = {}  # session -> (server, its weight)
        self._load = [0] * servers
        self._sent = [0] * servers  # sequences sent to each server since the last ``take_sent``
        self._lock = threading.Lock()

    def route(self, sessions: Sequence[Hashable], rows: Sequence[int]) -> list[int]:
        """The server of each session (a session named twice in one call weighs the sum of its rows)."""
        if len(sessions) != len(rows):
            raise ValueError(f"route takes one row count per session, got {len(sessions)} sessions and {len(rows)} "
                             "counts")
        weights: dict[Hashable, int] = {}
        for session, count in zip(sessions, rows):
            weights[session] = weights.get(session, 0) + int(count)
        with self._lock:
            for session, weight in weights.items():
                server, old = self._bound.get(session, (None, 0))
                if server is None:
                    server = min(range(self.servers), key=lambda s: (self._load[s], (s - self.first) % self.servers))
                self._load[server] += weight - old
                self._bound[session] = (server, weight)
            chosen = [self._bound[s][0] for s in sessions]
            for server, count in zip(chosen, rows):
                self._sent[server] += int(count)
        return chosen

    def count_sent(self, server: int, sequences: int) -> None:
        """Count ``sequences`` sent to ``server`` outside any session (single-turn requests)."""
        with self._lock:
            self._sent[server] += int(sequences)

    def release(self, sessions: Iterable[Hashable]) -> None:
        """Unbind ``sessions`` (unknown ones are ignored: a failed turn may release before it routed)."""
        with self._lock:
            for session in sessions:
                server, weight = self._bound.pop(session, (None, 0))
                if server is not None:
                    self._load[server] -= weight

    def server_of(self, session: Hashable) -> int | None:
        with self._lock:
            bound = self._bound.get(session)
            return None if bound is None else bound[0]

    def load(self) -> list[int]:
        """The weight bound to each server now (running trajectories of the sessions it holds)."""
        with self._lock:
            return list(self._load)

    def take_sent(self) -> list[int]:
        """The sequences sent to each server since the last call (every turn's), and start counting again."""
        with self._lock:
            sent, self._sent = self._sent, [0] * self.servers
            return sent


def spread_stats(sent: Sequence[int]) -> dict[str, float]:
    """Per-server sequence counts as rollout statistics (logged under ``rollout/``): ``server_<i>_sequences`` (the
    mean over ranks) and ``server_load_ratio_max``, the busiest server's count over the mean count (1.0: an even
    spread; the worst rank's)."""
    stats = {f"server_{i}_sequences": float(c) for i, c in enumerate(sent)}
    total = sum(sent)
    stats["server_load_ratio_max"] = max(sent) * len(sent) / total if total else 1.0
    return stats
