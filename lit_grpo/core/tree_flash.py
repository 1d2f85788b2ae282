"""A prefix tree under flash attention: each segment of the tree against the keys of its own root path, through the
variable-length kernel, with no mask at all (the layout of TRL 1.16's ``experimental/async_grpo/packing.py``).

Flash attention takes no custom mask, only ``cu_seqlens`` of disjoint query and key sequences. Cut the pre-order
tree (:mod:`lit_grpo.core.prefix_tree`) into segments: maximal chains in which each node is its predecessor's only
child (:func:`lit_grpo.core.tree_attention.segment_starts`). A segment's queries see
the ancestors of its first node and the segment itself, in depth order; gathered into one key sequence per
segment, that is causal attention aligned to the bottom right (query ``i`` of ``Lq`` sees key ``j`` of ``Lk`` iff
``j <= i + Lk - Lq``), which is what flash-attn's varlen kernel computes with ``causal=True`` (since 2.1; older
releases align top left, and are refused). A sliding window is the kernel's own ``window_size``: the gathered keys
sit at consecutive depths, so "within ``w`` keys" is the tree's ``depth[q] - depth[k] < w``. The cost is
``sum over segments of Lq x Lk`` scores, and the gathered keys and values are ``sum of Lk`` rows a layer (a group's
prompt once per completion, as the copies layout feeds it, but not its queries, MLPs or head).

How it reaches the layers: transformers picks a layer's attention function by the config's
``_attn_implementation`` alone, so a flash model that packs as a tree is switched, once, to
``"<kernel>:lit_grpo_tree"`` (:func:`route_tree_flash`), registered with transformers' ``AttentionInterface``. That
function runs the tree when the forward is given its :class:`TreeSegments` (``lit_grpo_tree=``, which the decoder
hands every layer in its ``**kwargs``), and otherwise does exactly what ``flash_attention_forward`` does under the
kernel's own name, so generation and the other layouts are unchanged. The switch is permanent rather than per
forward, because activation checkpointing recomputes a layer in the backward, after any context has closed. A
layer that is not handed the segments during a tree forward raises instead of attending across branches.

Not run here: the kernel needs a CUDA GPU with flash-attn. The tests run this path on a CPU through a float32
varlen reference with flash-attn's signature and semantics (``tests/flash_reference.py``), against the dense
mask; ``tests/test_gpu.py`` runs the real kernel against it in bf16 when a GPU is there.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass

import torch
from torch import nn

#: the flash kernels transformers ships under these names (the hub's kernels are reached through them too)
FLASH_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
#: appended to a flash kernel's name: the attention function that also runs a tree
TREE_SUFFIX = ":lit_grpo_tree"
#: the keyword the tree's segments travel under, from the model's forward down to every attention layer
SEGMENTS_KWARG = "lit_grpo_tree"


@dataclass(frozen=True)
class TreeSegments:
    """A pre-order tree cut into segments, in flash-attn's varlen terms: the queries are the tree's nodes in order
    (segment ``s`` is ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``); its keys are ``kv_index[cu_seqlens_k[s]:
    cu_seqlens_k[s + 1]]``, the nodes of its root path, ascending."""

    kv_index: torch.Tensor  # [K] long
    cu_seqlens_q: torch.Tensor  # [S + 1] int32
    cu_seqlens_k: torch.Tensor  # [S + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


def tree_segments(subtree_end: torch.Tensor) -> TreeSegments:
    """The segments of a pre-order tree given ``subtree_end`` (``[T]``, one past each node's last descendant),
    computed on the host (one transfer) and returned on ``subtree_end``'s device."""
    from lit_grpo.core.tree_attention import segment_starts

    end = subtree_end.cpu()
    size = end.numel()
    nodes = torch.arange(size)
    starts = nodes[segment_starts(end)].tolist() + [size]
    paths = [torch.cat([nodes[:a][end[:a] > a], nodes[a:b]]) for a, b in zip(starts[:-1], starts[1:])]
    q_lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    k_lengths = [path.numel() for path in paths]
    cumulative = lambda lengths: torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # noqa: E731
    device = subtree_end.device
    return TreeSegments(torch.cat(paths).to(device), cumulative(q_lengths).to(device),
                        cumulative(k_lengths).to(device), max(q_lengths), max(k_lengths))


def chain_segments(position_ids: torch.Tensor) -> TreeSegments:
    """The copies layout's row (``position_ids [T]`` restarting at 0 for each sequence) as segments: each sequence
    one segment, its own keys; the kernel then keeps the sequences apart from these, not from the positions."""
    positions = position_ids.cpu()
    starts = torch.nonzero(positions == 0)[:, 0].tolist() + [positions.numel()]
    lengths = [b - a for a, b in zip(starts[:-1], starts[1:])]
    cumulative = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(position_ids.device)
    return TreeSegments(torch.arange(positions.numel(), device=position_ids.device), cumulative, cumulative,
                        max(lengths), max(lengths))


def uses_flash(attn: object) -> bool:
    """Whether ``attn`` is a flash kernel's name, or the tree's function over one (:func:`route_tree_flash`)."""
    return attn in FLASH_ATTENTION or is_tree_flash(attn)


def segments_forward(model: nn.Module, base: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                     segments: TreeSegments, **head: object) -> object:
    """One forward of ``model`` (``base``: the transformers model inside any wrapper) over a packed row whose
    attention ``segments`` say, under the guard: no mask, no cache."""
    route_tree_flash(base)
    with tree_forward_guard():
        return model(input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False,
                     **{SEGMENTS_KWARG: segments}, **head)


def is_tree_flash(attn: object) -> bool:
    """Whether ``attn`` names the tree's flash attention function (:func:`route_tree_flash`)."""
    return isinstance(attn, str) and attn.endswith(TREE_SUFFIX)


def flash_kernel(attn: str) -> str:
    """The flash kernel's own name behind ``attn``."""
    return attn.removesuffix(TREE_SUFFIX)


def tree_flash_unsupported(config: object, model: nn.Module | None = None) -> str | None:
    """``None`` when a flash model of this ``config`` can run the tree, else one line saying why not: a layer kind
    other than full or sliding attention (a chunked layer's chunks), a flash-attn that aligns its causal mask top
    left, or a ``model`` whose forward takes no keyword to hand its layers."""
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        return (f"a packed row under flash attention would replace the window of the model's "
                f"{', '.join(sorted(kinds))} layers")
    from transformers.modeling_flash_attention_utils import flash_attn_supports_top_left_mask

    if flash_attn_supports_top_left_mask():
        return "a packed row under flash attention needs flash-attn >= 2.1 (bottom-right causal alignment)"
    if model is not None:
        parameters = inspect.signature(type(model).forward).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            return f"{type(model).__name__}.forward takes no **kwargs to hand a packed row's segments to its layers"
        if (why := _kwargs_reach_attention(model)) is not None:
            return why
        if any(name.endswith("sinks") for name, _ in model.named_parameters()):
            # transformers hands sinks only to kernels that take them (vLLM's FA3, FA4) and drops them otherwise
            return f"{type(model).__name__} has attention sinks, which the packed flash path does not carry"
    return None


@functools.cache
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def _call_arguments(source: str, call: str) -> str | None:
    """The text between the parentheses of the first ``call(`` in ``source``, or None."""
    start = source.find(call)
    if start < 0:
        return None
    depth, i = 0, start + len(call) - 1
    for j in range(i, len(source)):
        depth += {"(": 1, ")": -1}.get(source[j], 0)
        if depth == 0:
            return source[i + 1:j]
    return None


def _kwargs_reach_attention(model: nn.Module) -> str | None:
    """``None`` when every attention module of ``model`` picks its function through transformers'
    ``AttentionInterface`` (read in its forward's source) and its parent layer calls it with ``**kwargs``, which
    carry the segments down; else one line naming the module that does not. Read once per class."""
    found = set()
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) in found or "attention_interface" not in _forward_source(type(child)):
                continue
            arguments = _call_arguments(_forward_source(type(parent)), f"self.{name}(")
            if arguments is None or "**kwargs" not in arguments:
                return (f"{type(parent).__name__} calls its {name} without **kwargs, which would carry the packed "
                        "row's segments to flash attention")
            found.add(type(child))
    if not found:
        return (f"{type(model).__name__}'s attention does not go through transformers' AttentionInterface, which "
                "hands a packed row's segments to flash attention")
    return None


