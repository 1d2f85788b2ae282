"""A micro-batch packed as a prefix tree: each group's prompt once, and every prefix two rows share once.

The copies layout of :mod:`lit_grpo.core.packing` feeds each completion after its own copy of its prompt, so a
group of G completions pays its prompt G times. Here the rows' sequences ``prompt + completion[:-1]`` are merged
into a tree (a trie over tokens): a node is a token at a depth, shared by every row whose sequence starts with the
same tokens up to it. A group's prompt is then one path, each completion a branch off its last token, and
multi-turn trajectories that sampled the same first turn share that turn too (two groups with the same prompt
share it as well).

The tree is laid out in depth-first pre-order, so each node's descendants follow it contiguously:
``subtree_end[k]`` is one past the last of them. A token at depth ``d`` gets position id ``d``, and attends to the
keys on its own path from the root (:func:`lit_grpo.core.tree_attention.may_attend`)::

    query q may attend key k  <=>  k <= q < subtree_end[k]      (k is q or an ancestor of q)

which, for one row, is exactly the causal attention of ``prompt + completion`` at positions ``0 ..``: the padded
path's numbers, within kernel rounding. Which attention implementations take such a mask (transformers 5.24's
``masking_utils._preprocess_mask_arguments`` passes a 4D mask or a ``BlockMask`` through unchanged):

* ``sdpa``: blocks of queries, each against the keys of its own root path only
  (:mod:`lit_grpo.core.tree_attention`); the dense ``[1, 1, T, T]`` boolean mask (True = attend) stays as the
  reference the tests compare the blocks with;
* ``eager``: the same as an additive mask (0 where attended, the dtype's minimum elsewhere), which its
  ``attn_weights + attention_mask`` expects;
* ``flex_attention``: a ``BlockMask`` from the same rule as a ``mask_mod``, built from ``subtree_end``; attention
  then skips the fully masked blocks. Building it is not ``O(T)``: ``create_block_mask`` without compilation (as
  here) evaluates the rule on every (query, key) pair, materialising the dense ``T x T`` boolean mask once (torch
  2.13's ``create_mask``) before it keeps only the blocks' indices, so its peak memory is sdpa's mask's (not compiled
  here: ``torch.compile(create_block_mask)``, torch's way to fuse that step away, is untested on a GPU). torch 2.13
  runs flex attention's forward on a CPU but not its backward: a gradient pass with flex needs an accelerator.
* flash attention takes no mask, only ``cu_seqlens`` of disjoint sequences: each segment of the tree runs against
  the gathered keys of its own root path through the variable-length kernel (:mod:`lit_grpo.core.tree_flash`).
  A model with chunked layers, whose chunks a custom mask would replace, keeps the copies layout, as does flex
  attention on a sliding-window model (:func:`tree_supported`). Sliding-window layers under sdpa and eager take the
  rule cut to their window on the nodes' depths (``depth[q] - depth[k] < window``): one mask for a model whose layers
  all slide (Mistral), one per layer kind, as a mapping, for one that mixes them (Qwen2, Gemma 2); flash attention
  applies each layer's own window to the gathered keys, which sit at consecutive depths.

Cost: ``T`` = the tree's nodes, at most ``sum over distinct prompts of their length + sum over rows of (completion
- 1)`` (what :func:`lit_grpo.core.micro_batch_plan.tree_tokens` budgets), against the copies layout's ``sum over
rows of (prompt + completion - 1)``. With sdpa attention's work follows each query's depth (the blocks); with eager
the mask is dense (``T x T``) and its work grows as ``T^2``, as in the copies layout; flex's attention pays only
for the blocks that attend (its mask is built dense, above).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lit_grpo.core.batch import MicroBatch, real_lengths
from lit_grpo.core.tree_attention import tree_attention_mask, tree_block_mask
from lit_grpo.core.tree_flash import segments_forward, tree_flash_unsupported, tree_segments, uses_flash

#: attention implementations that accept a custom 4D mask (sdpa, eager) or a ``BlockMask`` (flex)
TREE_ATTENTION = ("sdpa", "eager", "flex_attention")
#: layer kinds the tree's masks serve: the whole causal past, or its sliding window (a chunked layer's chunks would
#: be replaced by the tree's mask)
_TREE_LAYERS = {"full_attention", "sliding_attention"}


@dataclass(frozen=True)
class TreeLayout:
    """One micro-batch as a prefix tree laid out in pre-order (see the module docstring)."""

    input_ids: torch.Tensor  # [1, T] the nodes' tokens
    position_ids: torch.Tensor  # [1, T] each node's depth
    subtree_end: torch.Tensor  # [T] one past the last descendant of each node
    keep: torch.Tensor  # [N] the nodes whose logits predict a completion token, row by row
    targets: torch.Tensor  # [N] the tokens they predict


def tree_supported(config: object, model: nn.Module | None = None) -> str | None:
    """``None`` when a model of this transformers ``config``, once it packs at all
    (:func:`lit_grpo.core.packing.packing_supported`), can pack as a prefix tree, else one line saying why not (it
    then packs with the copies layout, each completion after its own prompt). Sliding-window layers take the
    tree's rule cut to their window: a model whose layers all slide (Mistral, Phi-3) takes one such mask; one that
    mixes full and sliding layers (Qwen2, Gemma 2) a mask per layer kind, which its ``model``'s forward must take
    as a mapping (checked in its source; without ``model`` it is refused). Flex attention's ``BlockMask`` has no
    window here: it takes full-attention models only."""
    attn = getattr(config, "_attn_implementation", None)
    if uses_flash(attn):  # no mask: segments through the varlen kernel
        return tree_flash_unsupported(config, model)
    if attn not in TREE_ATTENTION:
        return f"a prefix tree needs a custom attention mask or flash attention, which {attn!r} is neither"
    windows = tree_windows(config, model)
    if isinstance(windows, str):
        return windows
    if windows is None or windows == {"full_attention": None}:
        return None
    if attn == "flex_attention":
        return "a prefix tree's BlockMask is built without a sliding window here; flex attention takes full layers"
    if isinstance(windows, dict) and not takes_mask_mapping(model):
        name = type(model).__name__ if model is not None else "the model"
        return (f"a prefix tree needs one mask per layer kind ({', '.join(sorted(windows))}), which {name}'s forward "
                "does not take as a mapping")
    return None


def tree_windows(config: object, model: nn.Module | None = None) -> dict[str, int | None] | int | None | str:
    """The windows the tree's masks need: ``None`` (full attention everywhere), an int (every layer slides by it:
    one mask), a mapping from layer kind to its window (None: full), or one line saying why none fits. A config
    with a ``sliding_window`` and no ``layer_types`` slides only if its ``model`` builds a sliding-window mask
    (Mistral does, Llama ignores the setting), read in the model's source."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        if kinds - _TREE_LAYERS:
            return (f"a prefix tree's mask would replace the window of the model's "
                    f"{', '.join(sorted(kinds - _TREE_LAYERS))} layers")
        if "sliding_attention" not in kinds:
            return None
        if not isinstance(window, int) or window < 1:
            return f"the model has sliding_attention layers but its sliding_window is {window!r}"
        return {kind: (window if kind == "sliding_attention" else None) for kind in kinds}
    if window and getattr(config, "use_sliding_window", True):
        if model is None:
            return "a prefix tree's mask would replace the model's sliding window"
        return int(window) if _source_mentions(model, "create_sliding_window_causal_mask") else None
    return None


