"""Tools for the tool-runner tests, importable by path (``toy_tools:...``) and light to import: the process runner's
children import this module to find the function they run."""

from __future__ import annotations

import os
import time
from pathlib import Path


def hang(seconds: float = 3600.0) -> str:
    """Sleep (for an hour by default: a tool that hangs).

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "woke"


def hang_then_write(path: str, seconds: float) -> str:
    """Write this process's id to ``path + '.pid'``, sleep, then write ``path``: a side effect after a long wait.

    Args:
        path: the file written after the sleep
        seconds: how long to sleep first
    """
    Path(path + ".pid").write_text(str(os.getpid()))
    time.sleep(seconds)
    Path(path).write_text("written after the sleep")
    return "written"


def whoami() -> int:
    """The id of the process the call runs in."""
    return os.getpid()


def make_scaler(factor: int):  # noqa: ANN201
    """A tool built by a factory: a closure, which a separate process cannot import by path."""

    def scaled(x: int) -> int:
        """Scale a number.

        Args:
            x: the number
        """
        return x * factor

    return scaled


#: importable by the path ``toy_tools:scaled``, yet defined in a function: the process runner refuses it
scaled = make_scaler(3)
