"""``python -m lit_grpo serve --model M --port P``: the project's rollout server.

One process holds the rollout policy alpha (the transformers engine, on CPU or one GPU) behind HTTP, and speaks
the subset of ``vllm serve`` 0.33's protocol (dev mode, ``--weight-transfer-config``) that training needs, so
the trainer's ``ServerEngine`` drives either server:

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
- ``POST /pause?mode=abort|wait`` (new requests get 503 until ``/resume``), ``POST /resume``, ``GET /is_paused``.
- ``GET /get_world_size`` (1), ``POST /init_weight_transfer_engine {"init_info": {master_address,
  master_port, rank_offset: 1, world_size: 2, backend: gloo|nccl, timeout_s, packed}}``,
  ``POST /shutdown_weight_transfer_engine``, ``POST /start_weight_update``,
  ``POST /update_weights {"update_info": {names, dtype_names, shapes}}`` (the bucket's bytes arrive over the
  group, see ``lit_grpo.weight_transfer``), ``POST /finish_weight_update {"weight_version": v}``,
  ``POST /update_weight_version {"new_version": v}``, ``GET /weight_info``,
  ``POST /weight_checker {"action": "checksum" | "compare", "baseline": {...}}`` (SHA-256 of every parameter).
- ``GET /health`` (no token).

A push is all or nothing: buckets are received into staging tensors and the model's parameters are switched to
them only at ``/finish_weight_update``, once every parameter has arrived, while no generation runs. A push cut
off anywhere before that (sender killed, bad bucket, timeout) is discarded and the server keeps its previous
weights and ``weight_version``; the next push starts from ``/init_weight_transfer_engine`` again.

Security: binds 127.0.0.1 unless ``--host`` says otherwise; every route but ``/health`` needs
``Authorization: Bearer <token>`` (compared with ``hmac.compare_digest``); there is no default token: it is read
from ``--token-file`` or ``$LIT_GRPO_SERVER_TOKEN`` and the server refuses to start without one. Missing or
wrong token: 401 and nothing changes. Bodies over ``--max-body-bytes``: 413; more prompts, completions per
prompt or new tokens than the limits: 400. The weight bytes travel over torch.distributed, which has no
authentication: the group is joined only when an authenticated request names it.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import secrets
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

TOKEN_ENV = "LIT_GRPO_SERVER_TOKEN"
MIN_TOKEN_CHARS = 16
LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: fields of a completion request that change nothing here (vLLM accepts them too)
IGNORED_FIELDS = {"model", "user", "request_id", "skip_special_tokens", "spaces_between_special_tokens",
                  "include_stop_str_in_output", "detokenize", "priority"}
HANDLED_FIELDS = {"prompt", "n", "seed", "temperature", "top_p", "max_tokens", "logprobs", "return_token_ids",
                  "return_weight_versions", "return_tokens_as_token_ids", "stop_token_ids", "stream", "echo", "stop"}


class HTTPFailure(Exception):
    """A request that cannot be served: its status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message


class Aborted(Exception):
    """A generation stopped by ``/pause?mode=abort``."""


@dataclass(frozen=True)
class Limits:
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


def _integer(body: dict, key: str, default: int | None, low: int, high: int | None = None, what: str = "") -> int:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise HTTPFailure(400, f"{key} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise HTTPFailure(400, f"{key} must be {bound}{what}, got {value}")
    return value


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HTTPFailure(400, f"{key} must be a number, got {value!r}")
    return float(value)


def _flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise HTTPFailure(400, f"{key} must be true or false, got {value!r}")
    return value


def parse_completion_request(body: dict, limits: Limits, vocab_size: int) -> CompletionRequest:
    """Check a ``/v1/completions`` body against what this server implements and its limits (400 otherwise)."""
    unknown = sorted(set(body) - HANDLED_FIELDS - IGNORED_FIELDS)
    if unknown:
        raise HTTPFailure(400, f"unsupported fields {unknown}: this server implements {sorted(HANDLED_FIELDS)}")
    for key in ("stream", "echo"):
        if _flag(body, key):
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
    n = _integer(body, "n", 1, 1, limits.max_n, " (--max-n)")
    max_tokens = _integer(body, "max_tokens", 16, 1, limits.max_tokens, " (--max-tokens)")
    seed = body.get("seed")
    seed = secrets.randbits(62) if seed is None else _integer(body, "seed", None, 0, 2**63 - 1)
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
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
        max_tokens=max_tokens, logprobs=logprobs == 0, return_token_ids=_flag(body, "return_token_ids"),
        return_weight_versions=_flag(body, "return_weight_versions"),
        token_id_strings=_flag(body, "return_tokens_as_token_ids"), stop_token_ids=sorted(set(stop)),
    )


