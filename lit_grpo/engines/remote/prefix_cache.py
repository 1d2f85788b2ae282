"""Prefix-cache hits of rollout servers that report them: ``vllm serve``'s Prometheus counters.

vLLM (0.32, ``vllm/v1/metrics/loggers.py``) counts, per engine, the prompt tokens it looked up in its prefix cache
(``vllm:prefix_cache_queries``) and those it found there (``vllm:prefix_cache_hits``), exposed on ``GET /metrics``
as ``..._total`` counters. Their growth between two reads is the batch's hit rate: how much of what the server was
asked to prefill it already held, which sticky sessions exist to keep high (a later turn on the server that holds
its trajectory's earlier turns). The project's own server keeps no prefix cache and reports nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lit_grpo.wire.protocol import ServerError

#: the counters read, as Prometheus exposes them (summed over their label sets: one per engine)
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def prefix_cache_counters(metrics: str) -> tuple[float, float] | None:
    """``(hits, queries)`` from a Prometheus text exposition, each summed over its label sets; None when the text
    has neither counter (a server without a prefix cache, or another kind of server)."""
    totals = {HITS: 0.0, QUERIES: 0.0}
    seen = False
    for line in metrics.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            try:
                totals[name] += float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            seen = True
    return (totals[HITS], totals[QUERIES]) if seen else None


def counter_growth(before: tuple[float, float], after: tuple[float, float]) -> tuple[float, float]:
    """``(hits, queries)`` counted between two reads of the counters; a server that restarted in between (its
    counters went back) counts from zero, so its growth is the second read itself."""
    hits, queries = after[0] - before[0], after[1] - before[1]
    return after if hits < 0 or queries < 0 else (hits, queries)


class PrefixCacheMeter:
    """Each server's counters at the last read, and the hit rates since, hits over queries:
    ``server_<i>_prefix_cache_hit_rate`` per server and ``prefix_cache_hit_rate`` over all of them (a server
    without the counters, or that was queried nothing since, is left out)."""

    def __init__(self, read: Callable[[int], str | None], servers: int) -> None:
        self.read = read  # server index -> its /metrics text, None when it could not be read
        self.last: list[tuple[float, float] | None] = [None] * servers

    def take(self) -> dict[str, float]:
        stats: dict[str, float] = {}
        hits = queries = 0.0
        for server, before in enumerate(self.last):
            text = self.read(server)
            now = prefix_cache_counters(text) if text is not None else None
            if now is None:
                continue
            grown = counter_growth(before if before is not None else (0.0, 0.0), now)
            if grown[1] > 0:
                stats[f"server_{server}_prefix_cache_hit_rate"] = grown[0] / grown[1]
                hits, queries = hits + grown[0], queries + grown[1]
            self.last[server] = now
        if queries > 0:
            stats["prefix_cache_hit_rate"] = hits / queries
        return stats


def counters_of(servers: Sequence[object]) -> Callable[[int], str | None]:
    """A reader of each server's ``GET /metrics`` (``ServerConnection.client.text``); a failed read is None, so a
    metrics page that is down never fails a batch."""
    def read(index: int) -> str | None:
        try:
            return servers[index].client.text("GET", "/metrics")  # type: ignore[attr-defined]
        except ServerError:
            return None

    return read
