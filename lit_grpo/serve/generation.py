"""The rollout server's generation routes: ``/v1/completions`` served by the server's one decode loop
(``serve.scheduler``), and the pause that keeps generation and a weight swap apart (``/pause``, ``/resume``,
``/is_paused``).

``/pause?mode=keep`` (partial rollouts) stops the generations in flight at a token boundary instead of waiting for
them or aborting them: a weight swap then runs while they wait, and after ``/resume`` they go on under the new
weights. Each completion then reports the versions that sampled its tokens as spans (``weight_versions``:
``[{version, start, end}, ...]``, vLLM's shape), cut at the decoding step at which the generation went on.

``GenerationRoutes`` is one of ``RolloutServer``'s route handlers (``lit_grpo.serve.server``); the served policy,
its version and the pause state are the ``ServedPolicy`` it is given. torch and transformers are imported only when
a request comes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lit_grpo.serve.scheduler import DecodeScheduler, SamplingKey, Starts
from lit_grpo.serve.served_policy import ServedPolicy
from lit_grpo.wire.protocol import CompletionRequest, HTTPFailure, Limits, parse_completion_request

#: ``/pause``'s modes: end the generations in flight, wait for them, or keep them at a token boundary (vLLM's three)
PAUSE_MODES = ("abort", "wait", "keep")


def make_version_spans(starts: Starts, row: int, length: int) -> list[dict]:
    """Row ``row``'s ``weight_versions`` (``[{version, start, end}]``) from its request's ``starts``, the row having
    ``length`` tokens: the spans of the versions that sampled at least one of its tokens, each ending where the next
    begins (a version it took up after its tokens ended, or one it never sampled under, not admitted yet, has
    none). An empty completion has one empty span, of the version the request started under."""
    begins = [(v, 0 if at is None else min(at[row], length)) for v, at in starts]
    ends = [s for _, s in begins[1:]] + [length]
    spans = [{"version": v, "start": s, "end": e} for (v, s), e in zip(begins, ends) if e > s]
    return spans or [{"version": begins[0][0], "start": 0, "end": 0}]


@dataclass(eq=False)
class GenerationRoutes:
    """The generation and pause routes of ``RolloutServer``: completions sampled from ``policy``'s model by the
    server's one decode loop (``scheduler``, a ``DecodeScheduler``: concurrent requests share its running batch, at
    most ``max_num_seqs`` rows at once), stopped at ``eos`` and the request's stop ids, padded with ``pad``, within
    ``limits``. Each request is a generation of ``ServedPolicy.generating`` for as long as the loop holds it, so a
    weight swap waits for it or for its park."""

    policy: ServedPolicy
    tokenizer: Any
    model_name: str
    limits: Limits
    eos: list[int]
    pad: int
    vocab_size: int
    #: rows decoding at once across the requests in flight (``--max-num-seqs``; None: all)
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        self.scheduler = DecodeScheduler(self.policy, self.pad, self.max_num_seqs)

    def handlers(self) -> dict[str, Callable[[dict, dict], dict]]:
        """Its routes' handlers by the names ``lit_grpo.wire.protocol.ROUTES`` gives them."""
        return {"health": self.health, "completions": self.completions, "pause": self.pause, "resume": self.resume,
                "is_paused": self.is_paused}

    def health(self, body: dict, query: dict) -> dict:
        return {}

    def completions(self, body: dict, query: dict) -> dict:
        request = parse_completion_request(body, self.limits, self.vocab_size)
        key = SamplingKey(float(request.temperature), float(request.top_p),
                          tuple(sorted(set(self.eos) | set(request.stop_token_ids))))
        with self.policy.generating() as (epoch, version):
            ticket = self.scheduler.submit(request.prompts, request.n, request.max_tokens, request.seed, key, epoch,
                                           version)
            ticket.done.wait()
        if ticket.failure is not None:
            raise HTTPFailure(*ticket.failure)
        return self._completion_response(request, ticket.completions(), ticket.starts)

    def _completion_response(self, request: CompletionRequest, groups: list, starts: Starts) -> dict:
        choices, completion_tokens = [], 0
        eos = set(self.eos)
        for p, group in enumerate(groups):
            for j, c in enumerate(group):
                ids = list(c.token_ids)
                completion_tokens += len(ids)
                stop_reason = ids[-1] if ids and not c.truncated and ids[-1] not in eos else None
                choice = {
                    "index": p * request.n + j,
                    "text": self.tokenizer.decode(ids, skip_special_tokens=True),
                    "logprobs": self._logprobs(ids, c.logprobs, request) if request.logprobs else None,
                    "finish_reason": "length" if c.truncated else "stop",
                    "stop_reason": stop_reason,
                    "token_ids": ids if request.return_token_ids else None,
                    "prompt_token_ids": request.prompts[p] if request.return_token_ids else None,
                    "weight_versions": (make_version_spans(starts, p * request.n + j, len(ids))
                                        if request.return_weight_versions else None),
                }
                choices.append(choice)
        prompt_tokens = sum(len(p) for p in request.prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "weight_version": starts[-1][0],  # the version the request ended under
        }

    def _logprobs(self, ids: list[int], logprobs: list[float], request: CompletionRequest) -> dict:
        if request.token_id_strings:
            tokens = [f"token_id:{t}" for t in ids]
        else:
            tokens = [str(t) for t in self.tokenizer.convert_ids_to_tokens(ids)]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        values = [float(v) for v in logprobs]
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": [{tok: v} for tok, v in zip(tokens, values)]}

    # ---- pause --------------------------------------------------------------------------------------
    def pause(self, body: dict, query: dict) -> dict:
        mode = query.get("mode", body.get("mode", "abort"))
        if mode not in PAUSE_MODES:
            raise HTTPFailure(400, f"pause mode {mode!r} is not supported; this server offers "
                                   f"{', '.join(repr(m) for m in PAUSE_MODES)}")
        self.policy.pause(abort=mode == "abort", keep=mode == "keep")
        return {"status": "paused"}

    def resume(self, body: dict, query: dict) -> dict:
        self.policy.resume()
        return {"status": "resumed"}

    def is_paused(self, body: dict, query: dict) -> dict:
        return {"is_paused": self.policy.paused}
