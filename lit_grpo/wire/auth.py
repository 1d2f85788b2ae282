"""The shared token and the loopback rule, for every side that reads them: the project's server
(``lit_grpo.serve.server``), the trainer (``lit_grpo.engines.remote.client``) and the gloo plugin inside
``vllm serve`` (``lit_grpo.wire.vllm_gloo``).

The token is read from a file (``--token-file``, ``engine_options.token_file`` or ``$LIT_GRPO_SERVER_TOKEN_FILE``)
or from ``$LIT_GRPO_SERVER_TOKEN``, in that order. Tokens are compared with ``hmac.compare_digest`` (time does not
depend on where they differ).

Loopback: torch.distributed has no authentication, and ``vllm serve``'s dev routes have none either, so a
``vllm serve`` push stays on this machine unless both sides allow otherwise (``allow_remote`` on the trainer,
``$LIT_GRPO_ALLOW_REMOTE_PUSH=1`` on the server).

Standard library only: the plugin imports this inside every vLLM process.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Mapping
from urllib.parse import urlsplit

TOKEN_ENV = "LIT_GRPO_SERVER_TOKEN"
#: names a file holding the token (for processes started without a token argument: ``vllm serve``'s workers)
TOKEN_FILE_ENV = "LIT_GRPO_SERVER_TOKEN_FILE"
#: ``1`` on the ``vllm serve`` side: its gloo plugin joins a push group whose store is on another machine
ALLOW_REMOTE_ENV = "LIT_GRPO_ALLOW_REMOTE_PUSH"
MIN_TOKEN_CHARS = 16
TOKEN_HINT = ("for example `export LIT_GRPO_SERVER_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')`"
              " before starting both sides")


def find_token(token_file: str | None = None, environ: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """``(token or None, where it was read)``: ``token_file``, else the file ``$LIT_GRPO_SERVER_TOKEN_FILE`` names,
    else ``$LIT_GRPO_SERVER_TOKEN``; surrounding whitespace (a file's newline) is dropped, and an empty token is
    none."""
    env = os.environ if environ is None else environ
    path = token_file or env.get(TOKEN_FILE_ENV, "").strip() or None
    if path:
        with open(os.path.expanduser(path)) as f:
            token = f.read().strip()
        where = f"token file {path}"
    else:
        token = env.get(TOKEN_ENV, "").strip()
        where = f"${TOKEN_ENV}"
    return token or None, where


def read_token(token_file: str | None = None, environ: Mapping[str, str] | None = None,
               who: str = "the rollout server") -> str:
    """The token ``find_token`` finds; a ``ValueError`` (one line saying how to set it) when there is none or it
    is shorter than ``MIN_TOKEN_CHARS``."""
    token, where = find_token(token_file, environ)
    if token is None:
        raise ValueError(f"no token: {who} needs one, from a token file (--token-file, ${TOKEN_FILE_ENV}) or "
                         f"${TOKEN_ENV} ({TOKEN_HINT}); it has no default")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the token in {where} has {len(token)} characters; use at least {MIN_TOKEN_CHARS}")
    return token


def same_token(given: str | None, expected: str) -> bool:
    """Whether ``given`` is ``expected``, compared in constant time; a missing or non-text token is not."""
    if not isinstance(given, str) or not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names this machine: ``localhost`` or a loopback address (127.0.0.0/8, ::1). Other names are
    not resolved: what they resolve to can change."""
    if not host:
        return False
    host = host.strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def remote_url(urls: list[object]) -> str | None:
    """The first of ``urls`` whose host is not loopback (``is_loopback``), or None; what is not text is left to
    the type check."""
    for url in urls:
        if isinstance(url, str) and not is_loopback(urlsplit(url).hostname):
            return url
    return None


def remote_allowed(environ: Mapping[str, str] | None = None) -> bool:
    """``$LIT_GRPO_ALLOW_REMOTE_PUSH`` is ``1`` (or ``true``/``yes``)."""
    env = os.environ if environ is None else environ
    return env.get(ALLOW_REMOTE_ENV, "").strip().lower() in ("1", "true", "yes")


def push_refusal(master_address: str, token: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """Why the gloo plugin inside ``vllm serve`` must refuse to join the push group that an init names, or None:
    no token configured on the server, a token that is not the server's, or a store off this machine without
    ``$LIT_GRPO_ALLOW_REMOTE_PUSH=1``. A token file the server cannot read also refuses."""
    try:
        expected, where = find_token(environ=environ)
    except OSError as err:
        return f"cannot read the token file ${TOKEN_FILE_ENV} names: {err}"
    if expected is None:
        return (f"no token: start vllm serve with ${TOKEN_ENV} (or ${TOKEN_FILE_ENV}, a file holding it) in its "
                f"environment, set to the token the trainer sends ({TOKEN_HINT})")
    if len(expected) < MIN_TOKEN_CHARS:
        return f"the token in {where} has {len(expected)} characters; use at least {MIN_TOKEN_CHARS}"
    if not same_token(token, expected):
        return ("missing or wrong token in the init info: the trainer must send the token vllm serve was started "
                f"with (engine_options.token, token_file or ${TOKEN_ENV})")
    if not is_loopback(master_address) and not remote_allowed(environ):
        return (f"the push group's store is at {master_address!r}, not on this machine; set {ALLOW_REMOTE_ENV}=1 "
                "for vllm serve to accept pushes from another machine (on a private network only: the weight bytes "
                "are not authenticated)")
    return None
