"""Which rollout servers are up (``Fleet``): a dead server costs a retry, not the run.

A request whose connection is refused, reset or closed without an answer (``ServerError.lost``) is tried again on
the same server after a bounded backoff (:data:`RETRY_DELAYS_S`: a dropped connection, a listener that comes back);
when those tries fail too, or the server answers with weights other than those pushed to it (it restarted), it is
taken out of routing, a warning line names it, and the request goes, as it
was (the same prompts, the same seed), to the next server that is up. Requests are laid out over every configured
server whatever is up (``ServerEngine._requests``), and a request's seed belongs to its place in the layout, not to
its server: a request re-sent to another server of the same weights samples the same tokens, so a run that loses a
server trains exactly as one that never did. Any other error (a 4xx, a timeout, a wrong version) fails as before.

A server that is down gets no pushes. At each push rank 0 asks every down server whether it answers again; one that
does takes part in that push (a restarted server gets the current weights, and pi_ref where the servers hold it,
before it gets any work) and is back in routing once the push has reached it. The push's outcome, which every rank
learns from rank 0, sets the servers up and down alike on all ranks. When no server is up, a request waits for one
that answers with the weights this trainer pushed (a server that was unreachable, not restarted) for at most the
engine's ``timeout_s``, then the fit stops with one line naming every server.

Behind a router (``router_url``, ``python -m lit_grpo route``) the fleet keeps the router's list of servers: a server
taken out of routing leaves it (``/remove_worker``) and returns to it (``/add_worker``) once a push has reached it,
never before, so a restarted server is not sent work with its start-up weights. vllm-router, with its retries off
(a paused server's 503 must reach the trainer), answers a request it could not deliver to the server it chose with
a 500: the servers up are then probed, those that do not answer are taken out, and the request is sent again
(``through_router``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TypeVar

from lit_grpo.engines.remote.connection import RouterConnection, ServerConnection
from lit_grpo.wire.protocol import ServerError, version_text

#: seconds before each retry of a request whose connection was lost, on the same server (bounded: 3 tries, 3.5 s)
RETRY_DELAYS_S = (0.5, 1.0, 2.0)
#: seconds between two probes of the servers while none is up
PROBE_EVERY_S = 1.0
#: a probe's own timeout: a server that does not answer this fast is not back
PROBE_TIMEOUT_S = 5.0

T = TypeVar("T")


class ServerDown(ServerError):
    """A server stopped answering (its connection refused or lost on every retry)."""


class NoServerUp(ServerError):
    """Every server is down."""


class Fleet:
    """The servers of one engine and which of them are up (all, at first)."""

    def __init__(self, servers: list[ServerConnection], timeout_s: float,
                 delays_s: tuple[float, ...] = RETRY_DELAYS_S) -> None:
        self.servers = servers
        self.timeout_s = float(timeout_s)
        self.delays_s = tuple(delays_s)
        self.down: set[str] = set()
        #: the version this trainer's last push wrote (``None`` before the first): what a server that was only
        #: unreachable still holds
        self.pushed: str | None = None
        #: servers taken out of routing so far (a server that dies twice counts twice), and put back
        self.losses = 0
        self.rejoins = 0
        #: the servers the last push left out (``apply``): unlike ``down``, which each rank's own requests also set,
        #: the same on every rank, so what depends on it (whether pi_ref must be pushed again) is agreed
        self.left_out: set[str] = set()
        #: the router in front of the servers, whose list of servers follows which are up (``router_url``)
        self.router: RouterConnection | None = None

    # ---- state ----------------------------------------------------------------------------------------
    def is_up(self, server: ServerConnection) -> bool:
        return server.url not in self.down

    @property
    def up(self) -> list[ServerConnection]:
        return [s for s in self.servers if self.is_up(s)]

    def mark_down(self, server: ServerConnection, why: str) -> None:
        """Take ``server`` out of routing and pushes, with one warning line naming it (once per loss)."""
        if server.url in self.down:
            return
        self.down.add(server.url)
        self.losses += 1
        if self.router is not None:
            self.router.remove_worker(server.url)
        server.expected_version = None  # whatever it holds when it returns, it is not what this trainer pushed
        left = len(self.servers) - len(self.down)
        where = (f"its requests go to the {left} other server{'s' if left != 1 else ''} up" if left else
                 f"no other server is up: requests wait up to {self.timeout_s:g} s for one")
        warnings.warn(f"rollout server {server.url} is down ({why}): taken out of routing, {where}; it rejoins at "
                      f"the next weight push once it answers (rollout/servers_up)", stacklevel=2)

    def mark_up(self, server: ServerConnection) -> None:
        if server.url in self.down:
            self.down.discard(server.url)
            self.rejoins += 1
            if self.router is not None:
                self.router.add_worker(server.url)

    def apply(self, down: list[str], rejoin: bool = True) -> None:
        """Set the servers ``down`` (URLs) down and, with ``rejoin`` (a push of the policy or its adapter), every
        other one up: a push's outcome, the same on every rank. A pi_ref push (``rejoin`` false) puts none back:
        a server that missed the policy's push must not sample."""
        self.left_out = set(down) if rejoin else self.left_out | set(down)
        for server in self.servers:
            if server.url in down:
                self.mark_down(server, "it did not take the weight push")
            elif rejoin:
                self.mark_up(server)

    def stats(self) -> dict[str, float]:
        """Logged under ``rollout/``: ``servers_up``."""
        return {"servers_up": float(len(self.servers) - len(self.down))}

    # ---- calls ----------------------------------------------------------------------------------------
    def call(self, server: ServerConnection, call: Callable[[ServerConnection], T]) -> T:
        """``call(server)``, tried again after each of :data:`RETRY_DELAYS_S` while its connection is lost; then
        ``server`` is down (``ServerDown``). Any other error is raised as it is."""
        for delay in (*self.delays_s, None):
            try:
                return call(server)
            except ServerError as err:
                if not err.lost:
                    raise
                if delay is None:
                    self.mark_down(server, str(err).split(": ", 1)[-1])
                    raise ServerDown(str(err), lost=True) from None
                time.sleep(delay)
                self._restarted(server)
        raise AssertionError("unreachable")  # pragma: no cover

    def _restarted(self, server: ServerConnection) -> None:
        """A server that answers again after a lost connection, with weights other than those this trainer pushed
        to it, was restarted: it is down until a push reaches it (``ServerDown``), not retried."""
        expected = server.expected_version
        version = self.probe(server)
        if version is not None and expected is not None and version != expected:
            self.mark_down(server, f"it restarted: it holds weight version {version!r}, not the pushed {expected!r}")
            raise ServerDown(f"rollout server {server.url} restarted", lost=True)

    def on_any(self, first: ServerConnection, call: Callable[[ServerConnection], T]) -> T:
        """``call`` on ``first``, or while servers are lost on the next ones that are up, in the configured order
        from ``first``; with none up, on the first that answers with the weights this trainer pushed, within
        ``timeout_s`` (``NoServerUp`` after it)."""
        start = self.servers.index(first)
        while True:
            order = self.servers[start:] + self.servers[:start]
            candidates = [s for s in order if self.is_up(s)]
            if not candidates:
                self._wait_for_one()
                continue
            try:
                return self.call(candidates[0], call)
            except ServerDown:
                continue

    def through_router(self, call: Callable[[], T]) -> T:
        """``call()``, a request through the router. An error answer of 500, 502 or 504 (the router could not reach
        the server it chose): every server up is probed, those that do not answer are taken out of routing (and
        of the router's list), and the call is made again; when no server was lost while it ran, the error is
        raised as it is. A lost connection to the router itself is tried again after each of
        :data:`RETRY_DELAYS_S`, then raised. Each new try follows a server taken out or a delay: the tries are
        bounded."""
        delays = iter(self.delays_s)
        while True:
            losses = self.losses  # a loss while this call ran (another thread's request found it) is its cause too
            try:
                return call()
            except ServerError as err:
                if err.lost:
                    delay = next(delays, None)
                    if delay is None:
                        raise
                    time.sleep(delay)
                    continue
                if err.status not in (500, 502, 504):
                    raise
                for server in [server for server in self.up if self.probe(server) is None]:
                    self.mark_down(server, f"the router could not reach it: {str(err).split(': ', 1)[-1]}")
                if self.losses == losses:
                    raise
                if not self.up:
                    self._wait_for_one()

    def _wait_for_one(self) -> None:
        """Wait for a down server that answers with the version this trainer last pushed to every server (one that
        was only unreachable); a restarted one waits for the next push. ``NoServerUp`` after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for server in self.servers:
                version = self.probe(server)
                if version is not None and version == self.pushed:
                    server.expected_version = version
                    self.mark_up(server)
                    return
            time.sleep(PROBE_EVERY_S)
        raise self.none_up("with this trainer's weights")

    def none_up(self, answered: str = "") -> NoServerUp:
        """The one line of a fit that has no server left, naming every one."""
        return NoServerUp(f"every rollout server is down ({', '.join(s.url for s in self.servers)}), none answered "
                          f"{answered + ' ' if answered else ''}within {self.timeout_s:g} s "
                          f"(engine_options.timeout_s); expected at least one up: restart them and resume from the "
                          f"last checkpoint (--ckpt_path last)")

    def probe(self, server: ServerConnection) -> str | None:
        """The weight version ``server`` reports now, or ``None`` when it does not answer."""
        try:
            info = server.client.get("/weight_info", timeout_s=min(PROBE_TIMEOUT_S, self.timeout_s))
        except ServerError:
            return None
        return version_text(info.get("weight_version")) or ""

    def push_targets(self, rejoin: bool = True) -> list[ServerConnection]:
        """The servers a push goes to: those up and, with ``rejoin`` (a push of the policy or its adapter), those
        down that answer now (rank 0 asks them); with none, the first ones to answer within ``timeout_s``
        (``NoServerUp`` after it)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            targets = [s for s in self.servers if self.is_up(s) or (rejoin and self.probe(s) is not None)]
            if targets or time.monotonic() >= deadline:
                break
            time.sleep(PROBE_EVERY_S)
        if not targets:
            raise self.none_up()
        return targets


__all__ = ["Fleet", "NoServerUp", "ServerDown"]
