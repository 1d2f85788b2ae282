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
  route, ``GET /is_paused`` on the project's server, ``GET /v1/models`` on ``vllm serve --api-key``) on the first
  server; that token is then forwarded to the server that answers.
- It and its metrics listen on 127.0.0.1 unless ``--host`` says otherwise.

vllm-router 0.1.17's command line has no option for the validation (its Rust core has), so the router is started
from its Python package with its own defaults for everything else. Weight pushes, pause and resume do not go
through it: the trainer reaches every server directly (``data.engine_options.urls``), and sends completions to
``router_url``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from urllib.parse import urlsplit

from lit_grpo.cli.commands import ToolParser
from lit_grpo.wire.protocol import LOOPBACK

#: the router's policies that keep a session on one server
POLICIES = ("sticky_least_loaded", "consistent_hash")
INSTALL_HINT = "pip install 'lit_grpo[router]' (vllm-router 0.1.17)"


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
                        help="an authenticated GET route of the first server that the router asks with each new "
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


def router_kwargs(args: argparse.Namespace) -> dict:
    """The keyword arguments of vllm-router's ``Router``: its command line's defaults, then ours."""
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
                  api_key_validation_urls=[args.servers[0].rstrip("/") + args.validate_path])
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
    router = Router(**router_kwargs(args))
    print(f"lit_grpo route: listening on http://{args.host}:{args.port} ({args.policy} over "
          f"{len(args.servers)} servers)", flush=True)
    router.start()  # blocks until the process is stopped
