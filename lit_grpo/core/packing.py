"""Completion log-probs from one packed row without padding: the padding-free twin of
:func:`lit_grpo.core.scoring.completion_logprobs`.

A micro-batch's rows (``prompt + completion[:-1]``, each without its left and right padding) are concatenated into
ONE row of ``T = sum of real lengths`` tokens, with ``position_ids`` restarting at 0 for each sequence, no attention
mask and no KV cache. The forward's cost then follows the tokens, not ``rows x longest row``.

Which attention implementations keep the sequences apart (read in transformers 5.24's ``masking_utils.py`` and
``modeling_flash_attention_utils.py``):

* ``sdpa``, ``eager`` and ``flex_attention``: ``create_causal_mask`` (and ``create_sliding_window_causal_mask``)
  call ``find_packed_sequence_indices(position_ids)`` when the 2D attention mask is ``None`` and there is no cache;
  a position that does not follow its predecessor by exactly 1 starts a new sequence, and the causal mask is
  intersected with "same sequence" (block-causal). sdpa and eager get it as a dense ``[1, 1, T, T]`` mask;
  flex_attention as a ``BlockMask``, whose fully masked blocks are skipped. This needs the model to hand its
  ``position_ids`` to the mask builder; OPT, BioGPT, XGLM and GPT-OSS do not (their mask is then plain causal over
  the whole row), and :func:`packing_supported` refuses them under these three implementations.
* ``flash_attention_2/3/4``: the mask builder returns ``None``. transformers would infer ``cu_seqlens`` from the
  ``position_ids`` an attention call sees, but a model that does not hand them to its layers (XGLM in 5.24) then
  attends across sequences. Here the row's layers are handed its segments instead, each sequence its own, in
  ``**kwargs`` (:func:`lit_grpo.core.tree_flash.chain_segments`): no mask, cost ``sum L_i^2`` in attention, and a
  layer not handed them raises. :func:`packing_supported` refuses a model whose attention does not go through
  transformers' ``AttentionInterface`` or whose layer calls it without ``**kwargs``. Run here through a CPU
  stand-in for the kernel (``tests/test_tree_flash.py``); the kernel itself needs a GPU.
* Any other implementation (a kernel from the hub, ``paged|...``, one registered by a user) is not in
  ``ALL_MASK_ATTENTION_FUNCTIONS``: transformers builds no mask for it and nothing keeps the sequences apart.
  :func:`packing_supported` refuses it.

Memory and compute: with sdpa or eager, the block-causal mask is dense: ``T x T`` booleans (eager: ``T x T`` floats
and ``heads x T x T`` attention weights), and attention's work grows as ``T^2`` rather than ``sum L_i^2``, so a
packed row of 8k tokens computes (and on a CPU materialises) 64M scores per head where the sequences need far
fewer. For long micro-batches on sdpa keep the token budget moderate; flash attention and flex attention pay only
for the blocks that attend.

That is the layout for chunked-attention layers: each completion carries its own copy of its prompt. Elsewhere a
micro-batch packs as a prefix tree instead, each group's prompt once (:mod:`lit_grpo.core.prefix_tree`; under flash
attention :mod:`lit_grpo.core.tree_flash`); :func:`packed_layout_kind` says which a model gets.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import torch
from torch import nn

from lit_grpo.core.batch import MicroBatch, real_lengths
from lit_grpo.core.chunked_head import (
    DEFAULT_HEAD_CHUNK_MB,
    final_hidden,
    head_chunk_tokens,
    head_gathered,
    head_logprobs,
    hidden_only,
)
from lit_grpo.core.chunked_head import unwrapped_model as _unwrapped
from lit_grpo.core.mask_positions import mask_built_without_positions
from lit_grpo.core.prefix_tree import tree_forward, tree_layout, tree_supported, tree_token_count
from lit_grpo.core.tree_flash import chain_segments, segments_forward, tree_flash_unsupported, uses_flash
from lit_grpo.math.logprobs import logprobs_and_entropy

#: attention implementations whose transformers code path separates packed sequences by their position ids
PACKING_ATTENTION = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
#: the mask builders of ``transformers.masking_utils`` that detect packed position ids; a model's module must use one
_PACKED_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
#: layer kinds whose only state across tokens is attention (a recurrent or convolutional layer would carry one
#: sequence's state into the next)
_ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention"}
#: attention implementations whose packed sequences are kept apart by the mask the model builds from the position ids
#: it hands the mask builder; flash attention reads the position ids in the attention call instead
_MASK_SEPARATED = ("sdpa", "eager", "flex_attention")


def packing_supported(model: nn.Module) -> str | None:
    """``None`` when ``model`` can score a packed row in either layout (see the module's docstring), else one line
    saying why not: an attention implementation that ignores packed position ids, a model without ``position_ids``
    (ALiBi models such as Bloom and MPT build their bias from the attention mask), a model whose mask is not built by
    ``transformers.masking_utils``, or, under sdpa, eager or flex attention, is built there without the position ids
    (OPT, BioGPT, XGLM and GPT-OSS in transformers 5.24: the mask is then plain causal and the copies layout's
    sequences attend to one another; the prefix tree of the first three, whose mask is given whole, would be right,
    but this check gates both layouts), a recurrent or linear-attention layer, an encoder-decoder, or a
    transformers without packed-sequence detection. Learned absolute positions are fine where they are indexed by
    the position ids given (GPT-2, and OPT's the mask aside). tests/test_packing_families.py checks every layout
    each family runs against each row run alone, unpadded, for 21 families of transformers 5.24 (17 that pack, and
    those 4)."""
    base = _unwrapped(model)
    config = getattr(base, "config", None)
    if config is None:
        return f"packing needs a transformers model with a config; got {type(base).__name__}"
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return "packing needs transformers.masking_utils"
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return "packing needs a transformers that detects packed sequences (masking_utils.find_packed_sequence_indices)"
    attn = getattr(config, "_attn_implementation", None)
    if attn not in PACKING_ATTENTION and not uses_flash(attn):
        return (f"packing needs one of the attention implementations {', '.join(PACKING_ATTENTION)}; the model uses "
                f"{attn!r}, which ignores packed position ids")
    if getattr(config, "is_encoder_decoder", False):
        return f"packing needs a decoder-only model; {type(base).__name__} is an encoder-decoder"
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        return f"packing needs position ids; {type(base).__name__} uses ALiBi, built from the attention mask"
    if "position_ids" not in inspect.signature(base.forward).parameters:
        return f"packing needs position ids; {type(base).__name__}.forward takes no position_ids"
    module = sys.modules.get(type(base).__module__)
    if not any(getattr(module, name, None) is getattr(masking_utils, name, False) for name in _PACKED_MASK_BUILDERS):
        return (f"packing needs a model whose causal mask comes from transformers.masking_utils; "
                f"{type(base).__name__} ({type(base).__module__}) builds its own")
    if attn in _MASK_SEPARATED and (where := mask_built_without_positions(base, _PACKED_MASK_BUILDERS)) is not None:
        return (f"packing needs the position ids handed to the causal mask, which separates packed sequences under "
                f"{attn}; {type(base).__name__}'s {where} builds its mask without them")
    layer_types = set(getattr(config, "layer_types", None) or ()) - _ATTENTION_LAYERS
    if layer_types:
        return f"packing needs attention-only layers; {type(base).__name__} has {', '.join(sorted(layer_types))}"
    if uses_flash(attn):  # the kernel keeps the sequences apart by the segments the row's layers are handed
        return tree_flash_unsupported(config, base)
    return None


def packed_layout(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed row of a micro-batch: ``input_ids [1, T]``, ``position_ids [1, T]``, the indices ``[N]`` of the
    positions whose logits predict a completion token, and those tokens ``[N]``, row by row (``N`` = real
    completion tokens; the order is that of ``completion_mask`` read row-major)."""
    prompt_len = real_lengths(mb.prompt_mask, left=True)[mb.prompt_index]
    completion_len = real_lengths(mb.completion_mask, left=False)
    prompt_list, completion_list = prompt_len.tolist(), completion_len.tolist()  # one sync for the whole layout
    if any(p == 0 for p, c in zip(prompt_list, completion_list) if c > 0):
        raise ValueError("packing needs at least one prompt token per row: its last token predicts the first "
                         "completion token")
    width = mb.prompt_ids.shape[1]
    ids, positions, keep, targets = [], [], [], []
    start = 0
    for row, (p, c) in enumerate(zip(prompt_list, completion_list)):
        if c == 0:
            continue
        prompt = mb.prompt_ids[mb.prompt_index[row], width - p:]
        completion = mb.completion_ids[row, :c]
        ids += [prompt, completion[:-1]]
        positions.append(torch.arange(p + c - 1, device=mb.prompt_ids.device))
        # the last prompt token predicts completion[0], completion[j] predicts completion[j + 1]
        keep.append(torch.arange(start + p - 1, start + p + c - 1, device=mb.prompt_ids.device))
        targets.append(completion)
        start += p + c - 1
    if not ids:
        empty = mb.completion_ids.new_zeros(0)
        return empty[None], empty[None], empty, empty
    return torch.cat(ids)[None], torch.cat(positions)[None], torch.cat(keep), torch.cat(targets)


def packed_layout_kind(model: nn.Module) -> str:
    """How ``model``'s packed passes lay out a micro-batch: ``"packed_tree"`` (each shared prefix once, a custom
    mask; :mod:`lit_grpo.core.prefix_tree`) where its attention takes one, else ``"packed"`` (each completion after
    its own prompt copy; position ids keep the sequences apart). The names are
    :data:`lit_grpo.core.micro_batch_plan.LAYOUTS`, so the token budget costs the layout that runs."""
    base = _unwrapped(model)
    return "packed_tree" if tree_supported(base.config, base) is None else "packed"


def packed_completion_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False, entropy_grad: bool = False,
    layout: str | None = None, head_chunk_mb: float | None = DEFAULT_HEAD_CHUNK_MB, dense_mask: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`lit_grpo.core.scoring.completion_logprobs` from one packed forward without padding, in ``layout``
    (``"packed_tree"`` or ``"packed"``; None: the one :func:`packed_layout_kind` picks): ``log softmax(logits /
    T)`` of each completion token, ``[s, C']``, and optionally the entropy (with its gradient when
    ``entropy_grad``), through the same functions of :mod:`lit_grpo.math.logprobs`. Past ``head_chunk_mb`` MiB of
    float32 logits the head runs in chunks of tokens from the final hidden states (:mod:`lit_grpo.core.chunked_head`).
    ``dense_mask``: the tree under sdpa attends through the dense ``T x T`` mask, the reference of its blocks
    (:mod:`lit_grpo.core.tree_attention`).

    Padded positions (``completion_mask == 0``) hold 0 in both outputs, where the padded path holds whatever the
    model predicts after a pad token; every caller masks them (``MicroBatch.loss_mask`` is within
    ``completion_mask``). The forward never takes a KV cache, so it is the same under activation checkpointing.
    Check :func:`packing_supported` first: with an attention implementation that ignores packed position ids
    the sequences would attend to one another and the numbers would be silently wrong.
    """
    logp = torch.zeros(mb.completion_ids.shape, dtype=torch.float32, device=mb.completion_ids.device)
    entropy = torch.zeros_like(logp) if with_entropy else None
    layout = layout or packed_layout_kind(model)
    if layout not in ("packed", "packed_tree"):
        raise ValueError(f"a packed layout is 'packed' or 'packed_tree', got {layout!r}")
    if layout == "packed_tree":
        if (why := tree_supported(_unwrapped(model).config, _unwrapped(model))) is not None:
            raise ValueError(f"packed_tree layout: {why}")
        tree = tree_layout(mb)
        targets, keep = tree.targets, tree.keep
    else:
        input_ids, position_ids, keep, targets = packed_layout(mb)
    if targets.numel() == 0:
        return logp, entropy
    chunk = head_chunk_tokens(model, head_chunk_mb)
    chunked = chunk is not None and targets.numel() > chunk
    # the lm head runs on the N predicting positions only: inside the forward, or on the hidden states in chunks
    head = hidden_only(targets.device) if chunked else {"logits_to_keep": keep}
    # gathered on both branches alike under FSDP2 (see lit_grpo.core.scoring.completion_logprobs)
    with head_gathered(model) if chunk is not None else contextlib.nullcontext():
        if layout == "packed_tree":
            out = tree_forward(model, _unwrapped(model).config._attn_implementation, tree, dense_mask, **head)
        elif uses_flash(_unwrapped(model).config._attn_implementation):  # each sequence a segment of its own
            out = segments_forward(model, _unwrapped(model), input_ids, position_ids, chain_segments(position_ids[0]),
                                   **head)
        else:
            out = model(
                input_ids=input_ids,
                attention_mask=None,  # packed sequences are detected only without a 2D mask
                position_ids=position_ids,
                use_cache=False,  # and only without a cache
                **head,
            )
        if chunked:
            values, ent = head_logprobs(model, final_hidden(out)[:, keep], targets[None], temperature, chunk,
                                        with_entropy, entropy_grad)
        else:
            values, ent = logprobs_and_entropy(out.logits, targets[None], temperature, with_entropy, entropy_grad)
    real = mb.completion_mask.bool()
    logp = logp.to(values.dtype).masked_scatter(real, values[0])
    if with_entropy:
        entropy = entropy.to(ent.dtype).masked_scatter(real, ent[0])
    return logp, entropy


def packed_token_count(mb: MicroBatch, layout: str = "packed") -> torch.Tensor:
    """Tokens the packed row of ``mb`` feeds the model, a 0-d tensor on the masks' device (no host sync): in the
    copies layout (``"packed"``, :func:`packed_layout`) each row's real prompt tokens and its real completion tokens
    but the last; as a prefix tree (``"packed_tree"``) :func:`lit_grpo.core.prefix_tree.tree_token_count`."""
    if layout == "packed_tree":
        return tree_token_count(mb)
    prompt_tokens = mb.prompt_mask.sum(1)[mb.prompt_index]
    completion_tokens = mb.completion_mask.sum(1)
    return torch.where(completion_tokens > 0, prompt_tokens + completion_tokens - 1, 0).sum()
