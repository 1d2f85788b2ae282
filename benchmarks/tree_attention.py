"""One layer's attention over a prefix tree: blocks of queries against their own root paths
(``lit_grpo.core.tree_attention``) against sdpa over the dense ``T x T`` mask, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/tree_attention.py [--prompts 2] [--group 8] [--length 2048]
        [--block-sizes 64 128 256 512] [--heads 9] [--head-dim 64] [--no-dense]

The tree is that of ``benchmarks/packing.py``'s micro-batch (``--prompts`` prompts of 64 to 128 tokens, ``--group``
completions of ``--length`` tokens each), laid out by ``lit_grpo.core.prefix_tree.tree_layout``; the query, key and
value are random ``[1, heads, T, head_dim]`` float32 tensors (SmolLM2-135M's 9 heads of 64 by default, its key-value
heads repeated as transformers' sdpa path does under a mask). Timed: the forward, and the backward of the output's
sum, once each after a warm-up on a small tree. Also printed: the (query, key) pairs each path scores, against the
pairs the tree's rule allows, and the largest difference of the output and of the gradients from the dense path;
and flash attention's layout of the same tree (``lit_grpo.core.tree_flash``: its segments, the key rows they
gather and the pairs its causal kernel scores), counted, not timed (its kernel needs a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def timed(fn, q, k, v):  # noqa: ANN001, ANN201
    """Seconds of the forward and of the backward of ``fn(q, k, v).sum()``, the output and the gradients."""
    start = time.perf_counter()
    out = fn(q, k, v)
    forward = time.perf_counter() - start
    start = time.perf_counter()
    grads = __import__("torch").autograd.grad(out.sum(), (q, k, v))
    return forward, time.perf_counter() - start, out.detach(), grads


def scored(block) -> int:  # noqa: ANN001
    """The pairs a block's kernel calls score: a ``plain`` block its ancestors for every query and the causal half
    of its own keys (the kernel skips the rest); a masked block every pair of its mask."""
    if getattr(block, "plain", False):
        queries = block.end - block.start
        return (block.keys.numel() - queries) * queries + queries * (queries + 1) // 2
    return block.mask.numel()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048, help="tokens of every completion")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--no-dense", action="store_true", help="skip the dense mask (its T x T scores)")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from packing import uneven_micro_batch

    from lit_grpo.core.prefix_tree import tree_layout
    from lit_grpo.core.tree_attention import block_attention, query_blocks, tree_attention_mask
    from lit_grpo.core.tree_flash import tree_segments

    end = tree_layout(uneven_micro_batch(args.prompts, args.group, args.length, args.length, 49152, 0)).subtree_end
    size = end.numel()
    allowed = int(sum((end[k] - k) for k in range(size)))  # each key is seen by its own subtree
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, size, args.head_dim, generator=gen).requires_grad_() for _ in range(3))
    paths = {}
    if not args.no_dense:
        def dense(q, k, v):  # noqa: ANN001, ANN202
            return F.scaled_dot_product_attention(q, k, v, attn_mask=tree_attention_mask(end)[None, None])
        paths["dense mask"] = (dense, size * size)
    for block_size in args.block_sizes:
        blocks = query_blocks(end, block_size)
        paths[f"blocks of {block_size}"] = (lambda q, k, v, b=blocks: block_attention(q, k, v, b),
                                            sum(scored(b) for b in blocks))
    small = tree_layout(uneven_micro_batch(1, 2, 16, 16, 49152, 1)).subtree_end
    warm = [torch.randn(1, args.heads, small.numel(), args.head_dim).requires_grad_() for _ in range(3)]
    block_attention(*warm, query_blocks(small, 8)).sum().backward()
    print(f"tree of {args.prompts} x {args.group} x {args.length}: T = {size}, {args.heads} heads of "
          f"{args.head_dim}, float32, {torch.get_num_threads()} threads; the rule allows {allowed:,} pairs")
    segments = tree_segments(end)  # flash attention's layout (a GPU's kernel: counted here, not timed)
    lengths_q = (segments.cu_seqlens_q[1:] - segments.cu_seqlens_q[:-1]).tolist()
    lengths_k = (segments.cu_seqlens_k[1:] - segments.cu_seqlens_k[:-1]).tolist()
    flash_pairs = sum(q * kk - q * (q - 1) // 2 for q, kk in zip(lengths_q, lengths_k))  # bottom-right causal
    print(f"flash segments: {len(lengths_q)}, gathered key rows {segments.kv_index.numel():,} "
          f"({segments.kv_index.numel() / size:.2f} x T), pairs {flash_pairs:,} ({flash_pairs / allowed:.2f} x "
          "allowed)")
    print(f"{'path':>16} {'pairs scored':>15} {'x allowed':>10} {'forward s':>10} {'backward s':>11} {'total s':>8} "
          f"{'max |diff|':>11}")
    reference = None
    for name, (fn, pairs) in paths.items():
        forward, backward, out, grads = timed(fn, q, k, v)
        if reference is None:
            reference, diff = (out, grads), 0.0
        else:
            diff = max([(out - reference[0]).abs().max().item()] +
                       [(g - r).abs().max().item() for g, r in zip(grads, reference[1])])
        print(f"{name:>16} {pairs:>15,} {pairs / allowed:>10.2f} {forward:>10.2f} {backward:>11.2f} "
              f"{forward + backward:>8.2f} {diff:>11.2e}", flush=True)


if __name__ == "__main__":
    main()
