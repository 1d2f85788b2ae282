"""What ``fit`` accepts for each option, known without building LightningCLI's parser (which imports Lightning, torch
and the training stack: seconds): the table :data:`lit_grpo.cli.option_table.OPTIONS`, written from the parser by
``python -m lit_grpo.cli.write_option_table --write`` and checked against it by ``tests/test_option_types.py``.

An option's entry is ``"group"`` (a section of options, each in the table), ``"any"`` (a value this module does not
judge: a class, a list, a dict, a linked option) or the alternatives its type hint accepts, joined by ``|``:
``int``, ``float``, ``bool``, ``str``, ``null`` and literal values as Python writes them (``'constant'``, ``64``).
:func:`type_refusal` refuses only what the parser surely refuses too, so an early refusal and LightningCLI's agree:
a value is judged as the parser reads it (:func:`parser_yaml`; a string given for a bool, number or null option is
read again as YAML, typed on the command line or quoted in a config file). Imports nothing heavy.
"""

from __future__ import annotations

import ast
import difflib
import re
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


class _ParserLoader(yaml.SafeLoader):
    """YAML as LightningCLI's parser (jsonargparse) reads it, its config files and the strings given for a bool,
    number or null option alike: jsonargparse's loader drops YAML 1.1's dates (``2024-01-01`` stays text) and reads
    floats as YAML 1.2 does (``1e-3`` and ``1.0e5`` are numbers, text to YAML 1.1). Its resolvers are set below,
    copied from that loader, so that a value reads here as it does there."""


_DROPPED = ("tag:yaml.org,2002:timestamp", "tag:yaml.org,2002:float")
_ParserLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in _DROPPED]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_ParserLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
    [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def parser_yaml(text: str) -> object:
    """``text`` read as YAML the way LightningCLI's parser reads it (raises ``yaml.YAMLError`` where it is not)."""
    return yaml.load(text, Loader=_ParserLoader)


def _readings(value: object) -> list[object]:
    """What the parser may make of ``value`` for a bool, number or null option. It reads a string (typed on the
    command line, or quoted in a config file: the parser treats both alike) again as YAML, so ``"true"`` is a bool
    and ``"null"`` null. Python's reading of a number is kept too: it is the parser's first reading of plain digits,
    and where Python takes more (``nan``, ``1_0``) the value is only left to the parser, never refused early."""
    if not isinstance(value, str):
        return [value]
    readings = [value]
    try:
        readings.append(parser_yaml(value))
    except yaml.YAMLError:
        pass
    for kind in (int, float):
        try:
            readings.append(kind(value))
        except ValueError:
            pass
    return readings


def _accepts(alternative: str, readings: list[object]) -> bool:
    """Whether the parser may accept a value read as ``readings`` (:func:`_readings`) for one alternative of an
    entry."""
    if alternative == "str":
        return True  # the parser takes any scalar's text as a str
    if alternative == "null":
        return any(reading is None for reading in readings)
    if alternative == "bool":
        return any(isinstance(reading, bool) for reading in readings)
    numbers = [r for r in readings if isinstance(r, (int, float)) and not isinstance(r, bool)]
    if alternative == "int":
        return any(isinstance(number, int) or number.is_integer() for number in numbers)
    if alternative == "float":
        return bool(numbers)
    literal = ast.literal_eval(alternative)
    return any(reading == literal for reading in readings)  # the parser's ``in``: 16.0 is the literal 16


def _kind(entry: str) -> str:
    """How a refusal names what an entry expects: ``a float``, ``one of 'pad', 'error'``, ``an int or null``."""
    alternatives = entry.split("|")
    literals = [a for a in alternatives if a not in _SCALARS.values()]
    names = [{"int": "an int", "float": "a float", "bool": "a bool (true or false)", "str": "a str",
              "null": "null"}[a] for a in alternatives if a in _SCALARS.values()]
    if literals:
        names.insert(0, "one of " + ", ".join(literals))
    return " or ".join(names)


def type_refusal(key: str, entry: str, value: object) -> str | None:
    """The one-line refusal of ``value`` for option ``key`` (table entry ``entry``; ``value``: the text typed on the
    command line, or a config file's value as :func:`parser_yaml` reads it), or None where the parser may accept
    it."""
    if entry in (GROUP, ANY):
        return None
    readings = _readings(value)
    if any(_accepts(alternative, readings) for alternative in entry.split("|")):
        return None
    return f"{key} expects {_kind(entry)}, got {value!r}"


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
