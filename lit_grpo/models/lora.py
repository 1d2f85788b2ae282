"""LoRA adapters on the policy (``model.lora``), through peft: their arguments (:class:`LoraArgs`) and how a policy gets
them (:func:`apply_lora`). No Lightning here. The rest of LoRA lives beside it, one concept a module, and its public
names are importable from here too:

- ``lora_layers``: the peft structure (the peft model in a wrapper, its LoRA layers, adapter names, ``lora_spec``,
  the plain model's names);
- ``lora_tensors``: full tensors read and written (adapter state, base hash; collectives under FSDP);
- ``lora_merge``: merges into the base, the fresh adapter, the merge log, the stage swap by merge;
- ``lora_push``: the content of a push to a sampler (``AdapterUpdate``);
- ``lora_export``: the policy as one stacked adapter in peft's format.

Why LoRA fits the paper's method (Mroueh et al., Algorithm 1): pi_ref is the policy with its adapter switched off (no
second copy of the model), the stage swap is a merge (``lora_merge``), and a weight push sends the adapter plus the
merges the sampler lacks (``lora_push``).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from torch import nn

from lit_grpo.models.lora_export import cumulative_adapter, save_adapter, write_adapter
from lit_grpo.models.lora_layers import (
    ADAPTER,
    PEFT_PREFIX,
    adapter_names,
    adapter_parameters,
    is_lora,
    lora_spec,
    peft_model_of,
    plain_name,
)
from lit_grpo.models.lora_merge import (
    MergeLog,
    lora_delta,
    merge_adapter_into_base,
    merge_log,
    merged_named_tensors,
    reset_adapter,
    swap_reference_by_merge,
)
from lit_grpo.models.lora_push import AdapterUpdate, adapter_update
from lit_grpo.models.lora_tensors import adapter_state, base_hash, load_adapter_state, parameter_bytes

__all__ = [
    "ADAPTER", "ATTENTION_MLP_PROJECTIONS", "PEFT_PREFIX", "AdapterUpdate", "LoraArgs", "MergeLog", "adapter_names",
    "adapter_parameters", "adapter_state", "adapter_update", "apply_lora", "base_hash", "cumulative_adapter",
    "is_lora", "linear_module_names", "load_adapter_state", "lora_delta", "lora_spec", "merge_adapter_into_base",
    "merge_log", "merged_named_tensors", "parameter_bytes", "peft_model_of", "plain_name", "reset_adapter",
    "resolve_target_modules", "save_adapter", "swap_reference_by_merge", "write_adapter",
]

#: the linear projections of attention and MLP in the model families transformers ships (Llama / Qwen / Mistral /
#: SmolLM, GPT-2's Conv1D, GPT-NeoX, Falcon, Phi, OPT, BLOOM): the default targets are those present in the model
ATTENTION_MLP_PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "c_attn", "c_proj", "c_fc", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
    "out_proj", "fc1", "fc2", "qkv_proj", "gate_up_proj", "w1", "w2", "w3",
)


@dataclass(frozen=True)
class LoraArgs:
    """LoRA adapters on the policy (``model.lora`` in a config; ``--model.lora '{"r": 8}'`` on the command line).

    Each targeted linear layer W gets ``W + (alpha / r) * B @ A``, A ``[r, in]`` and B ``[out, r]`` trained, W frozen
    (Hu et al., LoRA, eq. 3 with peft's scaling alpha / r).

    Args:
        r: the adapters' rank.
        alpha: the scale's numerator: the update is ``(alpha / r) * B @ A``.
        dropout: dropout on the adapter's input in the gradient pass (0: none; the policy's own dropout stays off).
            Every scoring pass runs without it (pi_k, the TV monitors, pi_ref, the samplers), and the loss gets the
            dropout-free values with the dropout pass's gradient (``lit_grpo.core.scoring.policy_logprobs``), so the
            ratio pi / alpha stays exactly 1 at v = 1, i = 1; it costs one more no-grad forward per micro-batch.
        target_modules: the module names (last part, e.g. ``q_proj``) that get an adapter; None: every linear
            projection of attention and MLP found in the model (not the embeddings nor ``lm_head``).
    """

    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"lora.r must be an integer >= 1, got {self.r!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be a number in [0, 1), got {self.dropout!r}")
        targets = self.target_modules
        if targets is not None and (isinstance(targets, str) or not targets
                                    or not all(isinstance(t, str) and t for t in targets)):
            raise ValueError(f"lora.target_modules must be a non-empty list of module names (or null: every "
                             f"attention and MLP projection), got {targets!r}")

    @property
    def scale(self) -> float:
        """alpha / r, the factor of B @ A."""
        return self.alpha / self.r


# ---- building ------------------------------------------------------------------------------------------
def linear_module_names(model: nn.Module) -> list[str]:
    """The last name parts of the model's linear layers (``nn.Linear`` and transformers' ``Conv1D``), in the order
    they first appear, without the output embeddings (``lm_head``)."""
    from transformers.pytorch_utils import Conv1D

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, Conv1D)) and module is not output:
            leaf = name.rpartition(".")[2]
            if leaf not in names:
                names.append(leaf)
    return names


def resolve_target_modules(model: nn.Module, targets: list[str] | None) -> list[str]:
    """``targets`` checked against the model's linear layers, or (None) its attention and MLP projections.

    Raises ValueError naming a target that matches no linear layer, and the names available."""
    available = linear_module_names(model)
    if targets is None:
        found = [name for name in available if name in ATTENTION_MLP_PROJECTIONS]
        if not found:
            raise ValueError(f"lora.target_modules=null finds no attention or MLP projection in "
                             f"{type(model).__name__}; name them, among its linear layers {available}")
        return found
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ValueError(f"lora.target_modules {unknown} match no linear layer of {type(model).__name__}; "
                         f"expected among {available}")
    return list(targets)


def apply_lora(model: nn.Module, args: LoraArgs) -> nn.Module:
    """``model`` (a transformers causal LM) with a LoRA adapter of ``args`` on its target modules: a peft
    ``PeftModel`` whose base weights are frozen. A is drawn with peft's init from the torch RNG (so a seeded run
    builds the same adapter), B = 0 (the policy starts as the model). The policy carries its :class:`MergeLog`."""
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(r=args.r, lora_alpha=args.alpha, lora_dropout=args.dropout, bias="none",
                        target_modules=resolve_target_modules(model, args.target_modules),
                        task_type=TaskType.CAUSAL_LM)
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`: peft's to fix
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    peft_model.lit_grpo_merge_log = MergeLog()
    return peft_model

