"""The HTTP protocol between a trainer and a rollout server: routes, request and response shapes, the token,
the errors, and the JSON client. Both sides import it; it imports neither torch nor transformers.

The project's server (``python -m lit_grpo serve``) speaks the subset of ``vllm serve`` 0.33's protocol (dev mode,
``--weight-transfer-config``) that training needs, so the trainer's ``ServerEngine`` drives either server:

- ``POST /v1/completions``: ``prompt`` (``list[int]`` or ``list[list[int]]``), ``n``, ``seed``, ``temperature``,
  ``top_p``, ``max_tokens``, ``logprobs`` (``0``: the sampled token's), ``return_token_ids``,
  ``return_weight_versions``, ``stop_token_ids``. The response has vLLM's OpenAI completion shape for the fields
  used: ``choices[i]`` with ``index`` (prompt ``p``'s ``j``-th completion is ``p * n + j``), ``text``,
  ``token_ids``, ``prompt_token_ids``, ``logprobs.{tokens, token_logprobs, top_logprobs, text_offset}``,
  ``finish_reason`` (``stop`` / ``length``), ``stop_reason``, ``weight_versions`` (``[{version, start, end}]``),
  and ``usage``; plus a top-level ``weight_version`` (ours). Log-probs are ``log_softmax(logits / temperature)``
  over the whole vocabulary (vLLM's processed log-probs renormalise over the nucleus when ``top_p < 1``). The
  whole request is one seeded call of ``TransformersEngine.generate``: the same tokens and log-probs as the
  in-process engine on the same weights and seed.
- ``POST /pause?mode=abort|wait|keep`` (new requests get 503 until ``/resume``; ``keep`` parks the generations in
  flight at a token boundary, and they go on after ``/resume``, under the weights pushed meanwhile),
  ``POST /resume``, ``GET /is_paused``.
- ``GET /get_world_size`` (1), ``POST /init_weight_transfer_engine {"init_info": {master_address,
  master_port, rank_offset: 1, world_size: 2, backend: gloo|nccl, timeout_s, packed}}``,
  ``POST /shutdown_weight_transfer_engine``, ``POST /start_weight_update``,
  ``POST /update_weights {"update_info": {names, dtype_names, shapes, spans}}`` (the round format of
  ``lit_grpo.wire.push_format``, checked before anything is received: a malformed one is a 400 naming the bad
  entries; each span's bytes arrive over the group as one broadcast, see ``lit_grpo.wire.weight_transfer``),
  ``POST /finish_weight_update {"weight_version": v}``,
  ``POST /update_weight_version {"new_version": v}``, ``GET /weight_info``,
  ``POST /weight_checker {"action": "checksum" | "compare", "baseline": {...}}`` (SHA-256 of every parameter).
- ``GET /health`` (no token).

Every route but ``/health`` needs ``Authorization: Bearer <token>``; the token has no default and is read from a
file or ``$LIT_GRPO_SERVER_TOKEN`` (``TOKEN_ENV``; ``lit_grpo.wire.auth`` reads it). An error answer is
``{"error": {"message", "type", "code"}}`` (``error_payload``), the shape vLLM's server uses.
"""

from __future__ import annotations

import json
import secrets
import urllib.error
import urllib.request
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any
from urllib.parse import urlencode

from lit_grpo.wire.auth import MIN_TOKEN_CHARS, TOKEN_ENV  # noqa: F401 (the token's rules live in auth)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: fields of a completion request that change nothing here (vLLM accepts them too)
IGNORED_FIELDS = {"model", "user", "request_id", "skip_special_tokens", "spaces_between_special_tokens",
                  "include_stop_str_in_output", "detokenize", "priority"}
HANDLED_FIELDS = {"prompt", "n", "seed", "temperature", "top_p", "max_tokens", "logprobs", "return_token_ids",
                  "return_weight_versions", "return_tokens_as_token_ids", "stop_token_ids", "stream", "echo", "stop"}
