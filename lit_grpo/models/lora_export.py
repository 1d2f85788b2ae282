"""A LoRA policy written as one adapter in peft's format: the merges so far and the current adapter stacked
(:func:`cumulative_adapter`), so that it applies to the base the policy started from; and, for an export that
loads with ``peft.AutoPeftModelForCausalLM``, that base written beside it (:func:`export_adapter`), shared by
``python -m lit_grpo export --adapter-only`` and ``HFExport(adapter_only=True)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.models.lora_layers import lora_spec
from lit_grpo.models.lora_merge import merge_log
from lit_grpo.models.lora_tensors import adapter_state, base_hash

#: the folder inside an adapter-only export that holds the base the adapter applies to
BASE_DIR = "base"


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


def is_hub_id(model_name: str) -> bool:
    """Whether ``model_name`` names a Hugging Face Hub model: not one of lit_grpo's aliases (built in memory or
    converted on first use, which nothing else loads) and not a local directory."""
    from lit_grpo.models.loading import ALIAS_LOADERS

    return model_name not in ALIAS_LOADERS and not Path(model_name).expanduser().exists()


def adapter_base_name(model_name: str, base_dir: Path) -> str:
    """What an adapter export names as its base (``base_model_name_or_path``, what peft's ``AutoPeftModel`` loads):
    the Hub id the policy started from, which loads anywhere; else the absolute path of the base written beside the
    adapter (an alias loads nowhere but in lit_grpo, and a local directory may change or go)."""
    return model_name if is_hub_id(model_name) else str(base_dir.expanduser().resolve())


def neutral_generation_config(model: nn.Module, tokenizer) -> Any:  # noqa: ANN001 (a Hugging Face tokenizer)
    """A ``GenerationConfig`` with the special token ids of ``tokenizer`` (and the model's further eos ids) and no
    sampling values: an engine that reads the directory's ``generation_config.json`` as its sampling defaults
    (vLLM does) then samples from the plain softmax unless a request says otherwise."""
    from transformers import GenerationConfig

    from lit_grpo.models.loading import eos_token_ids, pad_token_id

    return GenerationConfig(bos_token_id=getattr(tokenizer, "bos_token_id", None),
                            eos_token_id=eos_token_ids(tokenizer, model), pad_token_id=pad_token_id(tokenizer))


def export_adapter(model: nn.Module, tokenizer, model_name: str, dtype: str, out: str | Path,  # noqa: ANN001
                   writer: bool = True) -> Path:
    """Write a LoRA policy's adapter to ``out`` in peft's format (stacked with its merges: :func:`cumulative_adapter`),
    the base it applies to into ``out/base`` (the starting base: ``model_name`` loaded in ``dtype``, as training
    started from it, with the tokenizer and a generation config without sampling values), and the tokenizer beside
    the adapter. The adapter names its base by :func:`adapter_base_name`.

    The base written is checked first: with the policy's merges applied to it (in the trainer's fixed order, which
    reproduces the trainer's base bitwise) its hash must be that of the policy's base, else a model that changed
    since training (a re-converted alias, a new revision of a Hub id) would be written silently. A mismatch raises
    ``ValueError`` and leaves no base behind.

    A collective under FSDP: every rank calls it, and only the ``writer`` (rank zero) loads the base and writes."""
    import shutil

    from lit_grpo.models.loading import load_model_and_tokenizer
    from lit_grpo.models.lora import LoraArgs, apply_lora
    from lit_grpo.models.lora_merge import merge_adapter_into_base

    out = Path(out).expanduser()
    expected = base_hash(model)  # collectives first, on every rank
    spec, tensors = cumulative_adapter(model)
    if not writer:
        return out
    base_dir = out / BASE_DIR
    base, _ = load_model_and_tokenizer(model_name, dtype)
    base.generation_config = neutral_generation_config(base, tokenizer)
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    merges = merge_log(model).entries
    if merges:  # the written base, merged as training merged it, must be the policy's base
        with torch.random.fork_rng():  # the adapter's initial values do not matter: only merges are applied
            layers = lora_spec(model)  # the adapter's own rank and alpha (``spec`` is the stacked one's)
            base = apply_lora(base, LoraArgs(r=layers["r"], alpha=layers["alpha"],
                                             target_modules=layers["target_modules"]))
        for entry in merges:
            merge_adapter_into_base(base, entry)
    held = base_hash(base)
    if held != expected:
        shutil.rmtree(base_dir, ignore_errors=True)
        raise ValueError(f"adapter-only export: {model_name!r} ({dtype}) loads now as a base whose hash after the "
                         f"policy's {len(merges)} merge(s) is {held[:16]}..., the policy's base has "
                         f"{expected[:16]}...: the model changed since training; export merged (without "
                         "adapter_only / --adapter-only), which needs no base")
    write_adapter(spec, tensors, out, base_model=adapter_base_name(model_name, base_dir))
    tokenizer.save_pretrained(out)
    return out
