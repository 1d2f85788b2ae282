"""``python -m lit_grpo serve``: the rollout server's arguments and entry (the server is :mod:`lit_grpo.serve`).
The arguments, the token and the limits are checked before torch or transformers is imported, so ``--help`` and a
bad argument answer at once."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lit_grpo.cli.commands import ToolParser
from lit_grpo.serve.connections import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, check_connection_options
from lit_grpo.serve.server import RolloutServer, make_http_server
from lit_grpo.wire import auth
from lit_grpo.wire.protocol import LOOPBACK, TOKEN_ENV, Limits


def build_parser() -> argparse.ArgumentParser:
    """The ``serve`` arguments (building it imports neither torch nor transformers)."""
    parser = ToolParser(
        prog="python -m lit_grpo serve",
        description="Serve rollouts of a causal LM over HTTP (vLLM 0.33's protocol subset) and take weight pushes "
                    "from a lit_grpo trainer (`data.engine: server`).")
    parser.add_argument("--model", required=True, help="model alias, local directory or Hub id (as model.model_name)")
    parser.add_argument("--port", type=int, required=True, help="TCP port; 0 picks a free one (printed at start)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    parser.add_argument("--token-file", default=None,
                        help=f"file holding the bearer token (else ${auth.TOKEN_FILE_ENV} or ${TOKEN_ENV})")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    parser.add_argument("--max-prompts", type=int, default=Limits.max_prompts, help="prompts per request")
    parser.add_argument("--max-n", type=int, default=Limits.max_n, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=Limits.max_tokens, help="new tokens per completion")
    parser.add_argument("--no-buffer-reuse", action="store_true",
                        help="allocate fresh receive buffers for every push (default on CPU: keep two sets)")
    parser.add_argument("--log-requests", action="store_true",
                        help="log every request to stderr (with its X-Session-ID when a router sent it)")
    parser.add_argument("--read-timeout", type=float, default=DEFAULT_READ_TIMEOUT_S, metavar="SECONDS",
                        help="seconds a client has, from connecting, to send its whole request; a slower one is "
                             f"dropped (default {DEFAULT_READ_TIMEOUT_S:g}; a generation may take longer)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        help="connections served at once (a thread each); one more is answered 503 and closed "
                             f"(default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                        help="sequences decoding at once in the server's one decode loop, across the requests in "
                             "flight: a finished one's slot takes the next waiting one (default: all of them at once; "
                             "finished ones leave the batch either way)")
    return parser


def main(argv: Sequence[str]) -> None:
    """The ``serve`` subcommand: check the arguments and the token (before loading anything), then serve until
    interrupted. Errors are raised as ``ValueError`` / ``OSError`` for the CLI to print."""
    args = build_parser().parse_args(list(argv))
    token = auth.read_token(args.token_file)
    limits = Limits(args.max_body_bytes, args.max_prompts, args.max_n, args.max_tokens)
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must lie in [0, 65535], got {args.port}")
    check_connection_options(args.read_timeout, args.max_connections)
    import torch

    from lit_grpo.engines.options import check_max_num_seqs

    check_max_num_seqs(args.max_num_seqs)  # before the model loads

    from lit_grpo.models.loading import load_model_and_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else torch.device(
        args.device)
    if args.host not in LOOPBACK:
        print(f"warning: binding {args.host}: the token guards HTTP, but the weight bytes travel over "
              "torch.distributed, which is not authenticated; keep the network private", file=sys.stderr)
    model, tokenizer = load_model_and_tokenizer(args.model, args.dtype)
    server = RolloutServer(model.to(device), tokenizer, args.model, token, limits,
                           reuse_buffers=not args.no_buffer_reuse, max_num_seqs=args.max_num_seqs)
    httpd = make_http_server(server, args.host, args.port, args.log_requests, args.read_timeout,
                             args.max_connections)
    host, port = httpd.server_address[:2]
    print(f"lit_grpo rollout server: {args.model} ({args.dtype}, {device}) listening on http://{host}:{port}",
          flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()

