"""Tools a model calls by name: plain Python functions with type hints and a Google-style docstring.

Their JSON schemas come from transformers (``transformers.utils.get_json_schema``, the same schemas
``apply_chat_template(tools=...)`` renders), so a function that transformers cannot describe is refused when the
run starts, in one line. A call runs on a worker thread with a time limit; a tool that raises, times out, or gets
arguments it does not take answers with an error message, which goes back to the model as the tool's result, and
the trajectory goes on.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lit_grpo.core.import_paths import resolve_callable
from lit_grpo.environments.tool_calls import ToolCall

EXPECTED_TOOL = "expected an import path package.module:function of a type-hinted function with a docstring"


def resolve_tool(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The function ``spec`` names (an import path), or ``spec`` itself when it is callable."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a tool must be an import path or a function, got {type(spec).__name__}; {EXPECTED_TOOL}")
    return resolve_callable(spec, "tool", EXPECTED_TOOL)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """transformers' JSON schema of ``fn`` (one line naming the function when it cannot be described)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ValueError(f"tool {getattr(fn, '__name__', fn)!r} cannot be described for the chat template: {e}; "
                         f"give it type hints and a docstring with an Args: section") from e


class ToolOutcome:
    """What one call gave: the text for the tool message, and whether it failed (raised, timed out, unknown)."""

    __slots__ = ("text", "failed", "timed_out")

    def __init__(self, text: str, failed: bool = False, timed_out: bool = False) -> None:
        self.text, self.failed, self.timed_out = text, failed, timed_out


class ToolBox:
    """The tools of a run, by name: their schemas for the chat template, and their calls with a time limit."""

    def __init__(self, tools: Sequence[str | Callable[..., Any]], timeout_s: float = 10.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be > 0, got {timeout_s}")
        functions = [resolve_tool(t) for t in tools]
        self.schemas = [tool_schema(fn) for fn in functions]
        names = [s["function"]["name"] for s in self.schemas]
        if len(set(names)) != len(names):
            raise ValueError(f"two tools share a name: {names}")
        self.functions = dict(zip(names, functions))
        self.timeout_s = timeout_s

    def __bool__(self) -> bool:
        return bool(self.functions)

    def call(self, call: ToolCall) -> ToolOutcome:
        """Run ``call``; every failure becomes an error message for the model."""
        fn = self.functions.get(call.name)
        if fn is None:
            return ToolOutcome(f"Error: unknown tool {call.name!r}; the tools are {sorted(self.functions)}", True)
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return ToolOutcome(f"Error: {call.name} does not take these arguments ({e})", True)
        result: list[Any] = []

        def target() -> None:
            try:
                result.append(("ok", fn(**call.arguments)))
            except Exception as e:  # noqa: BLE001 (the model sees the error and goes on)
                result.append(("error", e))

        worker = threading.Thread(target=target, daemon=True, name=f"tool-{call.name}")
        worker.start()
        worker.join(self.timeout_s)
        if not result:
            return ToolOutcome(f"Error: {call.name} timed out after {self.timeout_s:g} s", True, timed_out=True)
        kind, value = result[0]
        if kind == "error":
            return ToolOutcome(f"Error: {call.name} raised {type(value).__name__}: {value}", True)
        return ToolOutcome(value if isinstance(value, str) else json.dumps(value, default=str))
