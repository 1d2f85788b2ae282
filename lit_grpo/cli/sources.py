"""Where a training command's value came from, ``<key>, on the command line`` or ``<key>, in <config file>``, read
from the command line and its YAML files alone (the ``(...)`` of a one-line error), for
:class:`lit_grpo.cli.errors.OneLineErrorsCLI`. Imports nothing heavy: the early refusals
(:mod:`lit_grpo.cli.early_checks`) read the config files with it before LightningCLI is built."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import yaml

#: the training subcommands, whose config files may nest their keys under the subcommand's name
SUBCOMMANDS = ("fit", "validate", "test", "predict")
#: keys that name a whole group of options: named with every source (``model, from a.yaml, the command line``)
GROUP_KEYS = ("trainer.callbacks", "data", "model", "trainer")


def config_files(argv: list[str]) -> list[str]:
    """The ``--config`` / ``-c`` files of a command line, in order."""
    return [b.split("=", 1)[1] if b.startswith("--config=") else b for a, b in zip(["", *argv], argv)
            if a in ("-c", "--config") or b.startswith("--config=")]


def read_yaml(path: str) -> object:
    """A config file's data, or None where it cannot be read (the parser says why, later)."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return None


def lookup(data: object, key: str) -> tuple[bool, object]:
    """``(True, value)`` where the nested mappings ``data`` hold the dotted ``key``, else ``(False, None)``."""
    node = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def sets(path: str, key: str, subcommands: Iterable[str] = SUBCOMMANDS) -> bool:
    """Whether a YAML config file sets ``key`` (``model.lr``), at the top or under a subcommand."""
    data = read_yaml(path)
    nodes = [data, *(data.get(s) for s in subcommands)] if isinstance(data, dict) else [data]
    return any(lookup(node, key)[0] for node in nodes)


def where(argv: list[str], key: str | None, subcommands: Iterable[str] = SUBCOMMANDS,
          groups: Iterable[str] = GROUP_KEYS, *, exact: bool = False) -> str:
    """``key`` and where its value came from: the command line or the last config file setting it. A group
    (``model``, a callback of trainer.callbacks) is named with all the sources, unless ``exact``."""
    files = config_files(argv)
    if key is None or not exact and (key in tuple(groups) or key.startswith("trainer.callbacks:")):
        sources = ", ".join([*files, "the command line"])
        return f"{key}, from {sources}" if key else f"from {sources}"
    if any(a == f"--{key}" or a.startswith((f"--{key}=", f"--{key}+")) for a in argv):  # += appends
        return f"{key}, on the command line"
    subcommands = list(subcommands)
    for path in reversed(files):  # a later --config overrides an earlier one
        if sets(path, key, subcommands):
            return f"{key}, in {path}"
    return key