def route_tree_flash(model: nn.Module) -> str:
    """Switch ``model`` (a transformers model under a flash kernel) to the attention function that also runs a
    tree, once; returns the name its config then holds. Idempotent; other models are untouched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    config = model.config
    attn = config._attn_implementation
    if is_tree_flash(attn):
        return attn
    if attn not in FLASH_ATTENTION:
        raise ValueError(f"the tree's flash path needs one of {', '.join(FLASH_ATTENTION)}; the model uses {attn!r}")
    name = attn + TREE_SUFFIX
    AttentionInterface.register(name, tree_flash_attention)
    AttentionMaskInterface.register(name, flash_attention_mask)  # what the kernel's own name builds: None or 2D
    for sub in {id(c): c for c in (config, config.get_text_config())}.values():
        sub._attn_implementation = name
    return name


class _TreeForward(threading.local):
    active = 0  # tree forwards in progress on this thread
    calls = 0  # attention layers that ran the tree in the current one


_STATE = _TreeForward()


class tree_forward_guard:  # noqa: N801 - used as a context manager, like torch.no_grad
    """Around a tree forward: an attention layer called without the segments raises, and a forward in which no
    layer ran the tree (a decoder that drops its ``**kwargs``) raises after it."""

    def __enter__(self) -> None:
        _STATE.active += 1
        self._calls, _STATE.calls = _STATE.calls, 0

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        calls, _STATE.calls = _STATE.calls, self._calls
        _STATE.active -= 1
        if kind is None and calls == 0:
            raise RuntimeError("the prefix tree's segments reached no attention layer: the model's decoder does not "
                               "hand its **kwargs down; set model.packing: false or another attn_implementation")


def tree_flash_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None,
                         is_causal: bool | None = None, s_aux: torch.Tensor | None = None,
                         lit_grpo_tree: TreeSegments | None = None, **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``query [B, H, T, D]``, key and value ``[B, H', T, D]``). With
    ``lit_grpo_tree``: the tree's varlen attention (batch 1, no mask); without: the flash kernel's own path."""
    kernel = flash_kernel(module.config._attn_implementation)
    if lit_grpo_tree is None:
        if _STATE.active:
            raise RuntimeError(f"{type(module).__name__} was called without the prefix tree's segments during a tree "
                               "forward: it would attend across branches")
        return _flash(module, kernel, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      sliding_window=sliding_window, softcap=softcap, is_causal=is_causal, s_aux=s_aux, **kwargs)
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("the prefix tree is one row without a mask; got batch "
                         f"{query.shape[0]} and a mask of {type(attention_mask).__name__}")
    _STATE.calls += 1
    kwargs.pop("position_ids", None)  # the segments say what attends; positions only rotate (already applied)
    segments = lit_grpo_tree
    key, value = key.index_select(2, segments.kv_index), value.index_select(2, segments.kv_index)
    return _flash(module, kernel, query, key, value, None, dropout=dropout, scaling=scaling,
                  sliding_window=sliding_window, softcap=softcap, is_causal=True, s_aux=s_aux,
                  cu_seq_lens_q=segments.cu_seqlens_q, cu_seq_lens_k=segments.cu_seqlens_k,
                  max_length_q=segments.max_seqlen_q, max_length_k=segments.max_seqlen_k, **kwargs)


