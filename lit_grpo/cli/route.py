"""``python -m lit_grpo route``: ``vllm-router`` (the optional extra ``router``) in front of several rollout servers,
started with what a GRPO trainer needs of it.

- ``--policy sticky_least_loaded``: a new session (``X-Session-ID``: the trainer names each multi-turn group) goes to
  the server holding the fewest sessions, its later turns to the same server, until the trainer's
  ``/finish_session``; requests without a session go to the least-loaded server.
- Retries and the circuit breaker off: a server pausing for a weight push answers 503, which must reach the trainer
  (it waits for ``/resume``); retried, five 503s open the breaker and the router moves a session's turns to another
  server, whose cache holds none of its prefix.
- Every route of the router authenticated: by default anyone who reaches it may ``/add_worker`` or ``/remove_worker``.
  Here the router accepts a request only when the servers' own token opens ``--validate-path`` (an authenticated
  route, ``GET /is_paused`` on the project's server, ``GET /v1/models`` on ``vllm serve --api-key``) on every live
  server; that token is then forwarded to the server that answers. The router asks one URL with each new token
  (and keeps the tokens it admitted), so that URL is :class:`TokenGate`, a listener on 127.0.0.1 in a child process
  (vllm-router's ``start`` holds Python's GIL while it runs, so a thread beside it would never answer), which asks
  every server: a token is valid when every server that answers accepts it (a 2xx); a server that does
  not answer (down, unreachable, past ``CHECK_TIMEOUT_S``) is skipped, and with none answering the token is refused.
  Asking the first server alone let a down first server refuse everyone, and one without a token admit everyone.
- It and its metrics listen on 127.0.0.1 unless ``--host`` says otherwise.

vllm-router 0.1.17's command line has no option for the validation (its Rust core has), so the router is started
from its Python package with its own defaults for everything else. Weight pushes, pause and resume do not go
through it: the trainer reaches every server directly (``data.engine_options.urls``), and sends completions to
``router_url``. The trainer also keeps the router's list of servers: one it finds down leaves it
(``/remove_worker``), and returns (``/add_worker``) only once a push reached it (``lit_grpo.engines.remote.fleet``).
"""

from __future__ import annotations

import argparse
import http.client
import multiprocessing
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

from lit_grpo.cli.commands import ToolParser
from lit_grpo.wire.protocol import LOOPBACK

#: the router's policies that keep a session on one server
POLICIES = ("sticky_least_loaded", "consistent_hash")
INSTALL_HINT = "pip install 'lit_grpo[router]' (vllm-router 0.1.17)"
#: seconds a server has to answer a token check; one that has not is down for that check
CHECK_TIMEOUT_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    parser = ToolParser(prog="python -m lit_grpo route",
                        description="Route completions over several rollout servers with vllm-router (sticky "
                                    "sessions, least-loaded; every route authenticated with the servers' token).")
    parser.add_argument("--servers", nargs="+", required=True, metavar="URL",
                        help="the rollout servers (http://HOST:PORT), the project's or vllm serve")
    parser.add_argument("--port", type=int, required=True, help="the router's TCP port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--metrics-port", type=int, default=29000, help="its Prometheus metrics' port (on --host)")
    parser.add_argument("--policy", default="sticky_least_loaded", choices=POLICIES)
    parser.add_argument("--validate-path", default="/is_paused",
                        help="an authenticated GET route of the servers, asked on every live server with each new "
                             "client token (default /is_paused, the project's server; /v1/models for vllm serve)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return parser


def check(args: argparse.Namespace) -> None:
    """One line naming the bad value, before the router's package is imported."""
    for url in args.servers:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--servers takes URLs like http://HOST:PORT, got {url!r}")
    if len(set(args.servers)) != len(args.servers):
        raise ValueError(f"--servers names a server twice: {args.servers}")
    for name in ("port", "metrics_port"):
        if not 0 < getattr(args, name) < 65536:
            raise ValueError(f"--{name.replace('_', '-')} must be a TCP port in 1..65535, got {getattr(args, name)}")
    if args.port == args.metrics_port:
        raise ValueError(f"--port and --metrics-port are both {args.port}; expected two ports")
    if not args.validate_path.startswith("/"):
        raise ValueError(f"--validate-path must be a route like /is_paused, got {args.validate_path!r}")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer of the server's own, not an acceptance: it is not followed elsewhere."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


#: no proxy from the environment (the servers are reached directly, as the trainer reaches them) and no redirects
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())


def server_verdict(url: str, authorization: str, timeout_s: float = CHECK_TIMEOUT_S) -> bool | None:
    """What the server route ``url`` says of a client's ``Authorization`` header, forwarded as it came: True for a
    2xx, False for any other answer (401, 403, a redirect, an error: the server is up and did not accept it), None
    when no answer came within ``timeout_s`` (refused, unreachable, reset, timed out: down, skipped)."""
    request = urllib.request.Request(url, headers={"Authorization": authorization})
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return 200 <= response.status < 300
    except urllib.error.HTTPError:
        return False
    except ValueError:  # a header value http.client refuses to send (a line break in it): not a token
        return False
    except (OSError, http.client.HTTPException):  # URLError, a refused or reset connection, a timeout, a bad reply
        return None


