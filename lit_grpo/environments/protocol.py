"""The environment protocol: what ``data.environment`` names, and how its answers are checked.

A factory (``package.module:factory``, often the class itself) is called with one dataset row (a dict) and returns
an environment, one per trajectory. The plain form, enough for most tasks::

    class GuessTheNumber:
        def __init__(self, row: dict): ...
        def reset(self) -> str | list[dict]: ...   # the first user message, or chat messages
        def step(self, completion: str) -> tuple[str | list[dict] | None, float | None, bool]:
            ...                                     # (what the environment answers, reward, done)

The typed form returns a :class:`StepResult` from ``step`` instead of the tuple (the same three fields, with names);
an environment may also define ``close()``, called once when its trajectory ends, however it ends.

A reply that is a string is one user message; a list holds chat messages (dicts with ``role`` and ``content``).
Rewards of the steps add up to the trajectory's reward (``None`` counts 0); ``data.rewards`` may add to it.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from lit_grpo.core.import_paths import resolve_callable

Messages = list[dict[str, Any]]
EXPECTED_FACTORY = "expected an import path package.module:factory whose factory takes a dataset row (a dict)"


class EnvironmentShapeError(TypeError):
    """An environment answered with something that is not what the protocol says (one line naming it)."""


class EnvironmentFault(RuntimeError):
    """An environment cannot serve the run: it cannot start a task, or it failed on every trajectory of the first
    batch. The message is one line naming the environment and the row; ``key`` is the option to look at, which the
    command line prints after it, as it does a bad value's (``error: <message> (<key>)``, exit status 2)."""

    def __init__(self, message: str, key: str = "data.environment") -> None:
        super().__init__(message)
        self.key = key


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment (the plain form; ``step`` may return a :class:`StepResult` instead)."""

    def reset(self) -> str | Messages: ...

    def step(self, completion: str) -> tuple[str | Messages | None, float | None, bool]: ...


@dataclass(frozen=True)
class StepResult:
    """What the environment answers a model turn with (the typed form of ``step``'s tuple)."""

    reply: str | Messages | None = None  # the next user message(s); None: nothing to add
    reward: float | None = None  # added to the trajectory's reward; None counts 0
    done: bool = False  # the trajectory ends after this turn


EnvironmentFactory = Callable[[dict[str, Any]], Environment]


def resolve_environment(spec: str | EnvironmentFactory) -> EnvironmentFactory:
    """The factory ``spec`` names (an import path), or ``spec`` itself when it is callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"data.environment must be an import path or a callable, got {type(spec).__name__}; "
                         f"{EXPECTED_FACTORY}")
    return resolve_callable(spec, "environment", EXPECTED_FACTORY)


def environment_name(factory: object) -> str:
    """How messages name an environment factory: its import path (``package.module:Name``) for a class or a function,
    its class's for an instance with options bound (``OpenEnvFactory(...)``)."""
    named = factory if isinstance(factory, type) or hasattr(factory, "__qualname__") else type(factory)
    return f"{getattr(named, '__module__', '?')}:{getattr(named, '__qualname__', repr(named))}"


def as_messages(value: object, what: str) -> Messages:
    """A reply as chat messages: a string is one user message; a list must hold ``{role, content}`` dicts."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and ("content" in m or "tool_calls" in m) for m in value):
        return [dict(m) for m in value]
    raise EnvironmentShapeError(f"{what} returned {_shown(value)}; expected a string or a list of chat messages "
                                f"(dicts with 'role' and 'content')")


def check_reset(value: object) -> Messages:
    """``reset()``'s answer as messages, at least one."""
    messages = as_messages(value, "reset()")
    if not messages:
        raise EnvironmentShapeError("reset() returned no message; expected the first user message")
    return messages


def check_step(value: object) -> StepResult:
    """``step()``'s answer as a :class:`StepResult`: a ``StepResult``, or a ``(reply, reward, done)`` tuple."""
    if isinstance(value, StepResult):
        reply, reward, done = value.reply, value.reward, value.done
    elif isinstance(value, tuple | list) and len(value) == 3:
        reply, reward, done = value
    else:
        raise EnvironmentShapeError(f"step() returned {_shown(value)}; expected (reply, reward, done) or a "
                                    f"StepResult")
    if reward is not None and not is_finite_number(reward):
        raise EnvironmentShapeError(f"step() returned reward {reward!r}; expected a finite number or None")
    # a NumPy bool (``done = guess == target`` on NumPy values) is a bool too: a 0-d value of dtype bool
    if not (isinstance(done, bool) or (getattr(getattr(done, "dtype", None), "kind", None) == "b"
                                       and getattr(done, "ndim", 1) == 0)):
        raise EnvironmentShapeError(f"step() returned done={done!r}; expected True or False")
    messages = None if reply is None else as_messages(reply, "step()")
    return StepResult(messages, None if reward is None else float(reward), bool(done))


def is_finite_number(value: object) -> bool:
    """Whether ``value`` is a finite real number that is not a bool: Python's, or a NumPy scalar (which registers as
    ``numbers.Real``), as an environment that computes its reward with NumPy returns it. NaN and infinities would
    turn the group's advantages into NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))


def close(environment: object) -> None:
    """Call the environment's ``close()`` when it has one. An error there ends nothing (the trajectory is over and
    kept) but is warned: it may leave a resource of the environment's open."""
    closer = getattr(environment, "close", None)
    if callable(closer):
        try:
            closer()
        except Exception as e:  # noqa: BLE001 (a failing close must not lose the trajectory)
            warnings.warn(f"an environment's close() raised {type(e).__name__}: {e}; its trajectory is kept",
                          stacklevel=2)


def _shown(value: object) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80] + '...' if len(text) > 80 else text}"
