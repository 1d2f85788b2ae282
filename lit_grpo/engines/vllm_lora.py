"""LoRA adapters (``model.lora``) in vLLM, both kinds: the colocated ``VLLMEngine`` and ``vllm serve``
(``ServerEngine`` with ``kind: vllm``). vLLM is not imported here.

vLLM takes adapters by path, through its own LoRA mechanism: each push writes a new adapter version in peft's format
(``adapter_config.json`` + ``adapter_model.safetensors``, ``lit_grpo.models.lora.write_adapter``) into ``<dir>/v<k>``,
and the requests name it (``LoRARequest("v<k>", k, path)`` colocated, ``model: "v<k>"`` for ``vllm serve``). The
newest ``keep`` versions stay loaded (K + 1, K = ``data.max_staleness``: a request sampled before a push may still
name the previous one), older ones are unloaded and their directories removed. Both kinds run that sequence through
one object, ``lit_grpo.engines.adapter_versions.VersionedAdapters``; this module holds what is vLLM's own: the ranks
it accepts, the ``LLM`` arguments, and the base weights a merge reloads.

A stage swap merges the adapter into the trainer's base (``lit_grpo.models.lora.swap_reference_by_merge``). vLLM's base
weights are fused and cannot be read back under the model's names, so a merge reaches vLLM as a push of the
trainer's merged base (:func:`base_named_tensors`, the plain model's names) through the full-weight path, then the
new adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.engines.adapter_versions import AdapterVersion, AdapterVersions  # noqa: F401 (their former home)

#: the values ``LLM(max_lora_rank=...)`` / ``vllm serve --max-lora-rank`` accept (``vllm/config/lora.py``,
#: ``MaxLoRARanks``, vLLM 0.32)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_max_lora_rank(r: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``r`` (vLLM pads smaller
    adapters up to it). Raises ValueError for an ``r`` that is not an integer >= 1 or exceeds vLLM's largest."""
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"a LoRA rank must be an integer >= 1, got {r!r}")
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} exceeds the largest vLLM serves ({VLLM_LORA_RANKS[-1]}); choose a smaller "
                     "model.lora.r")


def lora_llm_kwargs(spec: dict[str, Any], keep: int) -> dict[str, Any]:
    """``vllm.LLM`` arguments for sampling with adapters of ``spec`` (``lit_grpo.models.lora.lora_spec``), ``keep``
    versions loaded at once: ``enable_lora``, ``max_lora_rank`` (:func:`vllm_max_lora_rank`), ``max_loras`` and
    ``max_cpu_loras`` (``keep``: vLLM may cache no version beyond the ones kept)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"the number of adapter versions kept must be an integer >= 1, got {keep!r}")
    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(int(spec["r"])), "max_loras": keep,
            "max_cpu_loras": keep}


def base_named_tensors(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The LoRA policy's base weights (the adapters left out) under the plain model's names, full, one at a time:
    what vLLM loads to follow a merge. A collective under FSDP (every rank iterates it to the end)."""
    from lit_grpo.core.distributed import full_named_parameters
    from lit_grpo.models.lora import plain_name

    for name, tensor in full_named_parameters(policy):
        if ".lora_" not in name:
            yield plain_name(name), tensor
