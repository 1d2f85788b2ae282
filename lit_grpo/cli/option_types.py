"""What ``fit`` accepts for each option, known without building LightningCLI's parser (which imports Lightning, torch
and the training stack: seconds): the table :data:`lit_grpo.cli.option_table.OPTIONS`, written from the parser by
``python -m lit_grpo.cli.write_option_table --write`` and checked against it by ``tests/test_option_types.py``.

An option's entry is ``"group"`` (a section of options, each in the table), ``"any"`` (a value this module does not
judge: a class, a list, a dict, a linked option) or the alternatives its type hint accepts, joined by ``|``:
``int``, ``float``, ``bool``, ``str``, ``null`` and literal values as Python writes them (``'constant'``, ``64``).
:func:`type_refusal` refuses only what the parser surely refuses too, so an early refusal and LightningCLI's agree.
Imports nothing heavy.
"""

from __future__ import annotations

import ast
import difflib
import types
import typing
from pathlib import Path, PurePath
from typing import Any

import yaml

GROUP, ANY = "group", "any"
_SCALARS = {bool: "bool", int: "int", float: "float", str: "str", type(None): "null"}
_PATHS = (Path, PurePath)


def describe(hint: Any) -> str:
    """The table entry of a type hint: its alternatives joined by ``|``, or ``"any"`` where one of them is a type
    this module does not judge."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [describe(arg) for arg in typing.get_args(hint)]
        return ANY if ANY in parts else "|".join(dict.fromkeys("|".join(parts).split("|")))
    if typing.get_origin(hint) is typing.Literal:
        return "|".join(repr(value) for value in typing.get_args(hint))
    if hint in _SCALARS:
        return _SCALARS[hint]
    if isinstance(hint, type) and issubclass(hint, _PATHS):
        return "str"  # the parser takes a path as its text
    return ANY


def _accepts(alternative: str, value: object, text: str | None) -> bool:
    """Whether the parser may accept ``value`` (as YAML reads it; ``text`` is how it was typed, None in a file) for
    one alternative of an entry."""
    if alternative == "str":
        return True  # the parser takes any scalar's text as a str
    if alternative == "null":
        return value is None
    if alternative == "bool":
        return isinstance(value, bool) or (text or "").lower() in ("true", "false")
    if alternative == "int":
        if isinstance(value, bool):
            return False
        if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
            return True
        return isinstance(value, str) and _parses(int, value)
    if alternative == "float":
        if isinstance(value, bool):
            return False
        return isinstance(value, (int, float)) or (isinstance(value, str) and _parses(float, value))
    literal = ast.literal_eval(alternative)
    return value == literal and isinstance(value, bool) == isinstance(literal, bool) or text == str(literal)


def _parses(kind: type, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


def _kind(entry: str) -> str:
    """How a refusal names what an entry expects: ``a float``, ``one of 'pad', 'error'``, ``an int or null``."""
    alternatives = entry.split("|")
    literals = [a for a in alternatives if a not in _SCALARS.values()]
    names = [{"int": "an int", "float": "a float", "bool": "a bool (true or false)", "str": "a str",
              "null": "null"}[a] for a in alternatives if a in _SCALARS.values()]
    if literals:
        names.insert(0, "one of " + ", ".join(literals))
    return " or ".join(names)


def type_refusal(key: str, entry: str, value: object, text: str | None = None) -> str | None:
    """The one-line refusal of ``value`` for option ``key`` (table entry ``entry``; ``text``: its command-line
    text, whose YAML reading ``value`` is), or None where the parser may accept it."""
    if entry in (GROUP, ANY) or any(_accepts(alternative, value, text) for alternative in entry.split("|")):
        return None
    return f"{key} expects {_kind(entry)}, got {text if text is not None else value!r}"


def read_text(text: str) -> object:
    """A command-line value as the parser reads it first: YAML, or the text itself where it is not YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def unknown_key(key: str, options: dict[str, str]) -> bool:
    """Whether ``key`` surely names no option: its closest section in ``options`` is a group that lacks it (an option
    under a class, a dict or a scalar, and a key outside every section, are left to the parser)."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in options:
            return n < len(parts) and options[prefix] == GROUP
    return False


def closest(key: str, options: dict[str, str]) -> str | None:
    """The known option nearest to a mistyped ``key``, if one is near."""
    found = difflib.get_close_matches(key, [k for k, v in options.items() if v != GROUP], n=1, cutoff=0.8)
    return found[0] if found else None
