"""The rollout server's connections: a read deadline and a cap on how many are served at once.

Each connection costs a thread (``ThreadingHTTPServer``). Without limits a client that connects and sends nothing,
or sends its request a byte at a time, holds its thread for as long as it likes, and any number of them can; every
route but ``/health`` is authenticated, but the token is checked only once the request's headers have arrived. So:

- ``read_timeout_s`` (``--read-timeout``): a client has that long, from the moment it is accepted, to send its whole
  request (request line, headers and body), however it trickles it: each read waits only for what is left of that
  deadline. A client that misses it is dropped with one line on stderr. A generation that runs longer is not
  affected: the deadline covers reading the request only, and writing the answer has the same timeout per write;
- ``max_connections`` (``--max-connections``): at most that many connections are served at once; one more is
  answered ``503`` and closed right away by the accepting thread, without a thread of its own;
- a client that leaves before its answer is written (a trainer whose ``generate_timeout_s`` expired, a closed
  socket, a reset) is one line on stderr, not a traceback; any other exception still prints its traceback.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: the defaults of ``--read-timeout`` (seconds) and ``--max-connections``
DEFAULT_READ_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 64
#: what a client that left raises in its handler thread
CLIENT_LEFT = (ConnectionError, TimeoutError)


def check_connection_options(read_timeout_s: float, max_connections: int) -> None:
    """A one-line ``ValueError`` naming the bad value: ``read_timeout_s`` must be a number > 0 and
    ``max_connections`` an integer >= 1."""
    if isinstance(read_timeout_s, bool) or not isinstance(read_timeout_s, (int, float)) or not read_timeout_s > 0:
        raise ValueError(f"--read-timeout must be a number of seconds > 0, got {read_timeout_s!r}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
        raise ValueError(f"--max-connections must be an integer >= 1, got {max_connections!r}")


def note(message: str) -> None:
    """One line on stderr, prefixed like the server's other lines."""
    print(f"lit_grpo rollout server: {message}", file=sys.stderr, flush=True)


def peer(client_address: Any) -> str:
    """``host:port`` of a client address (``(host, port, ...)``)."""
    try:
        return f"{client_address[0]}:{client_address[1]}"
    except (TypeError, IndexError):
        return str(client_address)


def left_message(client_address: Any, error: BaseException, read_timeout_s: float) -> str:
    """The one line for a client that left: a missed read deadline, or the connection gone (broken pipe, reset)."""
    if isinstance(error, TimeoutError):
        return (f"client {peer(client_address)} sent no complete request within {read_timeout_s:g} s "
                "(--read-timeout), or stopped reading the answer: dropped")
    return f"client {peer(client_address)} left before its answer was written ({type(error).__name__})"


class DeadlineReader(io.RawIOBase):
    """The raw side of a handler's ``rfile``: reads from ``sock`` until ``deadline`` (``time.monotonic``), each read
    waiting only for what is left of it, then ``TimeoutError``. After each read the socket's timeout goes back to
    ``write_timeout_s``, so that writing the answer (after a generation of any length) has a timeout of its own."""

    def __init__(self, sock: socket.socket, deadline: float, write_timeout_s: float) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = deadline
        self.write_timeout_s = write_timeout_s

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request's read deadline has passed")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.write_timeout_s)


class BoundedHTTPServer(ThreadingHTTPServer):
    """``ThreadingHTTPServer`` that serves at most ``max_connections`` connections at once (one thread each): the
    accepting thread answers one more with a ``503`` and closes it at once. Its handler class reads each request
    within ``read_timeout_s`` (``bounded_handler``). A client that left is one line on stderr."""

    daemon_threads = True
    # the listen backlog (the standard library's is 5): a burst of connections waits in the kernel's queue for the
    # accepting thread instead of having its handshakes dropped and retried a second later
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], read_timeout_s: float,
                 max_connections: int) -> None:
        check_connection_options(read_timeout_s, max_connections)
        self.read_timeout_s = float(read_timeout_s)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._at_cap = False  # one line per burst of refusals, not one per refused connection
        self.refused = 0  # connections refused at the cap, since start
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        self._at_cap = False
        try:
            super().process_request(request, client_address)  # starts the connection's thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        """Answer ``503`` without waiting (a send that would block is skipped) and close: on the accepting thread,
        which must not stall."""
        self.refused += 1
        if not self._at_cap:
            self._at_cap = True
            note(f"{self.max_connections} connections open (--max-connections): refusing new ones, from "
                 f"{peer(client_address)} on, until one ends")
        body = json.dumps({"error": {"message": f"the server has {self.max_connections} connections open "
                                                 "(--max-connections); retry later",
                                     "type": "Service Unavailable", "code": 503}}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\nRetry-After: 1\r\n\r\n").encode()
        try:
            request.setblocking(False)
            request.recv(1 << 16)  # what the client has sent already: unread bytes at close would reset the answer
        except OSError:
            pass
        try:
            request.send(head + body)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, CLIENT_LEFT):
            note(left_message(client_address, error, self.read_timeout_s))
            return
        super().handle_error(request, client_address)


class DeadlineHandler(BaseHTTPRequestHandler):
    """A request handler whose ``rfile`` enforces the server's read deadline (``BoundedHTTPServer``) and that
    reports a client that left in one line."""

    server: BoundedHTTPServer

    def setup(self) -> None:
        self.timeout = self.server.read_timeout_s  # the socket's timeout, per read and per write
        super().setup()
        self.rfile.close()
        deadline = time.monotonic() + self.server.read_timeout_s
        self.rfile = io.BufferedReader(DeadlineReader(self.connection, deadline, self.server.read_timeout_s))

    def handle(self) -> None:
        try:
            super().handle()
        except CLIENT_LEFT as err:
            note(left_message(self.client_address, err, self.server.read_timeout_s))

    def log_error(self, format: str, *args: Any) -> None:  # noqa: A002
        # the standard library reports a read or write that timed out here ("Request timed out: %r"), and swallows it
        if args and isinstance(args[-1], TimeoutError):
            note(left_message(self.client_address, args[-1], self.server.read_timeout_s))
            return
        super().log_error(format, *args)
