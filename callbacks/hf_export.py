"""`HFExport`: the trained policy as a Hugging Face model directory at the end of training."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lit_grpo.callbacks.protocol import check_hf_export, full_named_tensors, policy_of
from torch import nn

from lit_grpo.core.distributed import strip_wrapper_prefixes
from lit_grpo.models.adapter_export import export_adapter
from lit_grpo.models.lora import cumulative_adapter, is_lora, merged_named_tensors, peft_model_of, write_adapter


class HFExport(Callback):
    """At the end of training, write the policy (``pl_module.policy``, a transformers model) and the tokenizer
    (``pl_module.tokenizer``, when there is one) to ``dirpath``: safetensors weights, ``config.json``, tokenizer
    files; ``AutoModelForCausalLM.from_pretrained(dirpath)`` loads it. The same directory as
    ``python -m lit_grpo export`` writes from a checkpoint.

    A LoRA policy (``model.lora``) is written merged (a plain model), or with ``adapter_only`` as its adapter alone
    in peft's format, stacked with the adapters its stage swaps merged so that it applies to the starting base; that
    base is written beside it (``dirpath/base``) and named in the adapter's config (the Hub id when the run started
    from one), so ``peft.AutoPeftModelForCausalLM.from_pretrained(dirpath)`` loads it. A module without
    ``hparams.model_name`` gets the adapter alone.

    Sharded (FSDP) weights are gathered one tensor at a time on every rank, as the gather needs; rank zero
    writes, and the other ranks wait until the directory is complete.
    """

    def __init__(self, dirpath: str | Path, adapter_only: bool = False) -> None:
        if not str(dirpath).strip():
            raise ValueError(f"dirpath must name a directory to write the model to, got {dirpath!r}")
        self.dirpath = Path(dirpath).expanduser()
        self.adapter_only = adapter_only

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Hold the module to the protocol before the first batch, not after the run: a ``policy`` with
        ``save_pretrained`` (``lit_grpo.callbacks.protocol.check_hf_export``)."""
        check_hf_export(pl_module)
        if self.adapter_only and not is_lora(policy_of(pl_module, "HFExport")):
            raise ValueError("HFExport(adapter_only=True) needs a LoRA policy (model.lora); got one without adapters")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        policy = policy_of(pl_module, "HFExport")
        if is_lora(policy):
            self.write_lora(trainer, pl_module, policy)
            return
        tensors = full_named_tensors(policy)  # a collective under FSDP: every rank walks it to the end
        if not trainer.is_global_zero:
            for _ in tensors:
                pass  # take part in each gather, keep nothing
        else:
            state = {name: tensor.detach().cpu() for name, tensor in tensors}
            state.update(persistent_buffers(policy))
            self.dirpath.mkdir(parents=True, exist_ok=True)
            policy.save_pretrained(self.dirpath, state_dict=state)
            tokenizer = getattr(pl_module, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(self.dirpath)
        trainer.strategy.barrier("HFExport")


    def write_lora(self, trainer: L.Trainer, pl_module: L.LightningModule, policy: nn.Module) -> None:
        """A LoRA policy: merged into the plain model's weights, or its (stacked) adapter alone. Every rank gathers
        (a collective under FSDP), rank zero writes."""
        hparams = getattr(pl_module, "hparams", {})
        if self.adapter_only and hparams.get("model_name"):  # the base written beside, which peft then loads
            export_adapter(policy, getattr(pl_module, "tokenizer", None), hparams["model_name"],
                           hparams.get("dtype", "float32"), self.dirpath, writer=trainer.is_global_zero)
        elif self.adapter_only:  # a module that does not say what it loaded: the adapter alone, with no base named
            spec, tensors = cumulative_adapter(policy)
            if trainer.is_global_zero:
                write_adapter(spec, tensors, self.dirpath)
        else:
            tensors = merged_named_tensors(policy)  # a collective under FSDP: every rank walks it to the end
            if not trainer.is_global_zero:
                for _ in tensors:
                    pass  # take part in each gather, keep nothing: the full merged model lives on rank 0's host only
            else:
                state = {name: tensor.detach().cpu() for name, tensor in tensors}
                self.dirpath.mkdir(parents=True, exist_ok=True)
                peft_model_of(policy).get_base_model().save_pretrained(self.dirpath, state_dict=state)
        tokenizer = getattr(pl_module, "tokenizer", None)
        if tokenizer is not None and trainer.is_global_zero:
            tokenizer.save_pretrained(self.dirpath)
        trainer.strategy.barrier("HFExport")


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Buffers saved with the weights (FSDP leaves buffers unsharded). Found module by module rather than
    through ``state_dict()``, which under FSDP1 is a collective that rank zero alone must not start."""
    out = {}
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[strip_wrapper_prefixes(f"{prefix}.{name}" if prefix else name)] = buf.detach().cpu()
    return out