class RolloutServer:
    """The server's state: the model, its ``weight_version``, the weight-transfer group, a push in progress and
    the pause flag. Thread-safe: HTTP requests are served on threads of their own."""

    def __init__(self, model: Any, tokenizer: Any, model_name: str, token: str, limits: Limits = Limits(),
                 reuse_buffers: bool = True) -> None:
        from lit_grpo.data.prompts import eos_token_ids

        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the server token must be at least {MIN_TOKEN_CHARS} characters")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._token = token.encode()
        self.limits = limits
        self.params = dict(model.named_parameters())
        self.eos = eos_token_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        self.pad = int(pad) if pad is not None else self.eos[0]
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.device = next(model.parameters()).device
        self.dtypes = sorted({str(p.dtype).split(".")[-1] for p in self.params.values() if p.is_floating_point()})
        self.cond = threading.Condition()
        self.paused = False
        self.in_flight = 0
        self.swapping = False
        self.abort_epoch = 0
        self.weight_version: str | None = None
        self.transfer_lock = threading.Lock()  # one weight-transfer call at a time
        self.group = None
        self.store = None
        self.backend = "gloo"
        self.packed = True
        self.transfer_timeout_s = 300.0  # the group's timeout, from /init_weight_transfer_engine
        self.staging: dict[str, Any] | None = None
        self.receiving = False  # inside a bucket's broadcast
        # Receive buffers kept across pushes (CPU only: fresh memory costs page faults as slow as the transfer;
        # the CUDA caching allocator reuses memory by itself). Bucket k of a push lands in a buffer of the same
        # announcement that does not back the parameters now, so a model has at most two sets of buffers.
        self.reuse_buffers = reuse_buffers
        self._pool: dict[tuple[str, ...], list[Any]] = {}
        self._live: set[int] = set()  # data pointers of the buffers the parameters point into
        self._push_buffers: list[tuple[tuple[str, ...], Any]] = []
        self.routes: dict[tuple[str, str], Callable[[dict, dict], dict]] = {
            ("GET", "/health"): self.health,
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/pause"): self.pause,
            ("POST", "/resume"): self.resume,
            ("GET", "/is_paused"): self.is_paused,
            ("GET", "/get_world_size"): lambda body, query: {"world_size": 1},
            ("POST", "/init_weight_transfer_engine"): self.init_weight_transfer_engine,
            ("POST", "/shutdown_weight_transfer_engine"): self.shutdown_weight_transfer_engine,
            ("POST", "/start_weight_update"): self.start_weight_update,
            ("POST", "/update_weights"): self.update_weights,
            ("POST", "/finish_weight_update"): self.finish_weight_update,
            ("POST", "/update_weight_version"): self.update_weight_version,
            ("GET", "/weight_info"): self.weight_info,
            ("POST", "/weight_checker"): self.weight_checker,
        }
        self.open_routes = {("GET", "/health")}

    # ---- authentication -----------------------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), self._token)

    # ---- generation ---------------------------------------------------------------------------------
    def health(self, body: dict, query: dict) -> dict:
        return {}

    @contextmanager
    def _generation(self):  # noqa: ANN202
        with self.cond:
            if self.paused:
                raise HTTPFailure(503, "generation is paused (a weight update is in progress); retry after /resume")
            while self.swapping:
                self.cond.wait()
            self.in_flight += 1
            epoch, version = self.abort_epoch, self.weight_version
        try:
            yield epoch, version
        finally:
            with self.cond:
                self.in_flight -= 1
                self.cond.notify_all()

    def _between_steps(self, epoch: int, done: bool) -> bool:
        if self.abort_epoch != epoch:
            raise Aborted
        return done

    def completions(self, body: dict, query: dict) -> dict:
        from lit_grpo.engines.base import SamplingConfig
        from lit_grpo.engines.transformers_engine import TransformersEngine

        request = parse_completion_request(body, self.limits, self.vocab_size)
        sampling = SamplingConfig(max_new_tokens=request.max_tokens, temperature=request.temperature,
                                  top_p=request.top_p)
        stops = sorted(set(self.eos) | set(request.stop_token_ids))
        engine = TransformersEngine(self.model, stops, self.pad, copy_weights=False, rescore=False)
        with self._generation() as (epoch, version):
            try:
                groups = engine.generate(request.prompts, request.n, sampling, request.seed,
                                         all_finished=lambda done: self._between_steps(epoch, done))
            except Aborted:
                raise HTTPFailure(503, "generation aborted by /pause; retry after /resume") from None
        return self._completion_response(request, groups, version)

    def _completion_response(self, request: CompletionRequest, groups: list, version: str | None) -> dict:
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
                    "weight_versions": ([{"version": version, "start": 0, "end": len(ids)}]
                                        if request.return_weight_versions else None),
                }
                choices.append(choice)
        prompt_tokens = sum(len(p) for p in request.prompts)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "weight_version": version,
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
        if mode not in ("abort", "wait"):
            raise HTTPFailure(400, f"pause mode {mode!r} is not supported; this server offers 'abort' and 'wait'")
        with self.cond:
            self.paused = True
            if mode == "abort":
                self.abort_epoch += 1
            while self.in_flight:
                self.cond.wait()
        return {"status": "paused"}

    def resume(self, body: dict, query: dict) -> dict:
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        return {"status": "resumed"}

    def is_paused(self, body: dict, query: dict) -> dict:
        return {"is_paused": self.paused}

    # ---- weight transfer ----------------------------------------------------------------------------
    @contextmanager
    def _transfer(self):  # noqa: ANN202
        if not self.transfer_lock.acquire(blocking=False):
            raise HTTPFailure(409, "another weight-transfer call is in progress")
        try:
            yield
        finally:
            self.transfer_lock.release()

    def _drop_transfer(self) -> None:
        from lit_grpo.weight_transfer import close_group

        close_group(self.group)
        self.group, self.store, self.staging = None, None, None

    def init_weight_transfer_engine(self, body: dict, query: dict) -> dict:
        import torch

        from lit_grpo.weight_transfer import BACKENDS, local_address_towards, open_group

        info = body.get("init_info")
        if not isinstance(info, dict):
            raise HTTPFailure(400, 'expected {"init_info": {...}}')
        address, port = info.get("master_address"), info.get("master_port")
        if not isinstance(address, str) or not address or isinstance(port, bool) or not isinstance(port, int):
            raise HTTPFailure(400, "init_info needs master_address (string) and master_port (integer)")
        if info.get("rank_offset", 1) != 1 or info.get("world_size") != 2:
            raise HTTPFailure(400, "this server is one process: init_info must have rank_offset 1 and world_size 2 "
                                   f"(got {info.get('rank_offset')}, {info.get('world_size')})")
        backend = info.get("backend", "gloo")
        if backend not in BACKENDS or (backend == "nccl" and self.device.type != "cuda"):
            raise HTTPFailure(400, f"backend {backend!r} is not available here; expected 'gloo'"
                                   + (" or 'nccl'" if self.device.type == "cuda" else " (the model is on the CPU)"))
        timeout_s = _number(info, "timeout_s", 300.0)
        if not 0 < timeout_s <= 3600:
            raise HTTPFailure(400, f"timeout_s must lie in (0, 3600], got {timeout_s}")
        packed = info.get("packed", True)
        if not isinstance(packed, bool):
            raise HTTPFailure(400, f"packed must be true or false, got {packed!r}")
        with self._transfer():
            self._drop_transfer()
            import datetime

            try:
                store = torch.distributed.TCPStore(address, port, 2, False, datetime.timedelta(seconds=timeout_s))
                with self._on_device():
                    group = open_group(store, 1, 2, backend, timeout_s, local_address_towards(address))
            except Exception as err:  # noqa: BLE001 (any failure to join is reported, the server stays up)
                raise HTTPFailure(502, f"could not join the weight-transfer group at {address}:{port}: {err}") from err
            self.group, self.store, self.backend, self.packed = group, store, backend, packed
            self.transfer_timeout_s = timeout_s
        return {"message": "Weight transfer initialized"}

    def shutdown_weight_transfer_engine(self, body: dict, query: dict) -> dict:
        with self._transfer():
            self._drop_transfer()
        return {"message": "Weight transfer shut down"}

    def start_weight_update(self, body: dict, query: dict) -> dict:
        with self._transfer():
            if self.group is None:
                raise HTTPFailure(409, "no weight-transfer group: POST /init_weight_transfer_engine first")
            self.staging = {}
            self._push_buffers = []
        return {"message": "Weight update started"}

    def _announced(self, body: dict) -> tuple[list[str], list, list[list[int]]]:
        from lit_grpo.weight_transfer import DTYPES

        info = body.get("update_info")
        if not isinstance(info, dict):
            raise HTTPFailure(400, 'expected {"update_info": {"names": [...], "dtype_names": [...], "shapes": [...]}}')
        names, dtype_names, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
        if not isinstance(names, list) or not names:
            raise HTTPFailure(400, "update_info.names must be a non-empty list (this server does not reuse the "
                                   "previous call's metadata)")
        if not isinstance(dtype_names, list) or not isinstance(shapes, list) or not (
                len(names) == len(dtype_names) == len(shapes)):
            raise HTTPFailure(400, "update_info needs names, dtype_names and shapes of the same length")
        dtypes = []
        for name, dtype, shape in zip(names, dtype_names, shapes):
            param = self.params.get(name) if isinstance(name, str) else None
            if param is None:
                raise HTTPFailure(400, f"unknown parameter {name!r} (this server's model is {self.model_name})")
            if name in self.staging:
                raise HTTPFailure(400, f"parameter {name!r} was already sent in this update")
            if DTYPES.get(dtype) != param.dtype:
                raise HTTPFailure(400, f"parameter {name!r} announced as {dtype!r}; the server holds "
                                       f"{str(param.dtype).split('.')[-1]}: cast before sending")
            if not isinstance(shape, list) or list(param.shape) != shape:
                raise HTTPFailure(400, f"parameter {name!r} announced with shape {shape}, the server's is "
                                       f"{list(param.shape)}")
            dtypes.append(param.dtype)
        return names, dtypes, shapes

    def update_weights(self, body: dict, query: dict) -> dict:
        import torch

        from lit_grpo.weight_transfer import nbytes, unpack, wait_work

        with self._transfer():
            if self.staging is None or self.group is None:
                raise HTTPFailure(409, "no weight update in progress: POST /start_weight_update first")
            try:
                names, dtypes, shapes = self._announced(body)
            except HTTPFailure as err:
                # the sender's broadcast of this bucket is already under way and will never be read: the group
                # is out of step, so it goes, and with it the partial update
                self._drop_transfer()
                raise HTTPFailure(err.status, f"{err.message}; the update is discarded (weight version stays "
                                              f"{self.weight_version!r}) and the transfer group is closed") from None
            device = self.transfer_device()
            self.receiving = True
            try:
                with self._on_device():
                    if self.packed:
                        total = sum(nbytes(d, s) for d, s in zip(dtypes, shapes))
                        buffer = self._receive_buffer(tuple(names), total, device)
                        wait_work(self.group.broadcast(buffer, root=0), self.transfer_timeout_s)
                        tensors = unpack(buffer, dtypes, shapes)
                    else:
                        tensors = []
                        for dtype, shape in zip(dtypes, shapes):
                            tensors.append(torch.empty(shape, dtype=dtype, device=device))
                            wait_work(self.group.broadcast(tensors[-1], root=0), self.transfer_timeout_s)
            except Exception as err:  # noqa: BLE001 (sender gone, timeout: the update is dropped, the server lives)
                self._drop_transfer()
                raise HTTPFailure(500, f"receiving the bucket failed ({err}); the update is discarded (weight version "
                                       f"stays {self.weight_version!r}) and the transfer group is closed") from err
            finally:
                self.receiving = False
            for name, tensor in zip(names, tensors):
                self.staging[name] = tensor.to(self.device)
        return {"message": "Weights updated"}

    def transfer_device(self) -> Any:
        """Where the bytes of a push arrive: the CPU over gloo, this server's own CUDA device over NCCL (not the
        handler thread's current device, which is cuda:0 whatever ``--device`` says)."""
        from lit_grpo.weight_transfer import transport_device

        return transport_device(self.backend, self.device)

    @contextmanager
    def _on_device(self) -> Any:
        """Make the server's CUDA device current in this handler thread (NCCL and the caching allocator use the
        current device for what is not given one); nothing on the CPU."""
        if self.device.type != "cuda":
            yield
            return
        import torch

        with torch.cuda.device(self.device):
            yield

    def _receive_buffer(self, key: tuple[str, ...], total: int, device: Any) -> Any:
        import torch

        if not self.reuse_buffers or device.type != "cpu":
            return torch.empty(total, dtype=torch.uint8, device=device)
        pool = self._pool.setdefault(key, [])
        free = [b for b in pool if b.numel() == total and b.data_ptr() not in self._live]
        if free:
            buffer = free[0]
        else:
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            pool.append(buffer)
        self._push_buffers.append((key, buffer))
        return buffer

    def finish_weight_update(self, body: dict, query: dict) -> dict:
        version = body.get("weight_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise HTTPFailure(400, f"weight_version must be a string, got {version!r}")
        with self._transfer():
            if self.staging is None:
                raise HTTPFailure(409, "no weight update in progress: POST /start_weight_update first")
            missing = sorted(set(self.params) - set(self.staging))
            if missing:
                got = len(self.staging)
                self.staging = None
                raise HTTPFailure(400, f"the update covered {got} of {len(self.params)} parameters (missing e.g. "
                                       f"{missing[:3]}); it is discarded and the weight version stays "
                                       f"{self.weight_version!r}")
            staged, self.staging = self.staging, None
            with self.cond:
                self.swapping = True
                while self.in_flight:
                    self.cond.wait()
                try:
                    for name, tensor in staged.items():
                        self.params[name].data = tensor
                    self._live = {buffer.data_ptr() for _, buffer in self._push_buffers}
                    used = {key for key, _ in self._push_buffers}
                    self._pool = {key: buffers for key, buffers in self._pool.items() if key in used}
                    if version is not None:
                        self.weight_version = str(version)
                finally:
                    self.swapping = False
                    self.cond.notify_all()
        return {"message": "Weight update finished", "weight_version": self.weight_version}

    def update_weight_version(self, body: dict, query: dict) -> dict:
        version = body.get("new_version")
        if isinstance(version, bool) or not isinstance(version, (str, int)):
            raise HTTPFailure(400, f"new_version must be a string, got {version!r}")
        with self.cond:
            self.weight_version = str(version)
        return {"success": True, "new_version": self.weight_version}

    def weight_info(self, body: dict, query: dict) -> dict:
        staging = self.staging
        return {"weight_version": self.weight_version, "model": self.model_name, "dtypes": self.dtypes,
                "device": str(self.device), "num_parameters": len(self.params), "updating": staging is not None,
                "staged_parameters": len(staging) if staging is not None else 0, "receiving": self.receiving,
                "paused": self.paused,
                "transfer_group": self.group is not None}

    def weight_checker(self, body: dict, query: dict) -> dict:
        from lit_grpo.weight_transfer import checksum

        action = body.get("action")
        if action not in ("checksum", "compare"):
            raise HTTPFailure(400, f"action must be 'checksum' or 'compare', got {action!r}")
        with self.cond:  # not while a swap runs
            while self.swapping:
                self.cond.wait()
            sums = {name: checksum(p) for name, p in self.params.items()}
        if action == "checksum":
            return {"checksums": sums}
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            raise HTTPFailure(400, "action='compare' requires a 'baseline' object")
        mismatches = sorted(k for k in sums.keys() | baseline.keys() if sums.get(k) != baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches}

    # ---- HTTP ---------------------------------------------------------------------------------------
    def handle(self, method: str, target: str, headers: Any, read_body: Callable[[int], bytes]) -> tuple[int, Any]:
        """One request: ``(status, JSON payload)``. The token and the size are checked before the body is read."""
        parts = urlsplit(target)
        path = parts.path.rstrip("/") or "/"
        key = (method, path)
        if key not in self.routes:
            allowed = [m for (m, p) in self.routes if p == path]
            if allowed:
                return 405, _error(405, f"{method} {path} is not allowed; use {allowed[0]}")
            return 404, _error(404, f"no route {path}")
        if key not in self.open_routes and not self.authorized(headers.get("Authorization")):
            return 401, _error(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
        try:
            length = int(headers.get("Content-Length") or 0)
        except ValueError:
            return 400, _error(400, "bad Content-Length")
        if length < 0:
            return 400, _error(400, "bad Content-Length")
        if length > self.limits.max_body_bytes:
            return 413, _error(413, f"request body of {length} bytes is larger than this server's limit of "
                                    f"{self.limits.max_body_bytes} bytes (--max-body-bytes)")
        body: Any = {}
        if length:
            try:
                body = json.loads(read_body(length))
            except (ValueError, UnicodeDecodeError):
                return 400, _error(400, "the body is not valid JSON")
            if not isinstance(body, dict):
                return 400, _error(400, "the body must be a JSON object")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            return 200, self.routes[key](body, query)
        except HTTPFailure as err:
            return err.status, _error(err.status, err.message)
        except Exception as err:  # noqa: BLE001 (a bug must not take the server down)
            traceback.print_exc(file=sys.stderr)
            return 500, _error(500, f"{type(err).__name__}: {err}")


def _error(status: int, message: str) -> dict:
    return {"error": {"message": message, "type": HTTPStatus(status).phrase, "code": status}}


def make_http_server(server: RolloutServer, host: str, port: int, log_requests: bool = False) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        server_version = "lit_grpo-rollout-server"

        def _serve(self, method: str) -> None:
            status, payload = server.handle(method, self.path, self.headers, self.rfile.read)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", "Bearer")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.close_connection = True

        def do_GET(self) -> None:  # noqa: N802
            self._serve("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._serve("POST")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            if log_requests:
                super().log_message(format, *args)

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    return httpd


def read_token(token_file: str | None) -> str:
    """The token from ``token_file`` or ``$LIT_GRPO_SERVER_TOKEN``; a ``ValueError`` when there is none."""
    if token_file:
        with open(os.path.expanduser(token_file)) as f:
            token = f.read().strip()
        where = f"token file {token_file}"
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
        where = f"${TOKEN_ENV}"
    if not token:
        raise ValueError(f"no token: the rollout server needs one, from --token-file or ${TOKEN_ENV} (for example "
                         "`python -c 'import secrets; print(secrets.token_hex(32))' > token`); it has no default")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the token in {where} has {len(token)} characters; use at least {MIN_TOKEN_CHARS}")
    return token


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # raised for the CLI to print as one line
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m lit_grpo serve",
        description="Serve rollouts of a causal LM over HTTP (vLLM 0.33's protocol subset) and take weight pushes "
                    "from a lit_grpo trainer (`data.engine: server`).")
    parser.add_argument("--model", required=True, help="model alias, local directory or Hub id (as model.model_name)")
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one (printed at start)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--token-file", default=None, help=f"file holding the bearer token (else ${TOKEN_ENV})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts, help="prompts per request")
    parser.add_argument("--max-n", type=int, default=Limits.max_n, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=Limits.max_tokens, help="new tokens per completion")
    parser.add_argument("--no-buffer-reuse", action="store_true",
                        help="allocate fresh receive buffers for every push (default on CPU: keep two sets)")
    parser.add_argument("--log-requests", action="store_true", help="log every request to stderr")
    return parser


def main(argv: Sequence[str]) -> None:
    """The ``serve`` subcommand: check the arguments and the token (before loading anything), then serve until
    interrupted. Errors are raised as ``ValueError`` / ``OSError`` for the CLI to print."""
    args = build_parser().parse_args(list(argv))
    token = read_token(args.token_file)
    limits = Limits(args.max_body_bytes, args.max_prompts, args.max_n, args.max_tokens)
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}")
    import torch

    from lit_grpo.models import load_model_and_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else torch.device(
        args.device)
    if args.host not in LOOPBACK:
        print(f"warning: binding {args.host}: the token guards HTTP, but the weight bytes travel over "
              "torch.distributed, which is not authenticated; keep the network private", file=sys.stderr)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    server = RolloutServer(model.to(device), tokenizer, args.model, token, limits,
                           reuse_buffers=not args.no_buffer_reuse)
    httpd = make_http_server(server, args.host, args.port, args.log_requests)
    host, port = httpd.server_address[:2]
    print(f"lit_grpo rollout server: {args.model} ({args.dtype}, {device}) listening on http://{host}:{port}",
          flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
