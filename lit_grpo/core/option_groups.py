"""Typed option groups (dataclasses) as constructor arguments, and the plain dicts checkpoints store them as.

The parser (LightningCLI) builds a group from a config section and validates its keys and types; Python callers
pass an instance. A checkpoint keeps a group as a plain dict, since it is read back with
``torch.load(weights_only=True)``, which refuses arbitrary classes; ``load_from_checkpoint`` then passes the dict
back, which :func:`as_group` turns into the group again.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
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
    names = [f.name for f in fields(cls) if f.init]  # not a field set after construction (a loss's beta)
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
    try:
        return cls(**kwargs)
    except ValueError as err:
        # a bad value, named by its group unless the message does (one options class serves several sections)
        if str(err).startswith(name):
            raise
        raise ValueError(f"{name}: {err}") from err


def plain(group: object) -> dict[str, Any]:
    """A group as a dict of plain values (nested groups as dicts), as a checkpoint stores it: the fields its
    constructor takes, so :func:`as_group` can build it again (a field set after construction, like a loss
    config's ``beta``, is not an option and is left out)."""
    if not is_dataclass(group) or isinstance(group, type):
        raise ValueError(f"expected a dataclass instance, got {type(group).__name__}")
    return {f.name: _plain_value(getattr(group, f.name)) for f in fields(group) if f.init}


def _plain_value(value: Any) -> Any:
    # as dataclasses.asdict treats a field's value: nested groups as dicts, everything else deep-copied
    if is_dataclass(value) and not isinstance(value, type):
        return plain(value)
    return copy.deepcopy(value)
