"""A LoRA policy written as one adapter in peft's format: the merges so far and the current adapter stacked
(:func:`cumulative_adapter`), so that it applies to the base the policy started from. The export that also writes
that base beside it is :mod:`lit_grpo.models.adapter_export`'s."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.models.lora_layers import lora_spec
from lit_grpo.models.lora_merge import merge_log
from lit_grpo.models.lora_tensors import adapter_state


def cumulative_adapter(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """One adapter that, on the base the policy started from, gives the policy: the n merges so far and the current
    adapter stacked, ``sum_i s B_i A_i = s [B_1 .. B_n+1] @ [A_1; ..; A_n+1]``, a LoRA of rank ``r (n + 1)`` with
    alpha ``alpha (n + 1)`` (the same scale). Returns its spec (:func:`lora_spec`'s keys) and tensors. A collective
    under FSDP."""
    spec = lora_spec(model)
    adapters = [*merge_log(model).entries, adapter_state(model)]
    tensors = {}
    for key in adapters[-1]:
        dim = 0 if ".lora_A." in key else 1  # A is [r, in], B is [out, r]
        tensors[key] = torch.cat([adapter[key] for adapter in adapters], dim=dim)
    spec = {**spec, "r": spec["r"] * len(adapters), "alpha": spec["alpha"] * len(adapters)}
    return spec, tensors


def save_adapter(model: nn.Module, dirpath: str | Path, base_model: str | None = None) -> Path:
    """Write the policy's adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``), as
    :func:`cumulative_adapter` makes it, so ``PeftModel.from_pretrained(base, dirpath)`` on the starting base gives
    the policy. ``base_model`` is recorded as the config's ``base_model_name_or_path``. Rank 0's job: gather first
    (:func:`cumulative_adapter`) on every rank under FSDP."""
    spec, tensors = cumulative_adapter(model)
    return write_adapter(spec, tensors, dirpath, base_model)


def write_adapter(spec: dict[str, Any], tensors: dict[str, torch.Tensor], dirpath: str | Path,
                  base_model: str | None = None) -> Path:
    """An adapter of :func:`lora_spec`'s ``spec`` and peft-named ``tensors`` written in peft's format."""
    from peft import LoraConfig, TaskType
    from safetensors.torch import save_file

    out = Path(dirpath).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(r=spec["r"], lora_alpha=spec["alpha"], lora_dropout=0.0, bias="none",
                        target_modules=list(spec["target_modules"]), task_type=TaskType.CAUSAL_LM,
                        base_model_name_or_path=base_model)
    config.save_pretrained(str(out))
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    return out
