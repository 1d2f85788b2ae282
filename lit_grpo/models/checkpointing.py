"""Activation checkpointing of the policy's decoder layers: full (``model.gradient_checkpointing: true``) or
selective (``selective``).

Full checkpointing keeps only each layer's input and runs the layer's forward again in the backward: the least
memory, one more forward of the body. Selective checkpointing (PyTorch's ``create_selective_checkpoint_contexts``,
the op-level policy torchtitan calls "selective op AC") keeps what is expensive to compute and cheap to keep, the
outputs of the matrix products and of the attention kernels, and recomputes everything elementwise in between (the
RMSNorms, rotary embeddings, the SiLU and its product, residual additions, dtype casts). Those elementwise results
are what a layer keeps most of: on SmolLM2-135M's shape 43.8 KiB a token a layer without checkpointing against
25.0 KiB with the policy below (``benchmarks/saved_activations.py --checkpointing``), and the recompute costs a few
elementwise passes rather than a forward (SmolLM2 at 4,096 new tokens: a 33 % lower peak, the update 0-4 % slower;
docs/speed.md). The gradients are the same numbers: the recomputed operations are the
same deterministic kernels on the same inputs.

Both go through transformers' own ``activation_checkpointing_enable``, so every family with
``supports_gradient_checkpointing`` takes them, non-reentrant (the only mode the selective policy works in).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lit_grpo.models.loading import checkpointing_call

#: the values ``model.gradient_checkpointing`` takes
Checkpointing = bool | Literal["selective"]

_ATEN = torch.ops.aten
#: operators whose outputs selective checkpointing keeps: the matrix products (a linear layer reaches the dispatcher
#: as ``mm``/``addmm``) and the fused attention kernels of each backend (recomputing one is a whole attention
#: forward). Eager attention's score products are ``bmm`` and are kept too, as they are without checkpointing.
SAVED_OPERATORS = frozenset(
    getattr(_ATEN, name).default for name in (
        "mm", "addmm", "bmm", "baddbmm",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
        "_efficient_attention_forward")
    if hasattr(_ATEN, name))
#: operator namespaces kept whole: the flash-attn package's kernels (``flash_attention_2`` on a GPU) register there
SAVED_NAMESPACES = frozenset({"flash_attn"})


def check_checkpointing(value: object) -> None:
    """One line for a value ``model.gradient_checkpointing`` does not take."""
    if not (isinstance(value, bool) or value == "selective"):
        raise ValueError(f"model.gradient_checkpointing={value!r}: expected false, true (recompute each layer) or "
                         "'selective' (keep the matrix products' and attention's outputs, recompute the rest)")


def keep_products(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep the outputs of :data:`SAVED_OPERATORS` and of :data:`SAVED_NAMESPACES`'
    operators, recompute every other operator."""
    kept = op in SAVED_OPERATORS or getattr(op, "namespace", None) in SAVED_NAMESPACES
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """The two contexts ``torch.utils.checkpoint.checkpoint(context_fn=...)`` takes for the selective policy (a
    fresh pair per layer call: they hold that call's kept outputs)."""
    return create_selective_checkpoint_contexts(keep_products)


def enable_checkpointing(model: nn.Module, mode: Checkpointing) -> None:
    """Checkpoint ``model``'s decoder layers, fully (``True``) or selectively (``"selective"``), non-reentrant
    (which also gives LoRA adapters behind frozen embeddings their gradient); ``False`` leaves it as it is."""
    check_checkpointing(mode)
    if mode is False:
        return
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        kwargs["context_fn"] = selective_contexts
    enable = checkpointing_call(model, "enable")
    # the method's name says which transformers it is: before the rename the same dict had the older name
    prefix = enable.__name__.removesuffix("_enable")
    enable(**{f"{prefix}_kwargs": kwargs})
