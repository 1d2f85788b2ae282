"""The project's rollout server, started by ``python -m lit_grpo serve --model M --port P`` (its arguments and
entry: :mod:`lit_grpo.cli.serve`).

One process holds the rollout policy alpha (the transformers engine, on CPU or one GPU) behind HTTP and speaks
the protocol of ``lit_grpo.wire.protocol`` (a subset of ``vllm serve`` 0.33's), so the trainer's
``ServerEngine`` drives either server. ``RolloutServer`` holds the token, the limits and its route handlers, one
object each: ``GenerationRoutes`` (``serve.generation``: completions, pause), ``WeightReceiver``
(``serve.weight_receive``: the weight push, all or nothing; a LoRA adapter's push in ``serve.served_adapter``) and
``ReferenceRoutes`` (``serve.reference_routes``:
pi_ref's copy and log-probs, for ``data.reference_on_server``); the served policy they share is a
``ServedPolicy`` (``serve.served_policy``).

Security: binds 127.0.0.1 unless ``--host`` says otherwise; every route but ``/health`` needs
``Authorization: Bearer <token>`` (compared with ``hmac.compare_digest``); there is no default token: it is read
from ``--token-file`` or ``$LIT_GRPO_SERVER_TOKEN`` and the server refuses to start without one. Missing or
wrong token: 401 and nothing changes. Bodies over ``--max-body-bytes``: 413; more prompts, completions per
prompt or new tokens than the limits: 400. A client has ``--read-timeout`` seconds to send its whole request and
at most ``--max-connections`` are served at once (``serve.connections``). The weight bytes travel over
torch.distributed, which has no authentication: the group is joined only when an authenticated request names it.

Importing this module imports neither torch nor transformers (the served model is loaded by the command), so
``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import hmac
import json
import sys
import traceback
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from lit_grpo.serve.connections import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT_S,
    BoundedHTTPServer,
    DeadlineHandler,
)
from lit_grpo.serve.generation import GenerationRoutes
from lit_grpo.serve.reference_routes import ReferenceRoutes
from lit_grpo.serve.served_adapter import ServedAdapter
from lit_grpo.serve.served_policy import ServedPolicy
from lit_grpo.serve.weight_receive import WeightReceiver
from lit_grpo.wire import auth
from lit_grpo.wire.protocol import (
    MIN_TOKEN_CHARS,
    OPEN_ROUTES,
    ROUTES,
    HTTPFailure,
    Limits,
    error_payload,
)

DEFAULT_LIMITS = Limits()


class RolloutServer:
    """The server: the token, the limits, and its route handlers, which share the served policy (``policy``):
    ``generation`` (completions, pause), ``receiver`` (the weight push) and ``reference`` (the copy of pi_ref, made
    when the trainer first pushes one, and its log-probs). Thread-safe: HTTP requests are served on threads of their
    own."""

    def __init__(self, model: Any, tokenizer: Any, model_name: str, token: str, limits: Limits = DEFAULT_LIMITS,
                 reuse_buffers: bool = True, max_num_seqs: int | None = None) -> None:
        from lit_grpo.models.loading import eos_token_ids

        if not isinstance(token, str) or len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"the server token must be at least {MIN_TOKEN_CHARS} characters")
        self._token = token.encode()
        self.limits = limits
        self.policy = ServedPolicy(model)
        eos = eos_token_ids(tokenizer, model)
        pad = tokenizer.pad_token_id
        vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.generation = GenerationRoutes(self.policy, tokenizer, model_name, limits, eos,
                                           int(pad) if pad is not None else eos[0], vocab_size, max_num_seqs)
        self.adapter = ServedAdapter(self.policy)  # the LoRA adapter of model.lora, made at its first push
        self.reference = ReferenceRoutes(self.policy, vocab_size, limits, self.adapter)
        self.receiver = WeightReceiver(self.policy, self.reference, model_name, reuse_buffers, self.adapter)
        handlers = {**self.generation.handlers(), **self.receiver.handlers(), **self.reference.handlers()}
        self.routes: dict[tuple[str, str], Callable[[dict, dict], dict]] = {
            key: handlers[name] for key, name in ROUTES.items()}
        self.open_routes = set(OPEN_ROUTES)

    # ---- authentication -----------------------------------------------------------------------------
    def authorized(self, header: str | None) -> bool:
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer "):].strip().encode(), self._token)

    # ---- HTTP ---------------------------------------------------------------------------------------
    def handle(self, method: str, target: str, headers: Any, read_body: Callable[[int], bytes]) -> tuple[int, Any]:
        """One request: ``(status, JSON payload)``. The token and the size are checked before the body is read."""
        parts = urlsplit(target)
        path = parts.path.rstrip("/") or "/"
        key = (method, path)
        if key not in self.routes:
            allowed = [m for (m, p) in self.routes if p == path]
            if allowed:
                return 405, error_payload(405, f"{method} {path} is not allowed; use {allowed[0]}")
            return 404, error_payload(404, f"no route {path}")
        if key not in self.open_routes and not self.authorized(headers.get("Authorization")):
            return 401, error_payload(401, "missing or wrong token: send 'Authorization: Bearer <token>'")
        try:
            length = int(headers.get("Content-Length") or 0)
        except ValueError:
            return 400, error_payload(400, "bad Content-Length")
        if length < 0:
            return 400, error_payload(400, "bad Content-Length")
        if length > self.limits.max_body_bytes:
            return 413, error_payload(413, f"request body of {length} bytes is larger than this server's limit of "
                                           f"{self.limits.max_body_bytes} bytes (--max-body-bytes)")
        body: Any = {}
        if length:
            try:
                body = json.loads(read_body(length))
            except (ValueError, UnicodeDecodeError):
                return 400, error_payload(400, "the body is not valid JSON")
            if not isinstance(body, dict):
                return 400, error_payload(400, "the body must be a JSON object")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            return 200, self.routes[key](body, query)
        except HTTPFailure as err:
            return err.status, error_payload(err.status, err.message)
        except Exception as err:  # noqa: BLE001 (a bug must not take the server down)
            traceback.print_exc(file=sys.stderr)
            return 500, error_payload(500, f"{type(err).__name__}: {err}")


def make_http_server(server: RolloutServer, host: str, port: int, log_requests: bool = False,
                     read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
                     max_connections: int = DEFAULT_MAX_CONNECTIONS) -> ThreadingHTTPServer:
    """A threading HTTP server that hands every request to ``server.handle`` (one connection per request), reads
    each request within ``read_timeout_s`` and serves at most ``max_connections`` at once (``serve.connections``)."""

    class Handler(DeadlineHandler):
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

        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            # a request sent through a router names its multi-turn session: which server took which session
            session = self.headers.get("X-Session-ID") if self.headers is not None else None
            suffix = f" session={session}" if session else ""
            self.log_message('"%s" %s %s%s', self.requestline, str(code), str(size), suffix)

    return BoundedHTTPServer((host, port), Handler, read_timeout_s, max_connections)


def read_token(token_file: str | None) -> str:
    """The token from ``token_file``, ``$LIT_GRPO_SERVER_TOKEN_FILE`` or ``$LIT_GRPO_SERVER_TOKEN``
    (``lit_grpo.wire.auth.read_token``); a ``ValueError`` when there is none."""
    return auth.read_token(token_file)


if __name__ == "__main__":  # the entry is the command line's (lit_grpo.cli.serve): say where, in one line
    import sys

    print("error: start the rollout server with `python -m lit_grpo serve --model M --port P` (see --help)",
          file=sys.stderr)
    raise SystemExit(2)
