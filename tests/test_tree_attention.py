"""The prefix tree's block attention (``lit_grpo.core.tree_attention``): blocks of queries against their own root
paths give sdpa-over-the-dense-mask's values and gradients, keep only the layer's own query, key and value for the
backward, and compute far fewer scores than the dense mask on a long tree."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_packing import TOL, llama, uneven_micro_batch
from test_prefix_tree import shared_turns_micro_batch

import lit_grpo.core.tree_attention as tree_attention
from lit_grpo.core.batch import left_pad, micro_batch_views
from lit_grpo.core.packing import packed_completion_logprobs
from lit_grpo.core.prefix_tree import tree_layout
from lit_grpo.core.tree_attention import (
    block_attention,
    query_blocks,
    segment_starts,
    tree_attention_mask,
    tree_block_mask,
)


def tree_end(seed: int = 0) -> torch.Tensor:
    """``subtree_end`` of a real layout: 3 groups of 3 uneven completions, multi-turn."""
    return tree_layout(uneven_micro_batch(seed=seed, multi_turn=True)).subtree_end


def long_group_micro_batch(prompt: int = 40, group: int = 8, completion: int = 200):
    """One prompt and ``group`` completions of ``completion`` tokens: the shape of a long GRPO micro-batch."""
    gen = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = left_pad([torch.randint(3, 40, (prompt,), generator=gen).tolist()], 0,
                                       torch.device("cpu"))
    completion_ids = torch.randint(3, 40, (group, completion), generator=gen)
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, torch.zeros(group, dtype=torch.long), completion_ids,
                              torch.ones_like(completion_ids), group)
    return mb


@pytest.mark.parametrize(("block_size", "window"), [(1, None), (4, None), (7, None), (1000, None), (4, 3), (7, 5)])
def test_blocks_cover_exactly_the_dense_rule(block_size: int, window: int | None) -> None:
    """Every allowed pair once, no other; with a sliding window over the depths too (and a block then gathers only
    the ancestors some query of it still sees)."""
    layout = tree_layout(uneven_micro_batch(seed=0, multi_turn=True))
    end, depth = layout.subtree_end, layout.position_ids[0]
    size = end.numel()
    covered = torch.zeros(size, size, dtype=torch.bool)
    for block in query_blocks(end, block_size, depth, window):
        assert block.mask.shape[-2:] == (block.end - block.start, block.keys.numel())
        rows = covered[block.start:block.end]
        assert not rows[:, block.keys][block.mask[0, 0]].any()  # no pair twice
        rows[:, block.keys] |= block.mask[0, 0]
        if window is not None:
            assert bool((depth[block.keys] > int(depth[block.start:block.end].min()) - window).all())
    assert torch.equal(covered, tree_attention_mask(end, depth, window))


@pytest.mark.parametrize("block_size", [1, 4, 1000])
def test_a_plain_block_sees_every_ancestor_then_itself_causally(block_size: int) -> None:
    """Without a window no block crosses a branch end, so its rule is every ancestor for every query, then causal
    over the block: what the CPU kernel computes without a mask (the flag ``plain``)."""
    end = tree_end(0)
    starts = segment_starts(end)
    assert 2 < int(starts.sum()) < end.numel()  # branches, and chains longer than one node
    for block in query_blocks(end, block_size):
        queries = block.end - block.start
        assert block.plain and not bool(starts[block.start + 1:block.end].any())
        ancestors = block.keys.numel() - queries
        expected = torch.cat([torch.ones(queries, ancestors, dtype=torch.bool),
                              torch.ones(queries, queries, dtype=torch.bool).tril()], dim=1)
        assert torch.equal(block.mask[0, 0], expected)
    assert not any(b.plain for b in query_blocks(end, 4, tree_layout(uneven_micro_batch(seed=0, multi_turn=True))
                                                 .position_ids[0], window=3))


@pytest.mark.parametrize(("window", "dtype"), [(None, torch.float32), (3, torch.float32), (None, torch.bfloat16)])
def test_without_grad_the_kernel_calls_equal_the_dense_mask(window: int | None, dtype: torch.dtype) -> None:
    """The passes that record no graph (pi_ref, alpha's recompute) call the CPU kernel directly, plain or masked."""
    layout = tree_layout(uneven_micro_batch(seed=0, multi_turn=True))
    end, depth = layout.subtree_end, layout.position_ids[0]
    q, k, v = (t.detach() for t in random_qkv(end.numel(), heads=6, dtype=dtype))
    with torch.no_grad():
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(end, depth, window)[None, None],
                                               enable_gqa=True)
        blocks = block_attention(q, k, v, query_blocks(end, 5, depth, window), enable_gqa=True)
    torch.testing.assert_close(blocks.float(), dense.float(), atol=TOL if dtype == torch.float32 else 2e-2, rtol=0)


def random_qkv(size: int, heads: int = 3, kv_heads: int = 3, dim: int = 8, dtype=torch.float32):  # noqa: ANN001, ANN201
    gen = torch.Generator().manual_seed(1)
    make = lambda h: torch.randn(1, h, size, dim, generator=gen).to(dtype).requires_grad_()  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


@pytest.mark.parametrize(("block_size", "gqa", "dtype"), [(1, False, torch.float32), (5, False, torch.float32),
                                                          (64, False, torch.float32), (5, True, torch.float32),
                                                          (5, False, torch.float64), (5, True, torch.float64)])
