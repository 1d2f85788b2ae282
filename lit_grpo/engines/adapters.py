"""A sampler's copy of a LoRA policy (``model.lora``): its base and its adapter kept apart, following the trainer's
``AdapterUpdate``s. Shared by the in-process engine (``TransformersEngine``) and the project's rollout server
(``lit_grpo.serve.served_adapter``), so that both apply a merge with the trainer's own function and check it alike.

Why unmerged: a push then copies adapter tensors only (no rewrite of the base, no float drift from add/subtract
cycles), and the base changes only at a ``RefModelSwap``, through ``lit_grpo.models.lora.merge_adapter_into_base``
applied
to equal inputs in one fixed order, so the sampler's base stays bitwise the trainer's (checked by ``base_hash``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

#: the keys of ``lit_grpo.models.lora.lora_spec`` a sampler needs to rebuild the adapter's structure
SPEC_KEYS = ("r", "alpha", "target_modules")
#: what peft puts into the names of the base weights of the layers that carry an adapter
BASE_LAYER = ".base_layer"


def check_spec(spec: Any) -> dict[str, Any]:
    """``spec`` as received (over HTTP too): a dict with ``r`` (int >= 1), ``alpha`` (> 0) and ``target_modules`` (a
    non-empty list of names); a ``ValueError`` naming the bad field otherwise."""
    if not isinstance(spec, dict) or any(k not in spec for k in SPEC_KEYS):
        raise ValueError(f"a LoRA spec needs the fields {list(SPEC_KEYS)}, got {spec!r}")
    r, alpha, targets = spec["r"], spec["alpha"], spec["target_modules"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA spec r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"LoRA spec alpha must be a number > 0, got {alpha!r}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"LoRA spec target_modules must be a non-empty list of module names, got {targets!r}")
    return spec


def same_structure(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two specs build the same adapter (r, alpha and the set of target modules)."""
    return (int(a["r"]) == int(b["r"]) and float(a["alpha"]) == float(b["alpha"])
            and sorted(a["target_modules"]) == sorted(b["target_modules"]))


def wrap_with_spec(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """``model`` (a plain causal LM) as a peft model with a LoRA adapter of ``spec``'s structure, frozen, in eval
    mode, its adapter in the base's dtype (as the trainer's travels). The adapter's initial values do not matter (an
    update overwrites them); they are drawn under a forked RNG, so making a sampler's copy leaves the trainer's
    random stream where it was."""
    from peft import LoraConfig, TaskType, get_peft_model

    check_spec(spec)
    # the trainer's structure (lit_grpo.models.lora.apply_lora): the same peft class, layers and scale
    config = LoraConfig(r=int(spec["r"]), lora_alpha=float(spec["alpha"]), lora_dropout=0.0, bias="none",
                        target_modules=list(spec["target_modules"]), task_type=TaskType.CAUSAL_LM)
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"]
    with torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices})):
        wrapped = get_peft_model(model, config, autocast_adapter_dtype=False)
    return wrapped.requires_grad_(False).eval()


def ensure_lora(model: nn.Module, spec: dict[str, Any]) -> nn.Module:
    """``model`` itself when it already carries a LoRA adapter of ``spec``'s structure, else wrapped by
    ``wrap_with_spec``; a ``ValueError`` when it carries another structure."""
    from lit_grpo.models.lora import is_lora, lora_spec

    check_spec(spec)
    if not is_lora(model):
        return wrap_with_spec(model, spec)
    held = lora_spec(model)
    if not same_structure(held, spec):
        raise ValueError(f"the sampler's adapter has r={held['r']}, alpha={held['alpha']}, targets "
                         f"{sorted(held['target_modules'])}, the update's r={spec['r']}, alpha={spec['alpha']}, "
                         f"targets {sorted(spec['target_modules'])}: model.lora changed; restart the sampler")
    return model


def merged_weights(model: nn.Module) -> list[torch.Tensor]:
    """The base weights a merge writes (those of the layers that carry an adapter), to restore them if a merge does
    not reproduce the trainer's base."""
    return [p for name, p in model.named_parameters() if BASE_LAYER + "." in name]


@torch.no_grad()
def apply_adapter_update(model: nn.Module, merges: Iterable[dict[str, torch.Tensor]],
                         adapter: dict[str, torch.Tensor], base_hash: str | None, where: str) -> tuple[int, str | None]:
    """Apply an ``AdapterUpdate`` to a sampler's peft ``model``: the ``merges`` to its base in order (with the
    trainer's ``merge_adapter_into_base``), then a check that ``base_hash`` (when given) is the hash of its base,
    then ``adapter``. All or nothing: a hash that differs restores the base as it was and raises a one-line
    ``ValueError`` naming both hashes and ``where`` (the sampler). Returns the number of merges applied and the
    base's hash when it was computed (``None`` otherwise)."""
    from lit_grpo.models.lora import base_hash as hash_of_base
    from lit_grpo.models.lora import load_adapter_state, merge_adapter_into_base

    merges = list(merges)
    saved = [w.detach().clone() for w in merged_weights(model)] if merges else []
    try:
        for entry in merges:
            merge_adapter_into_base(model, entry)
        held = hash_of_base(model) if base_hash is not None else None
        if base_hash is not None and held != base_hash:
            after = f"after {len(merges)} merge(s) " if merges else ""
            raise ValueError(f"{where}'s base {after}has hash {held[:16]}..., the trainer's has {base_hash[:16]}...: "
                             "it was started from another model (or dtype) than the policy's base; start it from "
                             "the policy's model_name and dtype")
        load_adapter_state(model, adapter)
    except BaseException:
        for weight, value in zip(merged_weights(model), saved):
            weight.copy_(value)
        raise
    return len(merges), held
