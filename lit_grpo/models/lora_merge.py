"""Merges of a LoRA adapter into its base: the fixed-order delta (:func:`lora_delta`), the merge itself
(:func:`merge_adapter_into_base`), the fresh adapter after it (:func:`reset_adapter`), the log of merges a policy
carries (:class:`MergeLog`), the merged view a push to an adapter-less engine sends (:func:`merged_named_tensors`),
and the stage swap by merge (:func:`swap_reference_by_merge`).

Why LoRA fits the paper's method (Mroueh et al., Algorithm 1): pi_ref is the policy with its adapter switched off, and
the stage swap (line 16, pi_ref <- pi_theta) is "merge the adapter into the base, start a fresh adapter": after it
pi_ref (adapter off = the merged base) equals the policy (merged base plus an adapter with B = 0). The functions that
read or write full tensors are collectives under FSDP (``lit_grpo.models.lora_tensors``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.core.distributed import all_gather_objects
from lit_grpo.models.lora_layers import ADAPTER, adapter_parameters, adapter_params, lora_layers, peft_model_of
from lit_grpo.models.lora_tensors import (
    adapter_state,
    base_parameters,
    check_adapter,
    full_tensor,
    full_view,
    write_full,
)


class MergeLog:
    """The adapters merged into the base so far, oldest first (``entries``, peft's saved names, on the CPU). A
    sampler that has applied ``n`` of them gets ``entries[n:]`` at its next push and applies them in order with
    :func:`merge_adapter_into_base`, so its base follows the trainer's. Kept in checkpoints (``state_dict``)."""

    def __init__(self) -> None:
        self.entries: list[dict[str, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def append(self, adapter: dict[str, torch.Tensor]) -> None:
        self.entries.append({k: v.detach().to("cpu", copy=True) for k, v in adapter.items()})

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [dict(entry) for entry in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        entries = state.get("entries") if isinstance(state, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError(f"a LoRA merge log's state must be {{'entries': [dict of tensors, ...]}}, "
                             f"got {type(state).__name__}")
        self.entries = [dict(entry) for entry in entries]



def merge_log(model: nn.Module) -> MergeLog:
    """The policy's :class:`MergeLog` (made by :func:`apply_lora`)."""
    peft_model = peft_model_of(model)
    log = peft_model.__dict__.get("lit_grpo_merge_log")
    if log is None:
        log = peft_model.__dict__["lit_grpo_merge_log"] = MergeLog()
    return log



def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float, fan_in_fan_out: bool,
               dtype: torch.dtype) -> torch.Tensor:
    """LoRA's weight update ``scale * B @ A`` (Hu et al., eq. 3; scale = alpha / r), in ``dtype`` and laid out like
    the base weight (transposed for GPT-2's ``Conv1D``, whose weight is ``[in, out]``). One fixed order of operations,
    so equal inputs give bitwise-equal deltas in any process."""
    delta = (b.to(dtype) @ a.to(dtype)) * scale
    return delta.T if fan_in_fan_out else delta


@torch.no_grad()
def merge_adapter_into_base(model: nn.Module,
                            adapter: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Base weight of every LoRA layer ``+= (alpha / r) * B @ A`` (:func:`lora_delta`), with ``adapter`` (peft's
    saved names) or, when None, the model's current adapter, in module order. Returns the merged adapter tensors
    (full, on the CPU). The adapter itself is left as it is (:func:`reset_adapter` starts a fresh one). Two
    processes merging equal adapters into equal bases get bitwise-equal bases. A collective under FSDP."""
    if adapter is not None:
        check_adapter(model, adapter, "merged adapter")
    merged = adapter_state(model) if adapter is None else {k: v.detach().to("cpu", copy=True)
                                                          for k, v in adapter.items()}
    with full_view(model, writeback=True):
        for name, layer in lora_layers(model):
            weight = layer.get_base_layer().weight
            base = full_tensor(weight)
            delta = lora_delta(merged[f"{name}.lora_A.weight"].to(base.device),
                               merged[f"{name}.lora_B.weight"].to(base.device),
                               layer.scaling[ADAPTER], bool(getattr(layer, "fan_in_fan_out", False)), base.dtype)
            write_full(weight, base + delta)
    return merged


@torch.no_grad()
def reset_adapter(model: nn.Module) -> None:
    """A fresh adapter: B = 0 and A redrawn with peft's default init (Kaiming-uniform, a = sqrt(5)), so the policy's
    function is unchanged. A comes from its own generator, seeded by the run's torch seed (``torch.initial_seed``,
    rank 0's) and the number of merges so far: every rank draws the same A, and a resumed run the A of the run it
    continues, whatever else drew from the global RNG meanwhile (building a sampler's copy on resume does)."""
    key = f"{torch.initial_seed()}:{len(merge_log(model))}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1
    seed = int(all_gather_objects(seed)[0])  # rank 0's, so sharded and replicated ranks agree
    generator = torch.Generator().manual_seed(seed)
    with full_view(model, writeback=True):
        for _, layer in lora_layers(model):
            a, b = adapter_params(layer)
            fresh_a = torch.empty(tuple(a.size()), dtype=torch.float32)
            nn.init.kaiming_uniform_(fresh_a, a=math.sqrt(5), generator=generator)
            write_full(a, fresh_a.to(a.device, a.dtype))
            write_full(b, torch.zeros(tuple(b.size()), dtype=b.dtype, device=b.device))



def merged_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy as a plain model's full weights: ``W + (alpha / r) * B @ A`` for each LoRA layer, the other
    weights as they are, under the plain model's names, one at a time (a push to an engine that takes no adapters).
    The policy is not changed. A collective under FSDP: every rank iterates it to the end."""
    with torch.no_grad(), full_view(model, writeback=False):
        layers = {id(layer.get_base_layer().weight): layer for _, layer in lora_layers(model)}
        for name, param in base_parameters(model):
            full = full_tensor(param).detach()
            layer = layers.get(id(param))
            if layer is not None:
                a, b = (full_tensor(p).detach().to(full.device) for p in adapter_params(layer))
                full = full + lora_delta(a, b, layer.scaling[ADAPTER], bool(getattr(layer, "fan_in_fan_out", False)),
                                         full.dtype)
            yield name, full



@torch.no_grad()
def swap_reference_by_merge(policy: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Algorithm 1, line 16 (pi_ref <- pi_theta) for a LoRA policy whose pi_ref is its adapter switched off: merge
    the adapter into the base (:func:`merge_adapter_into_base`), log the merge, start a fresh adapter (B = 0,
    :func:`reset_adapter`) and clear the adapter's optimizer state (its moments belong to the old adapter). After
    it, pi_ref = merged base = the policy. A collective under FSDP."""
    if hasattr(policy, "reshard"):  # FSDP2: every parameter in its sharded form before shards are written
        policy.reshard()
    merged = merge_adapter_into_base(policy)
    merge_log(policy).append(merged)
    reset_adapter(policy)
    params = adapter_parameters(policy)
    for optimizer in optimizers:
        for param in params:
            optimizer.state.pop(param, None)

