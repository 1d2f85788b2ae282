"""Bookkeeping of asynchronous off-policy GRPO (``data.max_staleness`` = K): which setups allow it (and
``data.reference_on_server``, ``data.partial_rollouts``), the weight version each completion (with partial rollouts:
each token) was sampled with, how stale a batch is, and generated batches as checkpoint data."""

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


def check_partial_rollouts(partial_rollouts: bool, max_staleness: int, engine: str,
                           reference_on_server: bool = False) -> None:
    """``partial_rollouts`` (a push keeps the generations in flight) needs asynchronous rollouts from a server: with
    K = 0 nothing is in flight when the trainer pushes, and an in-process engine shares the trainer's thread. Not with
    ``reference_on_server``, whose pi_ref label relies on pushes waiting for the producer's scoring jobs."""
    if not isinstance(partial_rollouts, bool):
        raise ValueError(f"partial_rollouts must be true or false, got {partial_rollouts!r}")
    if not partial_rollouts:
        return
    if max_staleness < 1 or engine != "server":
        raise ValueError(f"partial_rollouts: true needs max_staleness >= 1 and engine: server (a push then keeps the "
                         f"server's generations in flight); got max_staleness={max_staleness}, engine {engine!r}")
    if reference_on_server:
        raise ValueError("partial_rollouts: true and reference_on_server: true cannot go together: pushes of pi_ref "
                         "must wait for the scoring in flight; turn one off")


def token_versions(completion: Completion) -> list[int]:
    """The weight version (an optimizer step) that sampled each token of ``completion``: ``versions`` expanded by
    ``span_lengths``. Without them one version covers every token: the oldest, should several be listed (a bound
    that never understates staleness)."""
    versions = [int(v) for v in completion.versions]
    if not completion.span_lengths:
        return [weight_version_of(completion)] * len(completion.token_ids)
    if len(completion.span_lengths) != len(versions) or sum(completion.span_lengths) != len(completion.token_ids):
        raise ValueError(f"span_lengths {completion.span_lengths} do not match versions {completion.versions} and "
                         f"{len(completion.token_ids)} tokens")
    return [v for v, n in zip(versions, completion.span_lengths) for _ in range(n)]


def mixes_versions(groups: Sequence[Sequence[Completion]]) -> bool:
    """Whether the batch's tokens were sampled by more than one weight version (within a completion, or between
    them): then no single set of weights is alpha, and alpha must be the sampler's per-token log-probs."""
    return len({v for g in groups for c in g for v in c.versions}) > 1


def token_staleness(versions: Sequence[int], step: int) -> tuple[float, float]:
    """Mean and max of ``step - version`` over the tokens' ``versions`` (``(0, 0)`` for none)."""
    if not versions:
        return 0.0, 0.0
    return sum(step - v for v in versions) / len(versions), float(step - min(versions))


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
    """Staleness of a batch trained at optimizer ``step``: ``step - version`` per completion (its oldest token's),
    mean and max; per token the model sampled (``token_staleness_mean`` / ``_max``: with partial rollouts a
    completion's later tokens are younger); and how many completions span more than one version
    (``mixed_versions``; 0 when pushes wait for generation)."""
    completions = [c for g in groups for c in g]
    stale = [step - weight_version_of(c) for c in completions]
    sampled = [v for c in completions for v, m in zip(token_versions(c), c.mask or [1] * len(c.token_ids)) if m]
    token_mean, token_max = token_staleness(sampled, step)
    return {"staleness_mean": sum(stale) / len(stale), "staleness_max": float(max(stale)),
            "token_staleness_mean": token_mean, "token_staleness_max": token_max,
            "mixed_versions": float(sum(len(set(c.versions)) > 1 for c in completions))}


def groups_to_state(groups: Sequence[Sequence[Completion]]) -> list[list[dict[str, Any]]]:
    """Completions as plain lists and numbers (what a checkpoint loads without unpickling code)."""
    return [[{"token_ids": list(c.token_ids), "logprobs": [float(x) for x in c.logprobs], "truncated": c.truncated,
              "versions": list(c.versions), **({"span_lengths": list(c.span_lengths)} if c.span_lengths else {}),
              **({"mask": list(c.mask), "trajectory": c.trajectory} if c.mask is not None else {})}
             for c in group] for group in groups]


def groups_from_state(state: Sequence[Sequence[dict[str, Any]]]) -> list[list[Completion]]:
    """``groups_to_state``'s inverse; a checkpoint written before partial rollouts has no ``span_lengths``."""
    return [[Completion([int(t) for t in c["token_ids"]], [float(x) for x in c["logprobs"]], bool(c["truncated"]),
                        tuple(str(v) for v in c["versions"]),
                        tuple(int(m) for m in c["mask"]) if "mask" in c else None, c.get("trajectory"),
                        tuple(int(n) for n in c.get("span_lengths", ())))
             for c in group] for group in state]