def _flash(module: nn.Module, kernel: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
           attention_mask: torch.Tensor | None, *, dropout: float, scaling: float | None, sliding_window: int | None,
           softcap: float | None, is_causal: bool | None, s_aux: torch.Tensor | None,
           **kwargs: object) -> tuple[torch.Tensor, None]:
    """transformers 5.24's ``integrations.flash_attention.flash_attention_forward``, step for step, but under
    ``kernel``'s name (that function reads the kernel from the config, which names this one)."""
    from transformers.integrations.flash_attention import _use_top_left_mask
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    if any(dim == 0 for dim in query.shape):
        raise ValueError("flash attention takes no empty query; got shape " + str(tuple(query.shape)))
    seq_len = query.shape[2]
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    head_dim, v_head_dim = query.shape[-1], value.shape[-1]
    if v_head_dim != head_dim:  # the kernel takes one head size: pad the values (MLA), crop the output below
        value = nn.functional.pad(value, [0, head_dim - v_head_dim])
    out = _flash_attention_forward(
        query, key, value, attention_mask, query_length=seq_len,
        is_causal=is_causal if is_causal is not None else module.is_causal, dropout=dropout, softmax_scale=scaling,
        sliding_window=sliding_window, softcap=softcap, use_top_left_mask=_use_top_left_mask,
        target_dtype=_target_dtype(query, module), attn_implementation=kernel,
        layer_idx=getattr(module, "layer_idx", None), s_aux=s_aux.to(query.dtype) if s_aux is not None else None,
        **kwargs)
    return (out[..., :v_head_dim] if v_head_dim != head_dim else out), None


def _target_dtype(query: torch.Tensor, module: nn.Module) -> torch.dtype | None:
    """transformers' ``get_target_dtype`` (the dtype a float32 query is cast to for the kernel), which raises
    StopIteration for a model without ``nn.Linear`` layers (GPT-2's ``Conv1D``): there, the weights' dtype."""
    from transformers.integrations.flash_attention import get_target_dtype

    try:
        return get_target_dtype(query, module)
    except StopIteration:
        return next(module.parameters()).dtype
