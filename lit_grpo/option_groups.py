"""Typed option groups (dataclasses) as constructor arguments, and the plain dicts checkpoints store them as.

The parser (LightningCLI) builds a group from a config section and validates its keys and types; Python callers
pass an instance. A checkpoint keeps a group as a plain dict, since it is read back with
``torch.load(weights_only=True)``, which refuses arbitrary classes; ``load_from_checkpoint`` then passes the dict
back, which :func:`as_group` turns into the group again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields, is_dataclass
from typing import Any, TypeVar, get_type_hints

G = TypeVar("G")


def as_group(cls: type[G], value: G | Mapping[str, Any] | None, name: str) -> G:
    """``value`` as an instance of the dataclass ``cls``: an instance is returned as is, None gives the defaults,
    a mapping (a checkpoint's hyperparameters) is built field by field, nested groups included.

    A key ``cls`` does not have raises ValueError naming ``name`` (the argument) and the keys expected.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a {cls.__name__} or a mapping of its fields, got {type(value).__name__}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(f"{name} ({cls.__name__}) has no option(s) {unknown}; expected among {names}")
    hints = get_type_hints(cls)
    defaults = {f.name: f.default for f in fields(cls)}
    kwargs = {}
    for key, item in value.items():
        kind = hints.get(key)
        if isinstance(kind, type) and is_dataclass(kind) and (item is None or isinstance(item, Mapping)):
            item = as_group(kind, item, f"{name}.{key}")
        elif isinstance(item, list) and isinstance(defaults[key], tuple):
            item = tuple(item)  # a YAML or JSON list where the group keeps a tuple (adam betas)
        kwargs[key] = item
    return cls(**kwargs)


def plain(group: object) -> dict[str, Any]:
    """A group as a dict of plain values (nested groups as dicts), as a checkpoint stores it."""
    if not is_dataclass(group) or isinstance(group, type):
        raise ValueError(f"expected a dataclass instance, got {type(group).__name__}")
    return asdict(group)
