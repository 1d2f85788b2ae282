"""How one call's prompts are laid out in completion requests (``ServerEngine._requests``): the chunks of prompts
over the configured servers and their seeds (``contiguous_runs``, ``Request``), and how a completion's
``weight_versions`` spans are read back (``read_version_spans``). The layout depends on how many servers are
configured, never on how many are up (``lit_grpo.engines.remote.fleet``): a chunk keeps its seed on any server."""

from __future__ import annotations

from typing import Any, NamedTuple

from lit_grpo.engines.remote.connection import RouterConnection, ServerConnection
from lit_grpo.wire.protocol import ServerError, version_text

#: seeds of the chunks after the first when prompts are spread over several servers
CHUNK_SEED_STRIDE = 1_000_003
SEED_MODULUS = 2**62


class Request(NamedTuple):
    """One completion request of a call: where it goes, which of the call's prompts, its seed, and the session id
    a router keeps on one server (``X-Session-ID``)."""

    server: ServerConnection | RouterConnection
    indices: list[int]
    seed: int
    session: str | None = None


def contiguous_runs(prompts: int, servers: int, kind: str, first: int = 0) -> list[int]:
    """The chunk of each of ``prompts`` prompts spread over ``servers`` in contiguous runs: for the project's
    server, chunk ``c`` holds prompts ``c * P // k`` up to ``(c + 1) * P // k`` (``k = min(servers, P)``); for vLLM,
    prompt ``p`` is in chunk ``p * servers // P``. Chunk ``c`` goes to server ``(first + c) % servers``: each rank
    starts at a server of its own (``first`` = its rank), so ranks with fewer prompts than servers do not all send
    to the first one."""
    if kind == "vllm":
        chunks = [p * servers // prompts for p in range(prompts)]
    else:
        k = min(servers, prompts)
        chunks = [c for c in range(k) for _ in range(c * prompts // k, (c + 1) * prompts // k)]
    return [(first + c) % servers for c in chunks]


def read_version_spans(spans: Any, length: int, where: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A completion's ``weight_versions`` as ``Completion.versions`` and ``span_lengths``: the version of each span,
    and how many tokens each covered when there are several (``()`` for one span, the common case). Spans must cover
    the ``length`` tokens back to back from 0 when there are several (one span is taken to cover every token, as
    before partial rollouts: a ``with_adapter_versions`` label has no bounds); a ``ServerError`` otherwise."""
    if not spans:
        return (), ()
    if not isinstance(spans, list) or not all(isinstance(s, dict) for s in spans):
        raise ServerError(f"{where} returned weight_versions {spans!r}; expected a list of {{version, start, end}}")
    labels = tuple(version_text(s.get("version")) for s in spans)
    if len(spans) == 1:
        return labels, ()
    bounds = [(s.get("start"), s.get("end")) for s in spans]
    at = 0
    for start, end in bounds:
        if not isinstance(start, int) or not isinstance(end, int) or start != at or end < start:
            raise ServerError(f"{where} returned weight_versions spans {bounds} that do not cover the completion's "
                              f"{length} tokens back to back from 0")
        at = end
    if at != length:
        raise ServerError(f"{where} returned weight_versions spans {bounds} that do not cover the completion's "
                          f"{length} tokens back to back from 0")
    return labels, tuple(end - start for start, end in bounds)


__all__ = ["CHUNK_SEED_STRIDE", "SEED_MODULUS", "Request", "contiguous_runs", "read_version_spans"]
