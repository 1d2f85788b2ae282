"""Bookkeeping of asynchronous off-policy GRPO (``data.max_staleness`` = K): which setups allow it (and
``data.reference_on_server``), the weight version each completion was sampled with, how stale a batch is, and
generated batches as checkpoint data."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lit_grpo.engines.base import Completion


def check_staleness_setup(max_staleness: int, engine: str, callbacks: Iterable[Any] = ()) -> None:
    """Refuse settings asynchronous rollouts cannot honour, before anything is loaded."""
    if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
        raise ValueError(f"max_staleness (K) must be an integer >= 0, got {max_staleness!r}")
    if max_staleness == 0:
        return
    if engine != "server":
        raise ValueError(
            f"max_staleness={max_staleness} needs data.engine: server (a rollout server generates the next batches "
            f"while the trainer updates); engine {engine!r} runs in the trainer's process and stays synchronous: "
            "use max_staleness: 0 with it")
    for callback in callbacks:
        if getattr(callback, "delay_batches", 0):
            raise ValueError(
                f"max_staleness={max_staleness} and WeightSync(delay_batches={callback.delay_batches}) both make "
                "rollouts lag; asynchronous rollouts already sample ahead of the trainer: use one of the two")


def check_reference_on_server(reference_on_server: bool, engine: str, server_kind: str | None) -> None:
    """``reference_on_server`` needs the project's rollout server (vLLM serves one model: the rollout policy);
    ``server_kind`` is ``data.engine_options.kind`` of a server engine."""
    if not isinstance(reference_on_server, bool):
        raise ValueError(f"reference_on_server must be true or false, got {reference_on_server!r}")
    if not reference_on_server:
        return
    if engine != "server" or server_kind != "lit_grpo":
        where = f"engine {engine!r}" if engine != "server" else f"a server of kind {server_kind!r}"
        raise ValueError(f"reference_on_server: true needs data.engine: server with the project's rollout server "
                         f"(python -m lit_grpo serve), which can hold a copy of pi_ref; got {where}")


def weight_version_of(completion: Completion) -> int:
    """The oldest weight version (an optimizer step) among the completion's token spans."""
    if not completion.versions:
        raise ValueError("a completion of an asynchronous rollout carries no weight version; the rollout server "
                         "must report weight_versions (return_weight_versions)")
    try:
        return min(int(v) for v in completion.versions)
    except (TypeError, ValueError):
        raise ValueError(f"weight versions {completion.versions!r} are not optimizer steps; was the server's "
                         "weight pushed by another trainer?") from None


def staleness_stats(groups: Sequence[Sequence[Completion]], step: int) -> dict[str, float]:
    """Staleness of a batch trained at optimizer ``step``: ``step - version`` per completion, mean and max, and
    how many completions span more than one version (``mixed_versions``; 0 when pushes wait for generation)."""
    completions = [c for g in groups for c in g]
    stale = [step - weight_version_of(c) for c in completions]
    return {"staleness_mean": sum(stale) / len(stale), "staleness_max": float(max(stale)),
            "mixed_versions": float(sum(len(set(c.versions)) > 1 for c in completions))}


def groups_to_state(groups: Sequence[Sequence[Completion]]) -> list[list[dict[str, Any]]]:
    """Completions as plain lists and numbers (what a checkpoint loads without unpickling code)."""
    return [[{"token_ids": list(c.token_ids), "logprobs": [float(x) for x in c.logprobs], "truncated": c.truncated,
              "versions": list(c.versions),
              **({"mask": list(c.mask), "trajectory": c.trajectory} if c.mask is not None else {})}
             for c in group] for group in groups]


def groups_from_state(state: Sequence[Sequence[dict[str, Any]]]) -> list[list[Completion]]:
    return [[Completion([int(t) for t in c["token_ids"]], [float(x) for x in c["logprobs"]], bool(c["truncated"]),
                        tuple(str(v) for v in c["versions"]),
                        tuple(int(m) for m in c["mask"]) if "mask" in c else None, c.get("trajectory"))
             for c in group] for group in state]
