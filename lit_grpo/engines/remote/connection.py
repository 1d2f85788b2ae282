"""`ServerConnection`: the trainer's link to one rollout server: its HTTP client, the weight version this trainer last
pushed to it, and, on rank 0, the weight-transfer group (project's server) or vLLM's trainer side. The client engine,
the push and the pi_ref client each use the connections ``ServerEngine`` holds. `RouterConnection`: the link to a
router in front of them (``router_url``), which completions go through."""

from __future__ import annotations

import warnings
from typing import Any
from urllib.parse import urlsplit

from lit_grpo.core.distributed import close_at_exit
from lit_grpo.wire.protocol import HTTPClient, ServerError


class ServerConnection:
    """One server: its HTTP client, the version this trainer last pushed to it and, on rank 0, the weight-transfer
    group (project's server) or vLLM's trainer side."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server url must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.client = HTTPClient(url, token, timeout_s)
        self.expected_version: str | None = None  # what this trainer last pushed to it
        #: the label of the pi_ref this trainer last pushed to it (``data.reference_on_server``); ``None`` once it was
        #: down: a restarted server holds its own start-up copy, which scores nothing until pi_ref is pushed again
        self.reference_version: str | None = None
        #: every version this trainer began to push to it (partial rollouts: a completion may carry any of them)
        self.pushed_versions: set[str] = set()
        self.group = None
        self.store = None
        self.listener = None
        self.vllm = None  # (client, source, trainer engine) for kind vllm
        self.push_check = None  # kind vllm: what the next push is verified against (vllm_verify.PushCheck)

    def attach_group(self, group: Any, store: Any, listener: Any) -> None:
        """Keep the weight-transfer group this side formed (with its store and, on the trainer's side, the store's
        listening socket) until ``close_group``, which also runs at the end of the process: the group's worker
        threads must be joined before the interpreter finalizes (``lit_grpo.core.distributed.close_at_exit``)."""
        self.group, self.store, self.listener = group, store, listener
        close_at_exit(self.close_group)

    def close_group(self) -> None:
        """Drop the weight-transfer group (the last reference to a gloo group joins its worker threads; the store
        closes its own listening socket, ``weight_transfer.open_store``) and shut vLLM's trainer side down (its
        group or communicator, its store), so that the next push forms a new one. A second call does nothing; a
        failing shutdown (a broken group) is a warning, not an error: what it held is dropped all the same."""
        from lit_grpo.wire.weight_transfer import close_group

        group, self.group = self.group, None
        self.store = self.listener = None
        self.push_check = None  # a new group is a new lineage of pushes: the next one calibrates the check again
        close_group(group)
        parts, self.vllm = self.vllm, None
        if parts is not None:
            try:
                parts[2].shutdown()
            except Exception as err:  # noqa: BLE001 (called after a failed push, whose error is the one to raise)
                warnings.warn(f"rollout server {self.url}: shutting down vLLM's weight-transfer engine failed: {err}",
                              stacklevel=2)


class RouterConnection:
    """A router in front of ``servers`` (``vllm-router``; ``ServerOptions.router_url``): completions go through it
    and any of the servers may answer, so the version a completion must carry is the one this trainer pushed to
    every server up (``None`` while they differ, or before the first push), and any version it began to push to
    them."""

    def __init__(self, url: str, token: str | None, timeout_s: float, servers: list[ServerConnection]) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"router_url must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.client = HTTPClient(url, token, timeout_s)
        self.servers = servers

    def remove_worker(self, url: str) -> None:
        """Take the server ``url`` out of the router's routing (``POST /remove_worker``, a no-op there for one it
        does not hold): a server the fleet lost must get no more requests, and must not get them again when it
        restarts with its start-up weights."""
        self._membership("remove_worker", url)

    def add_worker(self, url: str) -> None:
        """Put the server ``url`` back in the router's routing (``POST /add_worker``): only once a push reached it,
        so that it samples the current weights (the router waits for a worker it adds to answer its health check,
        so a server that is not up is never added). 400, ``already exists`` (another rank added it), is fine."""
        self._membership("add_worker", url)

    def _membership(self, route: str, url: str) -> None:
        try:
            self.client.text("POST", f"/{route}", query={"url": url})
        except ServerError as err:
            if route == "add_worker" and err.status == 400:
                return
            warnings.warn(f"the router {self.url} did not {route.replace('_', ' ')} {url}: {err}", stacklevel=3)

    @property
    def expected_version(self) -> str | None:
        # a server down holds none (``Fleet.mark_down``) and is out of the router's list: it answers nothing
        versions = {s.expected_version for s in self.servers} - {None}
        return versions.pop() if len(versions) == 1 else None

    @property
    def pushed_versions(self) -> set[str]:
        return set().union(*(s.pushed_versions for s in self.servers))
