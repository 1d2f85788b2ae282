"""Callables named by import path (``package.module:function`` or ``package.module.function``): how rewards and
losses are plugged in from a config. One resolver, so both fail the same way: one line naming the value."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any


def resolve_callable(spec: str, kind: str, expected: str) -> Callable[..., Any]:
    """The callable ``spec`` names, checked to import, exist and be callable. ``kind`` ("reward", "loss") and
    ``expected`` (what a valid spec looks like) go into the ``ValueError``."""
    module_name, sep, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise ValueError(f"unknown {kind} {spec!r}: {expected}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"{kind} {spec!r}: cannot import module {module_name!r} ({e!r}); {expected}") from e
    try:
        fn = functools.reduce(getattr, attr.split("."), module)
    except AttributeError as e:
        raise ValueError(f"{kind} {spec!r}: module {module_name!r} has no attribute {attr!r}; {expected}") from e
    if not callable(fn):
        raise ValueError(f"{kind} {spec!r}: {attr!r} is a {type(fn).__name__}, not callable; {expected}")
    return fn
