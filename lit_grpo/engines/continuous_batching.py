"""The pieces of dynamic decoding that frees finished slots (``TransformersEngine``'s dynamic path): the sampling
draw that does not depend on the batch a row decodes in, the rule that says when to rebuild the running batch, and
the rebuild of the KV cache and attention mask (finished rows dropped, waiting sequences merged in).

Why a rebuild is not done at every finish: it copies the running KV cache once (the kept rows, left-padded to one
width), about the memory traffic of a few decode steps' attention. Rows that finished but still sit in the batch
cost a row-step each per step. Waiting until a fraction of the running rows has finished bounds the waste by that
fraction while keeping the copies few (one per ``1 / fraction`` finishes at most, fewer as the batch shrinks);
``benchmarks/continuous_batching.py`` measured the fractions 0 (every finish), 1/8, 1/4 and 1/2 on the uneven
workload, see :data:`REBUILD_FRACTION`.
"""

from __future__ import annotations

import math

import torch
from transformers.cache_utils import Cache, DynamicLayer

from lit_grpo.engines.kv_cache import PreallocatedLayer
from lit_grpo.math.logprobs import selective_log_softmax

#: rebuild the running batch once at least this fraction of its rows has finished (and at least one row): on the
#: uneven benchmark (lengths 16..512, 64 rows, the tiny model on one shared CPU thread) 1/8 was the fastest of 0, 1/8,
#: 1/4 and 1/2 (1.48x the old loop, 0: 1.40x); the larger fractions lose the rows they keep stepping. Not yet
#: measured on a model of a real shape or a GPU, where a copy of the cache weighs differently
REBUILD_FRACTION = 0.125
#: the cache layers a rebuild knows how to copy (plain growing ones, and the engine's preallocated ones)
REBUILDABLE_LAYERS = (DynamicLayer, PreallocatedLayer)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set to -inf the logits outside the smallest set whose probability reaches ``top_p`` (nucleus)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_step(logits: torch.Tensor, temperature: float, top_p: float, uniforms: torch.Tensor,
                finished: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step of the running rows: each row's token, drawn from ``softmax(top_p(logits / T))`` at its
    uniform (:func:`sample_with_uniforms`), ``pad`` for a row that ``finished`` already, and the token's log-prob
    under ``log_softmax(logits / T)`` (the sampler's mu: before the nucleus cut, as vLLM's ``processed_logprobs``).
    The in-process engine and the rollout server's decode loop both step with it."""
    scaled = logits.float() / temperature
    probs = torch.softmax(top_p_filter(scaled, top_p), dim=-1)
    sampled = torch.where(finished, pad, sample_with_uniforms(probs, uniforms))
    return sampled, selective_log_softmax(scaled, sampled)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` ([rows, vocab], each row a distribution, zeros allowed) by inverting its
    cumulative distribution at ``uniforms`` ([rows] in [0, 1)): the token ``i`` with ``cdf[i-1] <= u * cdf[-1] <
    cdf[i]``. A row's token depends on its own probabilities and uniform only, not on the other rows of the batch,
    so a sequence samples the same tokens whatever batch it decodes in. Computed in float64 (as torch's CPU
    ``multinomial`` accumulates); a token of probability 0 is never drawn."""
    if probs.dim() != 2 or uniforms.shape != probs.shape[:1]:
        raise ValueError(f"expected probs [rows, vocab] and uniforms [rows], got {tuple(probs.shape)} and "
                         f"{tuple(uniforms.shape)}")
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so that the first entry above it exists and has a probability > 0
    target = torch.minimum(uniforms.double().unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)


def rebuild_due(finished: int, running: int, waiting: int, fraction: float | None = None) -> bool:
    """Whether to rebuild the running batch now (drop its ``finished`` rows of ``running``, admit up to as many of
    the ``waiting`` sequences): once at least ``fraction`` of the running rows (and at least one) has finished, at
    once when every running row has finished and sequences wait, and never when one finished row is all that is
    left (a rank whose rows all finished keeps one row to run the forwards its peers run). ``fraction``: default
    :data:`REBUILD_FRACTION`."""
    fraction = REBUILD_FRACTION if fraction is None else fraction
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], got {fraction}")
    if finished <= 0:
        return False
    if finished >= running:
        return waiting > 0 or running > 1
    return finished >= max(1, math.ceil(fraction * running))


def first_used_column(attention: torch.Tensor) -> int:
    """The first column of ``attention`` ([rows, width], 1 where a position is attended) that some row attends;
    the columns before it are padding in every row, so a rebuild drops them. ``width`` when no row attends any."""
    used = attention.bool().any(dim=0)
    return int(used.int().argmax()) if bool(used.any()) else attention.shape[1]


def left_pad_rows(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The tensors of ``parts`` (rows on dimension 0) stacked along dimension 0, each left-padded with zeros along
    ``dim`` to the widest: the rows of a running cache and those of newly prefilled prompts in one batch, each
    right-aligned, the padding masked out by the attention mask's zeros."""
    width = max(p.shape[dim] for p in parts)
    shape = list(parts[0].shape)
    shape[0], shape[dim] = sum(p.shape[0] for p in parts), width
    out = parts[0].new_zeros(shape)
    at = 0
    for part in parts:
        out.narrow(0, at, part.shape[0]).narrow(dim, width - part.shape[dim], part.shape[dim]).copy_(part)
        at += part.shape[0]
    return out


def rebuildable(cache: Cache) -> bool:
    """Whether :func:`rebuild_cache` can copy every layer of ``cache`` (a layered cache of plain dynamic or
    preallocated layers); a model with sliding-window or other layers decodes without dropping rows."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in REBUILDABLE_LAYERS and layer.is_initialized for layer in layers)


def rebuild_cache(cache: Cache, keep: torch.Tensor, start: int, new: Cache | None, room: int) -> None:
    """Rebuild ``cache`` in place: the rows ``keep`` (indices) from column ``start`` on, then the rows of ``new``
    (the prefilled prompts of admitted sequences, already one row per sequence), each left-padded to the widest
    with zero keys and values. A preallocated layer stays one, with ``room`` free positions after the filled ones."""
    new_layers = new.layers if new is not None else [None] * len(cache.layers)
    for i, (layer, incoming) in enumerate(zip(cache.layers, new_layers)):
        keys, values = [], []
        if keep.numel():
            keys.append(layer.keys[keep, :, start:, :])
            values.append(layer.values[keep, :, start:, :])
        if incoming is not None:
            keys.append(incoming.keys.to(layer.keys.dtype))
            values.append(incoming.values.to(layer.values.dtype))
        merged_keys, merged_values = left_pad_rows(keys, dim=2), left_pad_rows(values, dim=2)
        if isinstance(layer, PreallocatedLayer):
            cache.layers[i] = PreallocatedLayer(merged_keys, merged_values, merged_keys.shape[-2] + room)
        else:
            fresh = DynamicLayer()
            fresh.update(merged_keys, merged_values)
            cache.layers[i] = fresh
