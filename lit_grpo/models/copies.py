"""Frozen copies of a policy (the reference pi_ref, the in-process rollout engine's alpha) made without a full
intermediate copy on the host.

``copy.deepcopy`` of a model on the CPU doubles its host memory before anything moves to the accelerator; a 0.5B
model in float32 is 2 GB a copy. These helpers copy each parameter straight to where it will live, or leave a
parameter-less skeleton to be filled later (by the first weight sync), so the host holds one model at most.
"""

from __future__ import annotations

import copy

import torch
from torch import nn


def frozen_copy(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """A ``requires_grad=False`` copy of a plain (unsharded) model, each parameter copied straight to ``device``
    (default: where it is). Tied parameters stay tied; buffers are copied too (they are small)."""
    target = None if device is None else torch.device(device)
    memo: dict[int, nn.Parameter] = {}
    for param in model.parameters():
        if id(param) not in memo:
            data = param.detach().to(target or param.device, copy=True)
            memo[id(param)] = nn.Parameter(data, requires_grad=False)
    clone = copy.deepcopy(model, memo)
    if target is not None:
        clone.to(target)  # buffers (rotary frequencies...) follow the parameters
    return clone.requires_grad_(False)


def skeleton_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters live on the meta device (no memory), buffers copied; fill it with
    :func:`materialize` and then real weights."""
    memo: dict[int, nn.Parameter] = {}
    for param in model.parameters():
        if id(param) not in memo:
            memo[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)
    return copy.deepcopy(model, memo).requires_grad_(False)


def materialize(skeleton: nn.Module, device: torch.device | str) -> nn.Module:
    """Give every meta parameter of ``skeleton`` uninitialised storage on ``device`` (tied ones share it) and move
    the buffers there. The values are garbage until weights are loaded."""
    target = torch.device(device)
    made: dict[int, nn.Parameter] = {}
    for module in skeleton.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=target),
                                                   requires_grad=False)
                module._parameters[name] = made[id(param)]
    return skeleton.to(target)