def test_values_and_gradients_equal_sdpa_over_the_dense_mask(block_size: int, gqa: bool, dtype) -> None:  # noqa: ANN001
    """float32 takes the CPU kernel's own backward (``_CpuBlockAttention``), float64 the recomputing backward that
    other devices run (``_BlockAttention``)."""
    end = tree_end(1)
    q, k, v = random_qkv(end.numel(), heads=6 if gqa else 3, dtype=dtype)
    grad_out = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=torch.Generator().manual_seed(2),
                           dtype=dtype)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(end)[None, None], enable_gqa=gqa,
                                           scale=0.3)
    expected = torch.autograd.grad(dense, (q, k, v), grad_out)
    blocks = block_attention(q, k, v, query_blocks(end, block_size), scale=0.3, enable_gqa=gqa)
    torch.testing.assert_close(blocks, dense, atol=TOL, rtol=0)
    for got, want in zip(torch.autograd.grad(blocks, (q, k, v), grad_out), expected):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("precision", ["bf16 tensors", "bf16 autocast"])
def test_bf16_within_its_rounding(precision: str) -> None:
    end = tree_end(2)
    dtype = torch.bfloat16 if precision == "bf16 tensors" else torch.float32
    q, k, v = random_qkv(end.numel(), dtype=dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast"):
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(end)[None, None])
        blocks = block_attention(q, k, v, query_blocks(end, 16))
    assert blocks.dtype == dense.dtype
    torch.testing.assert_close(blocks.float(), dense.float(), atol=2e-2, rtol=0)
    grads = [torch.autograd.grad(out.float().sum(), (q, k, v)) for out in (dense, blocks)]
    for got, want in zip(*grads[::-1]):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1.6e-2)  # 2 bf16 ulps


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_backward_keeps_only_the_layers_query_key_value_and_output(dtype) -> None:  # noqa: ANN001
    """Per-block autograd would save every block's gathered keys and values (``blocks x (depth + Lq)`` rows, many
    times the layer's own); the blocks' functions save q, k and v once (and on a CPU the output and each query's
    log-sum-exp, for the kernel's backward), whatever the block size."""
    end = tree_layout(long_group_micro_batch()).subtree_end
    q, k, v = random_qkv(end.numel(), dtype=dtype)
    saved: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.untyped_storage().nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block_attention(q, k, v, query_blocks(end, 16))
    lse = q.shape[1] * q.shape[2] * 4
    assert sum(saved) <= 4 * q.untyped_storage().nbytes() + lse


def test_a_long_tree_computes_a_fraction_of_the_dense_scores() -> None:
    """One prompt of 40 and 8 completions of 200: the blocks score each query against its depth plus a block, about
    15 % of the dense ``T x T`` pairs here (the share falls as the group grows)."""
    end = tree_layout(long_group_micro_batch()).subtree_end
    scores = sum(b.mask.numel() for b in query_blocks(end, 64))
    assert scores < 0.2 * end.numel() ** 2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_model_through_the_blocks_equals_the_dense_mask(checkpointing: bool, monkeypatch) -> None:  # noqa: ANN001
    """The whole path: a Llama over the tree in blocks of 3 queries (so most blocks cross a branch end), values and
    every weight's gradient against the dense mask, with and without gradient checkpointing (whose recompute gets
    the same mask object)."""
    monkeypatch.setattr(tree_attention, "DEFAULT_BLOCK_SIZE", 3)
    mb = shared_turns_micro_batch()
    real = mb.loss_mask.bool()
    results = []
    for dense in (True, False):
        model = llama("sdpa").train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        logp, entropy = packed_completion_logprobs(model, mb, 0.8, with_entropy=True, entropy_grad=True,
                                                   layout="packed_tree", dense_mask=dense)
        ((logp + 0.1 * entropy) * mb.loss_mask).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (dense_logp, dense_grads), (block_logp, block_grads) = results
    torch.testing.assert_close(block_logp[real], dense_logp[real], atol=TOL, rtol=0)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(block_grads[name], grad, atol=TOL, rtol=0, msg=name)


def test_another_op_on_the_mask_falls_back_to_the_dense_mask_with_a_warning() -> None:
    end = tree_end()
    mask = tree_block_mask(end, 4)
    with pytest.warns(UserWarning, match="falls back to the dense T x T mask"):
        sliced = mask[:, :, :, :5]
    assert type(sliced) is torch.Tensor
    assert torch.equal(sliced, tree_attention_mask(end)[None, None, :, :5])


def test_a_move_to_where_the_mask_is_keeps_the_blocks(recwarn) -> None:  # noqa: ANN001
    """DDP moves its inputs to the device: a no-op move answers with the mask itself, blocks and all, no warning."""
    mask = tree_block_mask(tree_end(), 4)
    for moved in (mask.to("cpu"), mask.to(mask.device), mask.contiguous(), mask.detach(), mask.cpu()):
        assert moved is mask
    assert not [w for w in recwarn if "falls back" in str(w.message)]
    with pytest.warns(UserWarning, match="falls back to the dense T x T mask"):
        as_float = mask.to(torch.float32)  # a real change of dtype: the dense rule, converted
    assert as_float.dtype == torch.float32 and type(as_float) is torch.Tensor


def test_attention_dropout_takes_the_dense_mask() -> None:
    """Dropout's recompute would need the forward's random state replayed: it runs the dense mask instead."""
    end = tree_end()
    q, k, v = random_qkv(end.numel())
    mask = tree_block_mask(end, 4)
    torch.manual_seed(3)
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5)
    torch.manual_seed(3)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(end)[None, None], dropout_p=0.5)
    torch.testing.assert_close(got, want)