def _source_mentions(model: nn.Module, text: str) -> bool:
    """Whether the forward of ``model``'s first modules (the causal LM and its decoder) mentions ``text``."""
    import inspect

    for module in list(model.modules())[:4]:
        try:
            if text in inspect.getsource(type(module).forward):
                return True
        except (OSError, TypeError):
            continue
    return False


def takes_mask_mapping(model: nn.Module | None) -> bool:
    """Whether ``model``'s decoder takes ``attention_mask`` as a mapping from layer kind to mask (transformers
    5.24: ``if not isinstance(causal_mask_mapping := attention_mask, dict)``), read in its modules' source."""
    return model is not None and _source_mentions(model, "attention_mask, dict)")


def tree_layout(mb: MicroBatch) -> TreeLayout:
    """The prefix tree of ``mb``'s rows with a completion: ``prompt + completion[:-1]`` each, merged where they
    agree from the first token. Rows sorted by their token sequences are inserted in that order, which makes
    insertion order pre-order: each new row shares its longest common prefix with the row sorted just before it
    and appends the rest. One host transfer of the token ids; the rest is Python over the tokens."""
    device = mb.completion_ids.device
    prompt_len = real_lengths(mb.prompt_mask, left=True).tolist()
    completion_len = real_lengths(mb.completion_mask, left=False).tolist()
    prompt_rows = mb.prompt_index.tolist()
    prompts, completions = mb.prompt_ids.tolist(), mb.completion_ids.tolist()
    width = mb.prompt_ids.shape[1]
    sequences: dict[int, list[int]] = {}
    for row, c in enumerate(completion_len):
        if c == 0:
            continue
        p = prompt_len[prompt_rows[row]]
        if p == 0:
            raise ValueError("packing needs at least one prompt token per row: its last token predicts the first "
                             "completion token")
        sequences[row] = prompts[prompt_rows[row]][width - p:] + completions[row][: c - 1]
    if not sequences:
        empty = mb.completion_ids.new_zeros(0)
        return TreeLayout(empty[None], empty[None], empty, empty, empty)
    tokens: list[int] = []
    depth: list[int] = []
    end: list[int] = []
    paths: dict[int, list[int]] = {}
    previous: list[int] = []
    previous_path: list[int] = []
    for row in sorted(sequences, key=lambda r: (sequences[r], r)):
        sequence = sequences[row]
        shared = 0
        for a, b in zip(sequence, previous):
            if a != b:
                break
            shared += 1
        path = previous_path[:shared] + list(range(len(tokens), len(tokens) + len(sequence) - shared))
        tokens += sequence[shared:]
        depth += range(shared, len(sequence))
        end += [0] * (len(sequence) - shared)
        for node in path:  # every node on the path now ends after this row's last node
            end[node] = len(tokens)
        paths[row], previous, previous_path = path, sequence, path
    keep, targets = [], []
    for row in sorted(paths):  # row-major, as ``completion_mask`` is read
        p, c = prompt_len[prompt_rows[row]], completion_len[row]
        keep += paths[row][p - 1: p + c - 1]  # the last prompt token predicts completion[0], and so on
        targets += completions[row][:c]
    as_long = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return TreeLayout(as_long(tokens)[None], as_long(depth)[None], as_long(end), as_long(keep), as_long(targets))


