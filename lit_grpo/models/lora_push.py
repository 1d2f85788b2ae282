"""The content of a LoRA push (Algorithm 1, lines 8-9): the adapter, plus the merges the sampler has not applied yet,
so that its base follows the trainer's (:class:`AdapterUpdate`, built by :func:`adapter_update`, checked by
``base_hash``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lit_grpo.models.lora_layers import lora_spec
from lit_grpo.models.lora_merge import merge_log
from lit_grpo.models.lora_tensors import adapter_state, base_hash


@dataclass(frozen=True)
class AdapterUpdate:
    """One LoRA push (``model.lora``): what a sampler holding the same base and a LoRA adapter of the same ``spec``
    needs to sample from the policy. The sampler applies ``merges`` to its base in order (each one the adapter a
    ``RefModelSwap`` merged into the trainer's base, with ``lit_grpo.models.lora.merge_adapter_into_base``), checks its
    base against ``base_hash`` when it is given (sent at the first push of a fit and with every merge), then loads
    ``adapter``. Tensors travel in the dtype of a full push (the policy's), under peft's saved names.

    Attributes:
        spec: ``lit_grpo.models.lora.lora_spec`` of the policy (r, alpha, target modules): the adapter's structure.
        merges: the merged adapters the engine has not applied yet, oldest first.
        adapter: the policy's current adapter tensors.
        base_hash: ``lit_grpo.models.lora.base_hash`` of the trainer's base after ``merges``, or ``None`` (not checked).
        step: the optimizer step of the policy the adapter belongs to.
    """

    spec: dict[str, Any]
    merges: tuple[dict[str, torch.Tensor], ...]
    adapter: dict[str, torch.Tensor]
    base_hash: str | None
    step: int

    def __post_init__(self) -> None:
        if not isinstance(self.spec, dict) or not self.spec:
            raise ValueError(f"AdapterUpdate.spec must be the non-empty dict of lora_spec, got {self.spec!r}")
        if not isinstance(self.merges, tuple):
            raise ValueError(f"AdapterUpdate.merges must be a tuple of adapter dicts, got {type(self.merges).__name__}")
        for what, tensors in [("adapter", self.adapter)] + [(f"merges[{i}]", m) for i, m in enumerate(self.merges)]:
            if not isinstance(tensors, dict) or not tensors:
                raise ValueError(f"AdapterUpdate.{what} must be a non-empty dict of tensors")
            bad = [name for name, t in tensors.items() if not isinstance(t, torch.Tensor)]
            if bad:
                raise ValueError(f"AdapterUpdate.{what}[{bad[0]!r}] is a {type(tensors[bad[0]]).__name__}, "
                                 "expected a tensor")
        if self.base_hash is not None and not isinstance(self.base_hash, str):
            raise ValueError(f"AdapterUpdate.base_hash must be a hex string or None, got {self.base_hash!r}")
        if isinstance(self.step, bool) or not isinstance(self.step, int) or self.step < 0:
            raise ValueError(f"AdapterUpdate.step must be an integer >= 0, got {self.step!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it carries (adapter and merges): ``sync/bytes`` of a LoRA push."""
        return sum(t.numel() * t.element_size() for tensors in (self.adapter, *self.merges) for t in tensors.values())



def adapter_update(policy: nn.Module, merges_applied: int, with_hash: bool, step: int = 0) -> AdapterUpdate:
    """The LoRA push to an engine whose base holds ``merges_applied`` of the policy's merges: the merges it lacks,
    the current adapter, and the base's hash when ``with_hash`` or when merges travel. A collective under FSDP."""
    entries = merge_log(policy).entries
    valid = isinstance(merges_applied, int) and not isinstance(merges_applied, bool)
    if not valid or not 0 <= merges_applied <= len(entries):
        raise ValueError(f"the engine says it applied {merges_applied!r} merges; the policy has made {len(entries)} "
                         "(expected an integer between 0 and that): it follows another run's base")
    merges = tuple(entries[merges_applied:])
    digest = base_hash(policy) if with_hash or merges else None
    return AdapterUpdate(spec=lora_spec(policy), merges=merges, adapter=adapter_state(policy), base_hash=digest,
                         step=int(step))

