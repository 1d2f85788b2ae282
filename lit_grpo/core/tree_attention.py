"""Attention over a prefix tree that computes only what a token may see: blocks of queries against their own
root path, gathered, instead of sdpa over a dense ``T x T`` mask.

A pre-order tree (:mod:`lit_grpo.core.prefix_tree`) lets query ``q`` see key ``k`` iff ``k <= q < subtree_end[k]``.
Cut each segment of the tree (a chain between branch points, :func:`segment_starts`) into contiguous blocks of
queries ``[q0, q1)``. Within a chain every query of the block descends from ``q0``, so each sees every ancestor
of ``q0`` (every ``k < q0`` with ``subtree_end[k] > q0``) and, causally, the block's own nodes: the rule needs no
mask. On a CPU a block runs the flash kernel twice without one, causal over its own keys (a contiguous slice,
whose masked half the kernel skips) and against its gathered ancestors, merged by the two log-sum-exps in float32,
so a micro-batch of ``G`` completions of ``C`` tokens after a prompt of ``P`` scores about ``G C (P + C / 2)``
pairs, the rule's own count, instead of the dense mask's ``(P + G C)^2``. Elsewhere, and under a sliding window
(whose rule cuts the ancestors per query), a block runs sdpa once with the rule restricted to its keys as its mask.
For one row it is causal attention over ``prompt + completion``: the same numbers as the dense mask within the
kernels' rounding.

How it reaches the model: :func:`tree_block_mask` returns a 4D boolean tensor of shape ``[1, 1, T, T]`` (one
element, expanded: no memory) of a subclass whose ``__torch_function__`` answers
``torch.nn.functional.scaled_dot_product_attention`` with the blocks. transformers passes a 4D mask through its mask
builders unchanged (``masking_utils._preprocess_mask_arguments``) down to ``sdpa_attention_forward``, which calls
sdpa with it; nothing global is switched, so gradient checkpointing's recompute and other threads see the same
thing. Any other operation on the mask (a family that slices or adds it itself) gets the dense mask, with one
warning: slow, never wrong.

Memory: the backward does not keep each block's gathered keys and values (``blocks x (depth + Lq)`` of them would
be many times the layer's own); a custom autograd function saves the query, key and value once and gathers a
block's keys again in the backward, accumulating their gradients in float32. On a CPU it runs the flash kernel
sdpa runs there, per block, and keeps its output and log-sum-exp for that kernel's backward, which each of a
block's two parts takes with the merged ones; elsewhere the backward recomputes each block's forward first (one
more attention forward).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: queries per block without a window (``plain`` blocks: no mask; on a CPU the kernel skips the causal half of a
#: block's own keys, so a large block wastes nothing): one layer's attention forward and backward over a tree of 2
#: prompts x 8 completions of 2,048 tokens (T = 32,924; 9 heads of 64), one CPU core, beside the masked blocks of
#: the commit before in one run (each on its own core): 3.04 s in blocks of 256, 2.92 s of 512, 2.70 s of 1,024,
#: against 3.67 s for the masked blocks of 256 (docs/speed.md)
DEFAULT_BLOCK_SIZE = 1024
#: queries per block where a block takes a mask (``block x keys`` of it, every pair scored): under a sliding window,
#: and off a CPU (another device's sdpa returns no log-sum-exp to merge two parts by); small enough that the mask's
#: causal half stays small. The masked blocks took 6.3 s in blocks of 256 against 9.2 s of 64 and 6.9 s of 512
#: (one core, the same tree)
MASKED_BLOCK_SIZE = 256


@dataclass(frozen=True)
class QueryBlock:
    """One block of queries ``[start, end)``, the nodes it may attend to (``keys``, ascending: the ancestors of
    ``start``, then the block itself) and the rule restricted to them (``mask[i, j]``: query ``start + i`` may see
    key ``keys[j]``). ``plain``: the rule is every ancestor for every query, then causal over the block, so a kernel
    needs no mask (blocks within one segment, no window)."""

    start: int
    end: int
    keys: torch.Tensor  # [Lk] long
    mask: torch.Tensor  # [1, 1, Lq, Lk] bool
    plain: bool = False


def segment_starts(subtree_end: torch.Tensor) -> torch.Tensor:
    """``[T]`` booleans, True where a node starts a segment of the pre-order tree: a maximal chain in which each node
    is its predecessor's only child. Node ``k`` continues the chain iff ``subtree_end[k - 1] == subtree_end[k]``
    (``k - 1``'s subtree is itself and ``k``'s)."""
    starts = torch.ones(subtree_end.shape, dtype=torch.bool, device=subtree_end.device)
    starts[1:] = subtree_end[1:] != subtree_end[:-1]
    return starts


def query_blocks(subtree_end: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, depth: torch.Tensor | None = None,
                 window: int | None = None) -> tuple[QueryBlock, ...]:
    """The blocks of a pre-order tree given ``subtree_end`` (``[T]``, one past each node's last descendant): each
    segment (:func:`segment_starts`) cut into blocks of at most ``block_size`` queries, so that no block crosses a
    branch end. With a sliding ``window`` (and each node's ``depth``) a block keeps only the ancestors some query of
    it still sees, and its rule needs a mask; without one every block is ``plain``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    size = subtree_end.numel()
    nodes = torch.arange(size, device=subtree_end.device)
    bounds = torch.nonzero(segment_starts(subtree_end))[:, 0].tolist() + [size]
    blocks = []
    for first, last in zip(bounds[:-1], bounds[1:]):
        for start in range(first, last, block_size):
            end = min(start + block_size, last)
            ancestors = nodes[:start][subtree_end[:start] > start]
            if window is not None:  # the shallowest query of the block sees back to depth - window + 1
                ancestors = ancestors[depth[ancestors] > int(depth[start:end].min()) - window]
            keys = torch.cat([ancestors, nodes[start:end]])
            rule = may_attend(nodes[start:end], keys, subtree_end, depth, window)
            blocks.append(QueryBlock(start, end, keys, rule[None, None], plain=window is None))
    return tuple(blocks)


def may_attend(queries: torch.Tensor, keys: torch.Tensor, subtree_end: torch.Tensor, depth: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
    """``[len(queries), len(keys)]`` booleans, True where node ``q`` may attend node ``k`` of a pre-order tree:
    ``k <= q < subtree_end[k]``, i.e. ``k`` is ``q`` or one of its ancestors; with a sliding ``window`` also
    ``depth[q] - depth[k] < window`` (transformers' ``sliding_window_overlay``, on the tree's positions)."""
    allowed = (keys[None, :] <= queries[:, None]) & (queries[:, None] < subtree_end[keys][None, :])
    if window is not None:
        allowed &= depth[queries][:, None] - depth[keys][None, :] < window
    return allowed


def tree_attention_mask(subtree_end: torch.Tensor, depth: torch.Tensor | None = None,
                        window: int | None = None) -> torch.Tensor:
    """The dense ``[T, T]`` rule (:func:`may_attend` over every pair): the reference the blocks are tested against,
    and the mask of the attention implementations that take one whole (eager, flex attention)."""
    nodes = torch.arange(subtree_end.numel(), device=subtree_end.device)
    return may_attend(nodes, nodes, subtree_end, depth, window)


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _blocks_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: tuple[QueryBlock, ...],
                    scale: float | None, gqa: bool) -> torch.Tensor:
    outputs = [F.scaled_dot_product_attention(query[:, :, b.start:b.end], key.index_select(2, b.keys),
                                              value.index_select(2, b.keys), attn_mask=b.mask, scale=scale,
                                              enable_gqa=gqa)
               for b in blocks]
    return torch.cat(outputs, dim=2)


class _BlockAttention(torch.autograd.Function):
    """sdpa over the blocks; the backward recomputes one block at a time (see the module docstring). Any device;
    a CPU runs :class:`_CpuBlockAttention`."""

    @staticmethod
    def forward(ctx, query, key, value, blocks, scale, gqa):  # noqa: ANN001, ANN205 - autograd's signature
        ctx.save_for_backward(query, key, value)
        ctx.blocks, ctx.scale, ctx.gqa = blocks, scale, gqa
        ctx.autocast = _autocast_state(query.device.type)
        return _blocks_forward(query, key, value, blocks, scale, gqa)

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        query, key, value = ctx.saved_tensors
        grad_q = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        grad_k = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        grad_v = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(query.device.type, dtype=dtype, enabled=enabled):
            for b in ctx.blocks:
                q = query[:, :, b.start:b.end].detach().requires_grad_()
                k = key.index_select(2, b.keys).detach().requires_grad_()
                v = value.index_select(2, b.keys).detach().requires_grad_()
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=b.mask, scale=ctx.scale, enable_gqa=ctx.gqa)
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out[:, :, b.start:b.end])
                grad_q[:, :, b.start:b.end] = dq
                grad_k.index_add_(2, b.keys, dk.float())
                grad_v.index_add_(2, b.keys, dv.float())
        return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype), None, None, None


