"""Full tensors of a LoRA policy, read and written: the adapter's (:func:`adapter_state`, :func:`load_adapter_state`),
the base's hash (:func:`base_hash`) and the bytes of a full push (:func:`parameter_bytes`).

Sharded policies: these functions are collectives under FSDP2 (``full_tensor`` per tensor, in the same order on every
rank) and FSDP1 (``summon_full_params``): every rank calls them together.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch
from torch import nn

from lit_grpo.core.distributed import is_fsdp1
from lit_grpo.models.lora_layers import adapter_params, lora_layers, plain_name


@contextlib.contextmanager
def full_view(model: nn.Module, writeback: bool) -> Iterator[None]:
    """FSDP1 shows full parameters only inside ``summon_full_params``; FSDP2 and plain models need nothing."""
    if is_fsdp1(model):
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=writeback):
            yield
    else:
        yield


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 shard (an all-gather every rank makes), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor ``full`` into ``param``: its own shard of it for an FSDP2 parameter (no
    communication: every rank holds ``full``), the whole of it otherwise."""
    with torch.no_grad():
        if hasattr(param, "full_tensor"):
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)



@torch.no_grad()
def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under peft's saved names (``get_peft_model_state_dict``'s), full, detached copies on the
    CPU in the policy's dtype. A collective under FSDP: every rank calls it."""
    out = {}
    with full_view(model, writeback=False):
        for name, layer in lora_layers(model):
            for part, param in zip(("lora_A", "lora_B"), adapter_params(layer)):
                out[f"{name}.{part}.weight"] = full_tensor(param).detach().to("cpu", copy=True)
    return out


def check_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], what: str) -> None:
    """One-line errors for a missing, unknown or mis-shaped adapter tensor, before anything is written."""
    expected = {}
    for name, layer in lora_layers(model):
        for part, param in zip(("lora_A", "lora_B"), adapter_params(layer)):
            shape = param.shape if not hasattr(param, "full_tensor") else param.size()
            expected[f"{name}.{part}.weight"] = torch.Size(shape)
    missing = [k for k in expected if k not in tensors]
    unknown = [k for k in tensors if k not in expected]
    if missing or unknown:
        raise ValueError(f"{what} does not fit the model's adapter: "
                         + (f"missing {missing[0]!r} ({len(missing)} in all)" if missing else "")
                         + ("; " if missing and unknown else "")
                         + (f"unknown {unknown[0]!r} ({len(unknown)} in all)" if unknown else ""))
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise ValueError(f"{what}[{key!r}] has shape {list(tensors[key].shape)}, the model's adapter "
                             f"{list(shape)}")


@torch.no_grad()
def load_adapter_state(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (peft's saved names, as :func:`adapter_state` gives them) into the model's adapter,
    exactly. Raises ValueError on a missing, unknown or mis-shaped name, before any is written."""
    check_adapter(model, tensors, "adapter")
    with full_view(model, writeback=True):
        for name, layer in lora_layers(model):
            for part, param in zip(("lora_A", "lora_B"), adapter_params(layer)):
                write_full(param, tensors[f"{name}.{part}.weight"].to(param.device))



def base_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The base (non-adapter) parameters under the plain model's names, in module order."""
    return [(plain_name(name), p) for name, p in model.named_parameters() if ".lora_" not in name]


@torch.no_grad()
def base_hash(model: nn.Module) -> str:
    """sha256 over the base (non-adapter) parameters, in name order (the plain model's names), each as its name,
    dtype, shape and the bytes of its full tensor. Equal bases give equal hashes. A collective under FSDP."""
    digest = hashlib.sha256()
    with full_view(model, writeback=False):
        for name, param in sorted(base_parameters(model), key=lambda item: item[0]):
            full = full_tensor(param).detach().to("cpu").contiguous()
            digest.update(f"{name}|{full.dtype}|{list(full.shape)}|".encode())
            digest.update(full.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()



def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the weights a full push sends: every parameter but the adapters (a LoRA policy sends its merged
    view, of the base's shapes), tied ones once, FSDP2 shards at their full size. A collective under FSDP1."""
    with full_view(model, writeback=False):
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".lora_" not in name)