class TokenGate:
    """The router's one validation URL (``api_key_validation_urls``): a listener on 127.0.0.1 (a free port) whose
    ``GET`` answers 200 when a client's token opens ``validate_path`` on every server that answers (at least one),
    else 401. The servers are asked at once, each within ``timeout_s``. It tells whoever reaches it no more than a
    server's own authenticated route does."""

    def __init__(self, servers: Sequence[str], validate_path: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.urls = [url.rstrip("/") + validate_path for url in servers]
        self.timeout_s = timeout_s
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                status = 200 if gate.valid(self.headers.get("Authorization")) else 401
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:  # the router logs what it refuses
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/validate"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="token-gate", daemon=True)

    def valid(self, authorization: str | None) -> bool:
        """Whether every server that answers accepts ``authorization`` (a client's header): a server that is down is
        skipped, and with none answering, or no header, the token is refused."""
        if not authorization:
            return False
        with ThreadPoolExecutor(max_workers=len(self.urls)) as pool:
            verdicts = list(pool.map(lambda url: server_verdict(url, authorization, self.timeout_s), self.urls))
        answered = [verdict for verdict in verdicts if verdict is not None]
        return bool(answered) and all(answered)

    def start(self) -> TokenGate:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _serve_gate(servers: list[str], validate_path: str, timeout_s: float, conn: Connection) -> None:
    """The gate's process: a :class:`TokenGate` whose URL goes back through ``conn``, served until the route
    command's end of ``conn`` closes (the command stopped, or was killed: no gate outlives it)."""
    gate = TokenGate(servers, validate_path, timeout_s).start()
    conn.send(gate.url)
    try:
        conn.recv()  # nothing is ever sent: this returns (EOFError) when the other end is gone
    except EOFError:
        pass
    finally:
        gate.close()


def start_gate(servers: Sequence[str], validate_path: str, timeout_s: float = CHECK_TIMEOUT_S,
               ready_s: float = 60.0) -> tuple[multiprocessing.Process, Connection, str]:
    """A :class:`TokenGate` in a process of its own (spawned: the router's threads are not forked), its process, the
    connection that keeps it alive (close it, or exit, to stop it) and its URL."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=_serve_gate, args=(list(servers), validate_path, timeout_s, theirs),
                              name="lit_grpo-token-gate", daemon=True)
    process.start()
    theirs.close()
    if not ours.poll(ready_s):
        process.kill()
        raise RuntimeError(f"the route command's token gate did not start within {ready_s} s")
    return process, ours, ours.recv()


def router_kwargs(args: argparse.Namespace, validation_url: str) -> dict:
    """The keyword arguments of vllm-router's ``Router``: its command line's defaults, then ours; each new client
    token is checked at ``validation_url`` (a :class:`TokenGate`'s)."""
    from vllm_router.launch_router import parse_router_args
    from vllm_router.router import policy_from_str

    cli = ["--worker-urls", *args.servers, "--policy", args.policy, "--host", args.host, "--port", str(args.port),
           "--prometheus-host", args.host, "--prometheus-port", str(args.metrics_port), "--disable-retries",
           "--disable-circuit-breaker", "--log-level", args.log_level]
    router_args = parse_router_args(cli)
    router_args._validate_router_args()
    kwargs = dict(vars(router_args))
    kwargs.pop("mini_lb")
    kwargs.update(policy=policy_from_str(kwargs["policy"]), prefill_urls=None, decode_urls=None,
                  prefill_policy=policy_from_str(kwargs["prefill_policy"]),
                  decode_policy=policy_from_str(kwargs["decode_policy"]),
                  api_key_validation_urls=[validation_url])
    return kwargs


def main(argv: Sequence[str]) -> None:
    args = build_parser().parse_args(list(argv))
    check(args)
    try:
        from vllm_router.router import Router
    except ImportError as err:
        raise ValueError(f"the route command needs vllm-router: {INSTALL_HINT} ({err})") from None
    if args.host not in LOOPBACK:
        print(f"lit_grpo route: listening on {args.host}: anyone who reaches it and holds the servers' token may "
              "route, add or remove servers", flush=True)
    gate, alive, gate_url = start_gate(args.servers, args.validate_path)
    try:
        router = Router(**router_kwargs(args, gate_url))
        print(f"lit_grpo route: listening on http://{args.host}:{args.port} ({args.policy} over "
              f"{len(args.servers)} servers; each token checked against every live server)", flush=True)
        router.start()  # blocks until the process is stopped
    finally:
        alive.close()
        gate.join(timeout=5)