def _cpu_block_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, b: QueryBlock,
                       scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the CPU flash kernel: its output and each query's log-sum-exp. A ``plain`` block runs
    without a mask, in two calls: causal over the block's own keys (a contiguous slice; the kernel skips the
    masked half) and every query against the gathered ancestors, merged by their log-sum-exps in float32, the
    combination split-key attention uses (flash-decoding); a block with a window runs once, with its mask."""
    rows = slice(b.start, b.end)
    if not b.plain:
        return _CPU_FLASH(query[:, :, rows], key.index_select(2, b.keys), value.index_select(2, b.keys), 0.0, False,
                          attn_mask=_additive(b, query.dtype), scale=scale)
    own, own_lse = _CPU_FLASH(query[:, :, rows], key[:, :, rows], value[:, :, rows], 0.0, True, scale=scale)
    ancestors = _ancestors(b)
    if ancestors.numel() == 0:
        return own, own_lse
    past, past_lse = _CPU_FLASH(query[:, :, rows], key.index_select(2, ancestors), value.index_select(2, ancestors),
                                0.0, False, scale=scale)
    lse = torch.logaddexp(past_lse.float(), own_lse.float())
    out = (past.float() * (past_lse - lse).exp()[..., None] + own.float() * (own_lse - lse).exp()[..., None])
    return out.to(query.dtype), lse.to(own_lse.dtype)


def _ancestors(b: QueryBlock) -> torch.Tensor:
    """The keys of a block before its own nodes."""
    return b.keys[: b.keys.numel() - (b.end - b.start)]


class _CpuBlockAttention(torch.autograd.Function):
    """On a CPU: per block, the flash kernel sdpa itself runs there (``_scaled_dot_product_flash_attention_for_cpu``,
    the same numbers), which also returns each query's log-sum-exp; the backward hands the saved output and
    log-sum-exp to the kernel's own backward instead of recomputing the block's forward (about a fifth of the
    attention's time at 2 x 8 x 2,048 tokens). A ``plain`` block's two parts each take the kernel's backward with
    the merged output and log-sum-exp: their probabilities are the merged softmax's, so the parts' gradients sum
    to the block's."""

    @staticmethod
    def forward(ctx, query, key, value, blocks, scale):  # noqa: ANN001, ANN205 - autograd's signature
        outputs, lses = zip(*(_cpu_block_forward(query, key, value, b, scale) for b in blocks))
        output = torch.cat(outputs, dim=2)
        ctx.save_for_backward(query, key, value, output, torch.cat(lses, dim=2))
        ctx.blocks, ctx.scale = blocks, scale
        return output

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        query, key, value, output, lse = ctx.saved_tensors
        grad_q = torch.empty_like(query)
        grad_k = torch.zeros(key.shape, dtype=torch.float32, device=key.device)
        grad_v = torch.zeros(value.shape, dtype=torch.float32, device=value.device)
        for b in ctx.blocks:
            rows = slice(b.start, b.end)
            block = (grad_out[:, :, rows], query[:, :, rows])
            saved = (output[:, :, rows], lse[:, :, rows])
            if not b.plain:
                dq, dk, dv = _CPU_FLASH_BACKWARD(*block, key.index_select(2, b.keys), value.index_select(2, b.keys),
                                                 *saved, 0.0, False, attn_mask=_additive(b, query.dtype),
                                                 scale=ctx.scale)
                grad_k.index_add_(2, b.keys, dk.float())
                grad_v.index_add_(2, b.keys, dv.float())
                grad_q[:, :, rows] = dq
                continue
            dq, dk, dv = _CPU_FLASH_BACKWARD(*block, key[:, :, rows], value[:, :, rows], *saved, 0.0, True,
                                             scale=ctx.scale)
            grad_k[:, :, rows] += dk.float()
            grad_v[:, :, rows] += dv.float()
            if (ancestors := _ancestors(b)).numel():
                dq_past, dk, dv = _CPU_FLASH_BACKWARD(*block, key.index_select(2, ancestors),
                                                      value.index_select(2, ancestors), *saved, 0.0, False,
                                                      scale=ctx.scale)
                dq = (dq.float() + dq_past.float()).to(dq.dtype)
                grad_k.index_add_(2, ancestors, dk.float())
                grad_v.index_add_(2, ancestors, dv.float())
            grad_q[:, :, rows] = dq
        return grad_q, grad_k.to(key.dtype), grad_v.to(value.dtype), None, None


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _additive(block: QueryBlock, dtype: torch.dtype) -> torch.Tensor:
    """The block's rule as the CPU kernel takes it (sdpa converts a boolean mask so): 0 where a query may attend,
    -inf elsewhere, in the query's dtype."""
    return torch.zeros(block.mask.shape, dtype=dtype, device=block.mask.device).masked_fill(~block.mask,
                                                                                           float("-inf"))


def block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: tuple[QueryBlock, ...],
                    scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """sdpa of ``query`` ``[B, H, T, D]`` against ``key``/``value`` ``[B, H', T, D]`` over the tree's blocks."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if not grad and query.device.type != "cpu":
        return _blocks_forward(query, key, value, blocks, scale, enable_gqa)
    if query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16, torch.float16):
        if enable_gqa:  # the kernel takes equal heads: repeat the key-value heads, as sdpa's math path does
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        if torch.is_autocast_enabled("cpu"):  # sdpa runs in the autocast dtype there: cast as it would
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        with torch.autocast("cpu", enabled=False):
            if not grad:
                return torch.cat([_cpu_block_forward(query, key, value, b, scale)[0] for b in blocks], dim=2)
            return _CpuBlockAttention.apply(query, key, value, blocks, scale)
    if not grad:
        return _blocks_forward(query, key, value, blocks, scale, enable_gqa)
    return _BlockAttention.apply(query, key, value, blocks, scale, enable_gqa)


#: metadata a mask is asked for on its way down (shape checks, device moves to where it already is)
_PASSTHROUGH = {"__get__", "dim", "size", "__len__", "is_floating_point", "numel"}
#: copies that change nothing when they stay on the mask's device: answered with the mask itself
_MOVES = {"to", "cuda", "cpu", "contiguous", "detach"}


class TreeBlockMask(torch.Tensor):
    """The tree's mask as transformers hands it to sdpa: shape ``[1, 1, T, T]``, answered by the blocks."""

    blocks: tuple[QueryBlock, ...]
    subtree_end: torch.Tensor
    depth: torch.Tensor | None
    window: int | None

    def dense(self) -> torch.Tensor:
        """The same rule as a dense ``[1, 1, T, T]`` boolean mask."""
        return tree_attention_mask(self.subtree_end, self.depth, self.window)[None, None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - torch's protocol
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _sdpa(*args, **kwargs)
        name = getattr(func, "__name__", None)
        if name in _PASSTHROUGH:
            return super().__torch_function__(func, types, args, kwargs)
        if name in _MOVES and args and isinstance(args[0], TreeBlockMask):
            # a wrapper moving its inputs (DDP's ``_to_kwargs``) to where the mask already is: the mask itself
            moved = super().__torch_function__(func, types, args, kwargs)
            if moved.device == args[0].device and moved.dtype == torch.bool:
                return args[0]
        warnings.warn(f"the prefix tree's block attention met {getattr(func, '__name__', func)!r} on its mask, which "
                      "this model's attention applies itself; it falls back to the dense T x T mask", stacklevel=2)
        densify = lambda a: a.dense() if isinstance(a, TreeBlockMask) else a  # noqa: E731
        return func(*[densify(a) for a in args], **{k: densify(v) for k, v in kwargs.items()})


def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: TreeBlockMask | None = None,
          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
          enable_gqa: bool = False) -> torch.Tensor:
    """``scaled_dot_product_attention`` called with a :class:`TreeBlockMask`; attention dropout (which the blocks'
    recompute would have to replay) takes the dense mask."""
    if is_causal:
        raise ValueError("a prefix tree's mask is its own causal rule; sdpa was called with is_causal=True too")
    if dropout_p > 0.0:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask.dense(), dropout_p=dropout_p,
                                              scale=scale, enable_gqa=enable_gqa)
    return block_attention(query, key, value, attn_mask.blocks, scale, enable_gqa)


def tree_block_mask(subtree_end: torch.Tensor, block_size: int | None = None, depth: torch.Tensor | None = None,
                    window: int | None = None) -> TreeBlockMask:
    """The mask to pass a model whose attention is sdpa, in place of the dense ``[1, 1, T, T]`` one, in blocks of
    ``block_size`` queries (None: :data:`DEFAULT_BLOCK_SIZE` on a CPU, :data:`MASKED_BLOCK_SIZE` with a window or on
    another device); ``window``: a sliding window over the nodes' ``depth``."""
    size = subtree_end.numel()
    mask = torch.ones((), dtype=torch.bool, device=subtree_end.device).expand(1, 1, size, size)
    mask = mask.as_subclass(TreeBlockMask)
    plain = window is None and subtree_end.device.type == "cpu"  # see block_attention: masks elsewhere
    default = DEFAULT_BLOCK_SIZE if plain else MASKED_BLOCK_SIZE  # read at the call (tests patch them)
    mask.blocks = query_blocks(subtree_end, block_size or default, depth, window)
    mask.subtree_end, mask.depth, mask.window = subtree_end, depth, window
    return mask
