"""The name under which a transformers causal LM takes and returns its KV cache.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (the forward's argument and the output's field); the
old name still works there but warns on every run (a ``FutureWarning`` from the forward, a logged line from the
output's attribute) and goes away in 5.40. The project supports transformers from 4.56, which knows only the old
name, so the name is read off the model's own ``forward`` signature, once per model, rather than guessed from a
version string: a model whose forward declares ``cache`` gets ``cache``.
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Any

from torch import nn

NEW_NAME = "cache"
OLD_NAME = "past_key_values"

#: wrappers whose ``forward`` passes ``**kwargs`` through, and the attribute that holds what they wrap: PEFT's
#: ``get_base_model()`` is handled apart; DDP and ``torch.compile`` keep the wrapped module here
_WRAPPED_ATTRIBUTES = ("module", "_orig_mod")

_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def cache_kwarg(model: nn.Module) -> str:
    """The keyword ``model``'s forward takes its KV cache under: ``"cache"`` where the installed transformers
    declares it, else ``"past_key_values"`` (also for a model whose forward declares neither, which older code
    paths always passed it as)."""
    name = _names.get(model)
    if name is None:
        name = _declared_name(model)
        _names[model] = name
    return name


def output_cache(output: Any) -> Any:  # noqa: ANN401 -- a transformers ModelOutput and its Cache, of any class
    """The KV cache a forward returned, read by the field the output class declares (``cache`` from transformers
    5.24, ``past_key_values`` before), so that the deprecated alias is never touched."""
    fields = {f.name for f in dataclasses.fields(output)} if dataclasses.is_dataclass(output) else set()
    return getattr(output, NEW_NAME if NEW_NAME in fields else OLD_NAME)


def _declared_name(model: nn.Module) -> str:
    seen: set[int] = set()
    module: nn.Module | None = model
    while module is not None and id(module) not in seen:
        seen.add(id(module))
        # inspect.signature follows functools.wraps, so transformers' deprecation decorator shows the real forward
        parameters = inspect.signature(type(module).forward).parameters
        if NEW_NAME in parameters:
            return NEW_NAME
        if OLD_NAME in parameters:
            return OLD_NAME
        module = _wrapped(module)
    return OLD_NAME


def _wrapped(module: nn.Module) -> nn.Module | None:
    """The module a pass-through wrapper (PEFT, DDP, ``torch.compile``) forwards its keyword arguments to."""
    get_base_model = getattr(module, "get_base_model", None)
    if callable(get_base_model):
        return get_base_model()
    for attribute in _WRAPPED_ATTRIBUTES:
        inner = getattr(module, attribute, None)
        if isinstance(inner, nn.Module):
            return inner
    return None
