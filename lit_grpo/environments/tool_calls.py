"""Tool calls parsed from a model's turn, in the format its chat template teaches.

Supported: ``hermes`` (Hermes / Qwen 2.5-3 / SmolLM3 and most templates with tool support: each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``). A format is a function
``parse(text) -> list[ToolCall]`` that raises :class:`ToolCallError` on a call it recognises but cannot read; a user
adds one by naming its import path in ``data.tool_call_format`` (``package.module:function``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lit_grpo.core.import_paths import resolve_callable


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def as_message_call(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` entry (transformers' chat-template convention)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallError(ValueError):
    """A call the format recognises (its tags are there) but cannot read: the model is told so, and goes on."""


HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """Every ``<tool_call>{json}</tool_call>`` in ``text``, in order (an unclosed last tag is read to the end)."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        body = match.group(1).strip()
        try:
            payload = json.loads(body)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the tool call {body[:60]!r} is not valid JSON ({e.msg})") from e
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            raise ToolCallError(f"the tool call {body[:60]!r} needs a \"name\" string")
        arguments = payload.get("arguments", payload.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ToolCallError(f"the arguments of {payload['name']!r} are not valid JSON ({e.msg})") from e
        if not isinstance(arguments, dict):
            raise ToolCallError(f"the arguments of {payload['name']!r} must be a JSON object")
        calls.append(ToolCall(payload["name"], arguments))
    return calls


ToolCallParser = Callable[[str], list[ToolCall]]
#: the formats by name (``data.tool_call_format``)
TOOL_CALL_FORMATS: dict[str, ToolCallParser] = {"hermes": parse_hermes}


def resolve_tool_call_format(spec: str | ToolCallParser) -> ToolCallParser:
    """The parser ``spec`` names: a key of :data:`TOOL_CALL_FORMATS`, an import path, or the function itself."""
    if callable(spec):
        return spec
    if spec in TOOL_CALL_FORMATS:
        return TOOL_CALL_FORMATS[spec]
    if ":" not in spec and "." not in spec:
        raise ValueError(f"unknown tool_call_format {spec!r}; expected one of {sorted(TOOL_CALL_FORMATS)} or an "
                         f"import path package.module:parse")
    return resolve_callable(spec, "tool_call_format", "expected a function parse(text) -> list[ToolCall]")