def model_attention_mask(attn: str, dtype: torch.dtype, subtree_end: torch.Tensor, dense: bool = False,
                         depth: torch.Tensor | None = None, window: int | None = None) -> object:
    """The tree's mask in the form the attention implementation ``attn`` takes: for sdpa the blocks of
    :mod:`lit_grpo.core.tree_attention` (``dense``: a boolean ``[1, 1, T, T]``, the reference), for eager an additive
    dense mask in ``dtype``, the hidden states', for flex attention a ``BlockMask``; ``window``: a sliding window
    over the nodes' ``depth``."""
    if attn == "flex_attention":
        from torch.nn.attention.flex_attention import create_block_mask

        def ancestor_or_self(batch, head, q, k):  # noqa: ANN001, ANN202 - flex's mask_mod signature
            return (k <= q) & (q < subtree_end[k])

        size = subtree_end.numel()
        return create_block_mask(ancestor_or_self, 1, None, size, size, device=subtree_end.device)
    if attn == "sdpa" and not dense:
        return tree_block_mask(subtree_end, depth=depth, window=window)
    allowed = tree_attention_mask(subtree_end, depth, window)[None, None]
    if attn == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed,
                                                                                           torch.finfo(dtype).min)
    return allowed


def tree_forward(model: nn.Module, attn: str, layout: TreeLayout, dense: bool = False, **head: object) -> object:
    """One forward of ``model`` (attention implementation ``attn``) over the tree, its output; ``head`` says where
    the lm head runs (``logits_to_keep``, and ``output_hidden_states`` for the chunked head of
    :mod:`lit_grpo.core.chunked_head`); ``dense``: sdpa over the dense mask (the reference) instead of the blocks.
    No cache: the mask is the only thing keeping branches apart."""
    from lit_grpo.core.chunked_head import unwrapped_model

    if uses_flash(attn):  # no mask: the segments ride in the kwargs (lit_grpo.core.tree_flash)
        return segments_forward(model, unwrapped_model(model), layout.input_ids, layout.position_ids,
                                tree_segments(layout.subtree_end), **head)
    dtype, depth = model.get_input_embeddings().weight.dtype, layout.position_ids[0]
    windows = tree_windows(unwrapped_model(model).config, unwrapped_model(model))
    if isinstance(windows, dict):  # one mask per layer kind, as the decoder's own mapping holds them
        mask = {kind: model_attention_mask(attn, dtype, layout.subtree_end, dense, depth, window)
                for kind, window in windows.items()}
    else:
        mask = model_attention_mask(attn, dtype, layout.subtree_end, dense, depth,
                                    windows if isinstance(windows, int) else None)
    return model(
        input_ids=layout.input_ids,
        attention_mask=mask,
        position_ids=layout.position_ids,
        use_cache=False,
        **head,
    )


def tree_token_count(mb: MicroBatch) -> torch.Tensor:
    """The budgeted tokens of ``mb``'s tree (an upper bound of its nodes: completion prefixes that coincide are
    not subtracted): each distinct prompt with a completion once, and each completion but its last token, as a
    0-d tensor on the masks' device (no host sync)."""
    completion_tokens = mb.completion_mask.sum(1)
    with_rows = torch.zeros(mb.prompt_mask.shape[0], dtype=torch.long, device=mb.prompt_mask.device)
    used = with_rows.index_add(0, mb.prompt_index, (completion_tokens > 0).long()) > 0
    return (mb.prompt_mask.sum(1) * used).sum() + (completion_tokens - 1).clamp(min=0).sum()
