"""Does a transformers model hand its ``position_ids`` to the causal-mask builder? Read from its classes' source.

Under sdpa, eager and flex attention, transformers keeps packed sequences apart in the mask: ``create_causal_mask``
calls ``find_packed_sequence_indices(position_ids)`` and intersects the causal mask with "same sequence". A model
that calls the builder without its position ids (OPT, BioGPT, XGLM and GPT-OSS in transformers 5.24) gets a plain
causal mask over the whole packed row, and its packed sequences attend to one another: measured 2.2 (OPT) against
each row run alone (``tests/test_packing_families.py``). :func:`lit_grpo.core.packing.packing_supported` refuses
those models through :func:`mask_built_without_positions`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap

from torch import nn


def mask_built_without_positions(base: nn.Module, builder_names: tuple[str, ...]) -> str | None:
    """``"Class.method"`` of the first method of ``base``'s modules' classes that calls a mask builder of
    ``transformers.masking_utils`` (those named ``builder_names``) without ``position_ids`` (read from the source),
    else None. Without them
    ``create_causal_mask`` never calls ``find_packed_sequence_indices``: the mask is plain causal over the whole
    packed row."""
    seen: set[type] = set()
    for module in base.modules():
        # the class that defines the forward which runs (a wrapper such as FSDP2's subclass inherits it)
        owner = next((cls for cls in type(module).__mro__ if "forward" in vars(cls)), None)
        if owner is None or owner in seen:
            continue
        seen.add(owner)
        if (method := _method_building_mask_without_positions(owner, builder_names)) is not None:
            return f"{owner.__name__}.{method}"
    return None


@functools.cache
def _method_building_mask_without_positions(owner: type, builder_names: tuple[str, ...]) -> str | None:
    """The first method of ``owner`` (its forward, or a helper such as BERT's ``_create_attention_masks``) whose
    source calls a mask builder without ``position_ids``: neither as a keyword, nor positionally, nor in a
    ``**dict`` built in the same method. Only plain evidence counts: a call whose arguments cannot be read
    (``**kwargs`` from elsewhere) or a class without source is taken to hand them."""
    from transformers import masking_utils

    builders = [getattr(masking_utils, name) for name in builder_names if hasattr(masking_utils, name)]
    namespace = vars(sys.modules[owner.__module__]) if owner.__module__ in sys.modules else {}
    # the names the owner's module binds to a builder (an ``import ... as`` included)
    names = {name for name, value in namespace.items() if any(value is builder for builder in builders)}
    if not names:
        return None
    try:
        (class_def,) = ast.parse(textwrap.dedent(inspect.getsource(owner))).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    position_index = min(list(inspect.signature(builder).parameters).index("position_ids") for builder in builders)
    for method in class_def.body:
        if isinstance(method, ast.FunctionDef) and _calls_without_positions(method, set(names), position_index):
            return method.name
    return None


def _calls_without_positions(function: ast.FunctionDef, names: set[str], position_index: int) -> bool:
    """Whether ``function`` calls one of ``names`` (mask builders) without ``position_ids`` (see
    :func:`_method_building_mask_without_positions`); ``position_index``: their place among the positional
    arguments."""
    dict_keys: dict[str, set[str] | None] = {}  # the function's local dicts and their keys (None: not all known)

    def keys_of(value: ast.expr) -> set[str] | None:
        if isinstance(value, ast.Name):
            return dict_keys.get(value.id)
        if isinstance(value, ast.Dict):  # ``{"config": ..., **other}``
            keys: set[str] = set()
            for key, item in zip(value.keys, value.values):
                more = {key.value} if isinstance(key, ast.Constant) else keys_of(item) if key is None else None
                if more is None:
                    return None
                keys |= more
            return keys
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "copy":
            return keys_of(value.func.value)  # ``sliding_mask_kwargs = mask_kwargs.copy()`` (Gemma 3)
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "dict" and not value.args:
            return {k.arg for k in value.keywords if k.arg} if all(k.arg for k in value.keywords) else None
        return None

    for node in sorted((n for n in ast.walk(function) if isinstance(n, ast.Assign)), key=lambda n: n.lineno):
        targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
        # ``mask_function = create_causal_mask if ... else create_sliding_window_causal_mask`` (Mistral, Phi-3)
        if any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(node.value)):
            names.update(targets)
        keys = keys_of(node.value)
        for target in targets:
            if keys is not None or target in dict_keys:
                dict_keys[target] = None if keys is None else set(keys)
        for target in node.targets:  # ``mask_kwargs["position_ids"] = ...`` adds a key to a known dict
            if (isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name)
                    and dict_keys.get(target.value.id) is not None and isinstance(target.slice, ast.Constant)):
                dict_keys[target.value.id].add(target.slice.value)

    def hands_positions(call: ast.Call) -> bool:
        if len(call.args) > position_index or any(isinstance(a, ast.Starred) for a in call.args):
            return True
        for keyword in call.keywords:
            if keyword.arg == "position_ids":
                return True
            if keyword.arg is None:  # ``**mapping``: a dict whose keys are known is read, any other given the benefit
                keys = keys_of(keyword.value)
                if keys is None or "position_ids" in keys:
                    return True
        return False

    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
               and not hands_positions(node) for node in ast.walk(function))
