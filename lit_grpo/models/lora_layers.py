"""A LoRA policy's peft structure: the peft model inside any wrapper, its LoRA layers in module order, the adapter's
tensor names and parameters, its spec (what a sampler needs to rebuild it), and the plain model's names of the base.

Names: adapters travel under peft's saved names (``get_peft_model_state_dict``: ``base_model.model.<hf module>.
lora_A.weight``); base weights and merged full weights under the plain model's names (``model.layers.0...``). peft is
imported by the functions that use it, so that parsing ``model.lora`` stays cheap.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lit_grpo.core.distributed import strip_wrapper_prefixes

ADAPTER = "default"  # peft's name of the one adapter a policy carries
PEFT_PREFIX = "base_model.model."  # what peft puts before the plain model's names


def peft_model_of(model: nn.Module) -> nn.Module:
    """The peft model inside ``model`` (itself, or under a DDP / FSDP1 / compile wrapper). Raises ValueError if
    there is none."""
    from peft import PeftModel

    seen = model
    while not isinstance(seen, PeftModel):
        inner = getattr(seen, "module", None) or getattr(seen, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            raise ValueError(f"expected a peft model with a LoRA adapter (model.lora), got {type(model).__name__}")
        seen = inner
    return seen


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (a peft model, also under DDP / FSDP wrappers)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # no peft installed: no model can carry its adapters
        return False
    return any(isinstance(m, LoraLayer) for m in model.modules())



def lora_spec(model: nn.Module) -> dict[str, Any]:
    """What a sampler needs to build the same adapter structure: ``r``, ``alpha``, ``target_modules`` (resolved,
    sorted) and ``dropout`` (0: sampling never drops), a JSON-able dict whose keys are :class:`LoraArgs`' fields,
    so ``apply_lora(model, LoraArgs(**spec))`` rebuilds it."""
    config = peft_model_of(model).peft_config[ADAPTER]
    return {"r": int(config.r), "alpha": float(config.lora_alpha), "dropout": 0.0,
            "target_modules": sorted(config.target_modules)}



def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(peft module name, layer)`` of every LoRA layer, in module order (the one fixed order of every merge)."""
    from peft.tuners.lora import LoraLayer

    layers = [(strip_wrapper_prefixes(name), module) for name, module in model.named_modules()
              if isinstance(module, LoraLayer)]
    if not layers:
        raise ValueError(f"expected a peft model with LoRA adapters (model.lora), got {type(model).__name__} "
                         "without any")
    return layers


def adapter_params(layer: nn.Module) -> tuple[nn.Parameter, nn.Parameter]:
    return layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight


def adapter_names(model: nn.Module) -> list[str]:
    """peft's saved names of the adapter tensors, in module order: A then B of each LoRA layer."""
    return [f"{name}.{part}.weight" for name, _ in lora_layers(model) for part in ("lora_A", "lora_B")]


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The adapter parameters (the trainable ones), in the order of :func:`adapter_names`."""
    return [p for _, layer in lora_layers(model) for p in adapter_params(layer)]



def plain_name(name: str) -> str:
    """A peft base parameter's name as the plain model names it (``base_model.model.`` and ``.base_layer`` gone)."""
    return strip_wrapper_prefixes(name).removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")