#: flags that this server takes when false (or null) only: ``vllm-router`` 0.1.17 writes every one of them, false,
#: into each completion request it forwards, beside ``stream`` and ``echo``
OFF_FLAGS = ("stream", "echo", "ignore_eos", "no_stop_trim", "return_hidden_states")
#: vLLM's sampling fields beyond temperature and top_p that a model's generation config can fill when a request
#: leaves them unset (vLLM 0.32/0.33 ``ModelConfig.get_diff_sampling_param``), each at its neutral value: the one
#: that leaves ``softmax(logits / T)`` unchanged (``top_k`` 0: no cut). Trainers send all of them
#: (``lit_grpo.engines.sampling_fields``); this server takes them at these values only.
NEUTRAL_SAMPLING_FIELDS: dict[str, float | int] = {
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

#: every route of the project's server, ``(method, path)``, with the name of the handler that serves it (one of
#: ``RolloutServer``'s route handlers offers it)
ROUTES: dict[tuple[str, str], str] = {
    ("GET", "/health"): "health",
    ("POST", "/v1/completions"): "completions",
    ("POST", "/pause"): "pause",
    ("POST", "/resume"): "resume",
    ("GET", "/is_paused"): "is_paused",
    ("GET", "/get_world_size"): "get_world_size",
    ("POST", "/init_weight_transfer_engine"): "init_weight_transfer_engine",
    ("POST", "/shutdown_weight_transfer_engine"): "shutdown_weight_transfer_engine",
    ("POST", "/start_weight_update"): "start_weight_update",
    ("POST", "/update_weights"): "update_weights",
    ("POST", "/finish_weight_update"): "finish_weight_update",
    ("POST", "/update_weight_version"): "update_weight_version",
    ("GET", "/weight_info"): "weight_info",
    ("POST", "/weight_checker"): "weight_checker",
    ("POST", "/reference/logprobs"): "reference_logprobs",  # the project's server only (reference_routes)
}
#: the routes that need no token
OPEN_ROUTES = {("GET", "/health")}


class HTTPFailure(Exception):
    """A request that cannot be served (server side): its status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message


class ServerError(RuntimeError):
    """A rollout server could not be reached or answered with an error (client side); the message names its
    URL."""

    def __init__(self, message: str, status: int | None = None, lost: bool = False) -> None:
        super().__init__(message)
        self.status = status
        #: the connection was refused, reset or closed without an answer: the server is down or restarting (a
        #: timeout is not this: a slow server may still be working on the request)
        self.lost = lost


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (each has a ``--max-...`` flag)."""

    max_body_bytes: int = 16 * 2**20
    max_prompts: int = 256
    max_n: int = 64
    max_tokens: int = 4096
    max_prompt_tokens: int = 32768

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass
class CompletionRequest:
    """A checked ``/v1/completions`` body."""

    prompts: list[list[int]]
    n: int
    seed: int
    temperature: float
    top_p: float
    max_tokens: int
    logprobs: bool
    return_token_ids: bool
    return_weight_versions: bool
    token_id_strings: bool
    stop_token_ids: list[int]


def integer_field(body: dict, key: str, default: int | None, low: int, high: int | None = None,
                  what: str = "") -> int:
    """``body[key]`` as an integer in ``[low, high]`` (400 otherwise; ``what`` names the flag of the limit)."""
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPFailure(400, f"{key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise HTTPFailure(400, f"{key} must be {bound}{what}, got {value}")
    return value


def number_field(body: dict, key: str, default: float) -> float:
    """``body[key]`` as a float (``default`` when absent or null; 400 when not a number)."""
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HTTPFailure(400, f"{key} must be a number, got {value!r}")
    return float(value)


def flag_field(body: dict, key: str) -> bool:
    """``body[key]`` as a boolean (``False`` when absent or null; 400 otherwise)."""
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPFailure(400, f"{key} must be true or false, got {value!r}")
    return value


def parse_completion_request(body: dict, limits: Limits, vocab_size: int) -> CompletionRequest:
    """Check a ``/v1/completions`` body against what this server implements and its limits (400 otherwise)."""
    unknown = sorted(set(body) - HANDLED_FIELDS - set(OFF_FLAGS) - IGNORED_FIELDS - set(NEUTRAL_SAMPLING_FIELDS))
    if unknown:
        raise HTTPFailure(400, f"unsupported fields {unknown}: this server implements {sorted(HANDLED_FIELDS)}")
    for key, neutral in NEUTRAL_SAMPLING_FIELDS.items():
        value = body.get(key)
        if value is not None and (isinstance(value, bool) or value != neutral):
            raise HTTPFailure(400, f"unsupported value {key}={value!r}: this server samples softmax(logits / "
                                   f"temperature) with top_p only, so {key} must be {neutral} or absent")
    for key in OFF_FLAGS:
        if flag_field(body, key):
            raise HTTPFailure(400, f"{key}=true is not supported by this server")
    if body.get("stop") not in (None, [], ""):
        raise HTTPFailure(400, "stop strings are not supported by this server: pass stop_token_ids")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    else:
        raise HTTPFailure(400, "prompt must be a non-empty list of token ids or a non-empty list of such lists "
                               "(text prompts are not supported)")
    if len(prompts) > limits.max_prompts:
        raise HTTPFailure(400, f"{len(prompts)} prompts in one request, more than this server's limit of "
                               f"{limits.max_prompts} (--max-prompts)")
    for i, p in enumerate(prompts):
        if not p:
            raise HTTPFailure(400, f"prompt {i} is empty: every prompt needs at least one token")
        if len(p) > limits.max_prompt_tokens:
            raise HTTPFailure(400, f"prompt {i} has {len(p)} tokens, more than the limit of {limits.max_prompt_tokens}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in p):
            raise HTTPFailure(400, f"prompt {i} holds a value that is not a token id in [0, {vocab_size})")
    n = integer_field(body, "n", 1, 1, limits.max_n, " (--max-n)")
    max_tokens = integer_field(body, "max_tokens", 16, 1, limits.max_tokens, " (--max-tokens)")
    seed = body.get("seed")
    seed = secrets.randbits(62) if seed is None else integer_field(body, "seed", None, 0, 2**63 - 1)
    temperature = number_field(body, "temperature", 1.0)
    top_p = number_field(body, "top_p", 1.0)
    if not temperature > 0:
        raise HTTPFailure(400, f"temperature must be > 0 (greedy decoding is not supported), got {temperature}")
    if not 0 < top_p <= 1:
        raise HTTPFailure(400, f"top_p must lie in (0, 1], got {top_p}")
    logprobs = body.get("logprobs")
    if logprobs not in (None, 0) or isinstance(logprobs, bool):
        raise HTTPFailure(400, f"logprobs must be null or 0 (the sampled token's log-prob), got {logprobs!r}")
    stop = body.get("stop_token_ids") or []
    if not isinstance(stop, list) or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size
                                         for t in stop):
        raise HTTPFailure(400, f"stop_token_ids must be a list of token ids, got {stop!r}")
    return CompletionRequest(
        prompts=[[int(t) for t in p] for p in prompts], n=n, seed=seed, temperature=temperature, top_p=top_p,
        max_tokens=max_tokens, logprobs=logprobs == 0, return_token_ids=flag_field(body, "return_token_ids"),
        return_weight_versions=flag_field(body, "return_weight_versions"),
        token_id_strings=flag_field(body, "return_tokens_as_token_ids"), stop_token_ids=sorted(set(stop)),
    )


def error_payload(status: int, message: str) -> dict:
    """The body of an error answer (vLLM's shape)."""
    return {"error": {"message": message, "type": HTTPStatus(status).phrase, "code": status}}


def version_text(version: Any) -> str | None:
    """A ``weight_version`` as the text both sides compare (``None`` stays ``None``)."""
    return None if version is None else str(version)


class HTTPClient:
    """JSON over HTTP to one server, with a bearer token and a timeout on every call; no proxies. Any failure is a
    ``ServerError`` naming the server, the route and (for an error answer) the status and the server's message.
    ``request`` reads a JSON answer; ``text`` a plain-text one (``vllm serve``'s runtime LoRA routes answer
    ``Success: ...`` in plain text, and their errors in vLLM's JSON shape, which both read)."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def _send(self, method: str, path: str, body: dict | None, query: dict | None,
              timeout_s: float | None, extra_headers: dict[str, str] | None = None) -> tuple[bytes, str]:
        """The answer's bytes and ``where`` (server, method, route: what every message names)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        target = self.url + path + (f"?{urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        headers = {"Content-Type": "application/json", **(extra_headers or {})}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(target, data=data, headers=headers, method=method)
        where = f"rollout server {self.url}: {method} {path}"
        try:
            with self._opener.open(request, timeout=timeout) as response:
                return response.read(), where
        except urllib.error.HTTPError as err:
            raise ServerError(f"{where} returned {err.code}: {error_message(err)}", status=err.code) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            # http.client.RemoteDisconnected is a ConnectionResetError; a refused connection comes inside URLError
            lost = isinstance(reason, (ConnectionRefusedError, ConnectionResetError, BrokenPipeError))
            raise ServerError(f"{where} failed: {reason} (timeout {timeout:g} s)", lost=lost) from None

    def request(self, method: str, path: str, body: dict | None = None, query: dict | None = None,
                timeout_s: float | None = None, headers: dict[str, str] | None = None) -> dict:
        """The JSON answer (``{}`` for an empty one); ``headers``: sent besides the token's (a session's id)."""
        raw, where = self._send(method, path, body, query, timeout_s, headers)
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{where} answered with something that is not JSON: {raw[:200]!r}") from None

    def text(self, method: str, path: str, body: dict | None = None, query: dict | None = None,
             timeout_s: float | None = None) -> str:
        """The answer as text (undecodable bytes replaced)."""
        return self._send(method, path, body, query, timeout_s)[0].decode(errors="replace")

    def get(self, path: str, **kwargs: Any) -> dict:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: dict | None = None, **kwargs: Any) -> dict:
        return self.request("POST", path, body, **kwargs)


def error_message(err: urllib.error.HTTPError) -> str:
    """The message of an error answer: ours and vLLM's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``, or
    the HTTP reason."""
    try:
        payload = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return err.reason
    error = payload.get("error", payload.get("detail", payload)) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)
