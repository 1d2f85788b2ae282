"""An adapter-only export that loads with ``peft.AutoPeftModelForCausalLM``: the policy's stacked adapter
(:func:`lit_grpo.models.lora_export.cumulative_adapter`) and, beside it, the base it applies to, checked against the
policy's base and named in the adapter's config. Shared by ``python -m lit_grpo export --adapter-only`` and
``HFExport(adapter_only=True)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from lit_grpo.models.lora import LoraArgs, apply_lora
from lit_grpo.models.lora_export import cumulative_adapter, write_adapter
from lit_grpo.models.lora_layers import lora_spec
from lit_grpo.models.lora_merge import merge_adapter_into_base, merge_log
from lit_grpo.models.lora_tensors import base_hash

#: the folder inside an adapter-only export that holds the base the adapter applies to
BASE_DIR = "base"


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
