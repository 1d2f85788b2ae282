"""Ports for the tests' servers and gloo rendezvous, picked below the system's ephemeral range.

A port from ``bind(("127.0.0.1", 0))`` comes from the ephemeral range, the range the kernel also hands out as the
local port of every outgoing connection. Between picking such a port and a process binding it (seconds: the
process imports torch first), a client connection of another test may take it, and the bind fails with
EADDRINUSE. Below that range only a listener binds a port, so the window closes to the ones picked here."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000


def _ephemeral_low() -> int | None:
    try:
        return int(_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port: int) -> bool:
    # both the loopback and the wildcard address: a gloo store listens on every interface
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A port nothing listens on now: below the ephemeral range where the system says where it starts (Linux),
    else one the system picks."""
    low = _ephemeral_low()
    if low is not None and low - _LOWEST > 1000:
        rng = random.SystemRandom()  # not the tests' seeded generator: two processes must not pick alike
        for _ in range(200):
            port = rng.randrange(_LOWEST, low)
            if _bindable(port):
                return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
