"""Model FLOPs of the GRPO update and model FLOP utilisation (MFU): pure functions, no Lightning.

The count is the usual dense-transformer approximation (Kaplan et al. 2020; PaLM's MFU): a token costs
``2 N`` FLOPs in a forward pass and ``4 N`` more in the backward, ``N`` being the parameter count. It leaves out
attention's score and value products (``4 * layers * d_model * context`` per token, a few per cent at the
sequence lengths GRPO trains on) and the lm-head positions a pass skips, so it slightly undercounts.

Which tokens count, and why: the tokens a forward reads that carry data. Per micro-batch that is each distinct
prompt's real tokens once (the prompt is run once and its KV cache shared by the completions of its group; a
group split over two micro-batches runs, and counts, its prompt twice) plus the real completion tokens fed to
the model (every completion token but the last column's). Padding is not counted: a padded position is work the
device does but the model does not need, so it lowers MFU, as it should. Counting the prompt once per completion
(G times, as a trainer without prefix sharing computes it) would credit FLOPs that were never run. Activation
checkpointing runs each row's prompt again and recomputes the forward in the backward; by MFU's convention that
repeated work is not counted either, so checkpointing shows as a lower MFU.

Packed (``model.packing``), a micro-batch is fed as one row of real tokens, and the count is that row's length
(:func:`fed_tokens`): with prompt copies, each completion with its own prompt; as a prefix tree, the tree's nodes,
so every prefix that rows share (a group's prompt, a turn that multi-turn trajectories sampled alike, identical
completions) counts once, as it is run once. The token budget's bound of a tree
(:func:`lit_grpo.core.prefix_tree.tree_token_count`) does not subtract shared completion prefixes: counting it
would credit work that was never done.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from lit_grpo.core.batch import MicroBatch
from lit_grpo.core.packing import packed_token_count
from lit_grpo.core.prefix_tree import tree_layout

#: bf16 dense (no sparsity) peak FLOP/s of one device, by a pattern of ``torch.cuda.get_device_name()``; the first
#: match wins. Variants with another peak (H100 NVL, H200 NVL, L40 without S) match none, so they get no MFU
#: rather than a wrong one.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\b(SXM\d*|HBM3)\b", 989e12),
    (r"\bH200\b(?!.*\bNVL\b)", 989e12),
    (r"\bA100\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bL4\b", 121e12),
)


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, unsharded: a DTensor parameter (FSDP2's ``fully_shard``) has the global shape, so
    every rank counts the whole model, not its shard. Tied weights count once (``parameters()`` yields them once).
    FSDP1's flattened shards do not carry the full shape: count such a model before wrapping it."""
    return sum(math.prod(p.shape) for p in model.parameters())


def processed_tokens(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Tokens one scoring pass over a micro-batch reads (see the module docstring): the real tokens of its
    distinct prompts, ``[u, P]``, plus the real completion tokens fed as input, all columns of ``[s, C]`` but the
    last. A 0-d tensor on the masks' device, so a trainer can add it up without a host sync."""
    fed = completion_mask[:, :-1]
    return prompt_mask.sum() + fed.sum()


def fed_tokens(micro_batches: Sequence[MicroBatch], layout: str = "padded") -> torch.Tensor:
    """Tokens one scoring pass over ``micro_batches`` feeds the model in ``layout`` (``"padded"``, ``"packed"`` or
    ``"packed_tree"``, as ``GRPOModule.micro_batch_layout`` names it), summed as a float64 0-d tensor on the masks'
    device: padded, :func:`processed_tokens` of each micro-batch; with prompt copies, each row's real prompt and
    completion tokens but its last; as a prefix tree, the tree's nodes. The tree is built here once more from the
    token ids (one host transfer per micro-batch, as the pass itself makes): its node count depends on which
    tokens coincide, which no mask arithmetic gives."""
    if layout not in ("padded", "packed", "packed_tree"):
        raise ValueError(f"layout must be 'padded', 'packed' or 'packed_tree', got {layout!r}")
    if not micro_batches:
        raise ValueError("fed_tokens needs at least one micro-batch, got none")
    device = micro_batches[0].completion_mask.device
    if layout == "packed_tree":
        nodes = sum(tree_layout(mb).input_ids.numel() for mb in micro_batches)
        return torch.tensor(float(nodes), dtype=torch.float64, device=device)
    if layout == "packed":
        counts = [packed_token_count(mb, "packed") for mb in micro_batches]
    else:
        counts = [processed_tokens(mb.prompt_mask, mb.completion_mask) for mb in micro_batches]
    return torch.stack(counts).sum().to(torch.float64)


def update_flops(parameters: int, tokens: float, iterations: int, reference_pass: bool, extra_no_grad_passes: int
                 ) -> float:
    """Model FLOPs of one GRPO update over ``tokens`` (per pass, see :func:`processed_tokens`):
    ``6 N tokens`` per policy forward + backward (one per iteration, the paper's i), and ``2 N tokens`` per
    no-grad pass: the reference model's (when beta > 0) and each other one (the TV-after-update pass)."""
    if parameters < 0 or tokens < 0 or iterations < 0 or extra_no_grad_passes < 0:
        raise ValueError(f"counts must be >= 0, got parameters={parameters}, tokens={tokens}, "
                         f"iterations={iterations}, extra_no_grad_passes={extra_no_grad_passes}")
    per_token = 6 * iterations + 2 * (int(reference_pass) + extra_no_grad_passes)
    return float(per_token) * parameters * tokens


def peak_flops_for(device_name: str) -> float | None:
    """The bf16 dense peak FLOP/s of a device named ``device_name`` (``torch.cuda.get_device_name()``), or
    ``None`` when the table does not know it."""
    for pattern, peak in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None


def device_peak_flops(device: torch.device, peak_flops: float | None = None) -> float | None:
    """One device's peak FLOP/s, the denominator of MFU: ``peak_flops`` when set, else the bf16 dense peak of this
    CUDA device when the table knows it, else None (CPU, unknown device): no MFU rather than a wrong one."""
    if peak_flops is not None:
        return float(peak_flops)
    if device.type != "cuda":
        return None
    return peak_flops_for(torch.cuda.get_device_name(device))


def model_flops_utilisation(flops: float, seconds: float, devices: int, peak_flops: float) -> float:
    """MFU: achieved FLOP/s per device over the device's peak, ``flops / seconds / devices / peak_flops``, with
    ``flops`` summed over the ``devices`` that worked for ``seconds`` (the slowest one's time)."""
    if not (seconds > 0 and devices > 0 and peak_flops > 0):
        raise ValueError(f"seconds, devices and peak_flops must be > 0, got {seconds}, {devices}, {peak_flops}")
    return flops / seconds / devices / peak_flops
