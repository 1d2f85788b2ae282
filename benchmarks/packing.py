"""Forward + backward of the update's log-probs on uneven lengths: padded micro-batches against one packed row,
as prompt copies and as a prefix tree.

    OMP_NUM_THREADS=2 python benchmarks/packing.py [--prompts 2] [--group 8] [--min-len 16] [--max-len 512]
    OMP_NUM_THREADS=2 python benchmarks/packing.py --profile        # where each path's time goes, by operator

A random-init model of SmolLM2-135M's shape (``make_random_model.smol135_config``, built in memory, nothing saved)
scores the same micro-batches three ways, side by side in one run:

* ``padded``: ``lit_grpo.core.scoring.completion_logprobs``, the unpacked path: one forward over the distinct
  prompts (left-padded), their KV cache shared by the completions, then the completions right-padded to the longest;
* ``copies``: ``lit_grpo.core.packing.packed_completion_logprobs(layout="packed")``: every row's real tokens in one
  row, no padding, each completion with its own copy of the prompt (packing before the prefix tree; flash
  attention's layout);
* ``tree``: the same with ``layout="packed_tree"`` (``lit_grpo.core.prefix_tree``): each prompt once, its
  completions as branches, attending in blocks of queries to their own root paths
  (``lit_grpo.core.tree_attention``);
* ``tree-dense``: the tree through sdpa over the dense ``T x T`` mask (``dense_mask=True``), the blocks' reference.

Each path is timed ``--repeats`` times per micro-batch after a warm-up (the median is reported). ``--profile``
runs each path once more under ``torch.profiler`` and prints its operators' self CPU time grouped by kind
(matmuls, attention, the log-softmax over the vocabulary, the mask, the rest).

Each micro-batch has ``--prompts`` distinct prompts of 64 to 128 tokens and ``--group`` completions per prompt whose
lengths are drawn uniformly from ``--min-len`` to ``--max-len`` (the extremes always present). The loss is the mean
log-prob of the real completion tokens; the time is one forward and backward after a warm-up. The table gives the
tokens each path computes (padded: prompt rows + completion rows x their widths; packed: the packed row), the share
of them beyond the useful ones (each distinct prompt once plus the real completion tokens: padding for ``padded``,
the repeated prompts for ``packed``), the real completion tokens scored per second, and the largest log-prob
difference between the two paths.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def uneven_micro_batch(prompts: int, group: int, min_len: int, max_len: int, vocab: int, seed: int):  # noqa: ANN201
    """One micro-batch as ``RolloutBatch.micro_batches`` lays it out, with uneven completion lengths."""
    import torch

    from lit_grpo.core.batch import left_pad, micro_batch_views

    gen = torch.Generator().manual_seed(seed)
    prompt_lists = [torch.randint(3, vocab, (int(torch.randint(64, 129, (1,), generator=gen)),), generator=gen).tolist()
                    for _ in range(prompts)]
    prompt_ids, prompt_mask = left_pad(prompt_lists, pad_id=2, device=torch.device("cpu"))
    rows = prompts * group
    lengths = torch.randint(min_len, max_len + 1, (rows,), generator=gen)
    lengths[0], lengths[-1] = min_len, max_len
    width = int(lengths.max())
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (rows, width), generator=gen) * completion_mask
    group_index = torch.arange(prompts).repeat_interleave(group)
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, group_index, completion_ids, completion_mask, rows)
    return mb


def force_copies_layout() -> None:
    """Packing in the layout before the prefix tree, each completion after its own prompt copy (the layout flash
    attention keeps), in this process: the module and the scoring both ask ``packed_layout_kind``."""
    import lit_grpo.core.packing as packing
    import lit_grpo.training.module as module

    packing.packed_layout_kind = module.packed_layout_kind = lambda model: "packed"


#: operator name fragments -> the kind the profile groups them under (first match wins)
KINDS = (
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "aten::_softmax", "aten::softmax",
                   "aten::index_select", "aten::index_add")),  # the tree's blocks gather their keys
    ("log-softmax / vocab", ("log_softmax", "logsumexp", "aten::gather", "aten::exp", "aten::sub")),
    ("mask", ("aten::le", "aten::lt", "aten::__and__", "aten::logical_and", "aten::bitwise_and", "aten::where",
              "aten::masked_fill")),
    ("copies / layout", ("aten::copy_", "aten::cat", "aten::index", "aten::clone", "aten::contiguous",
                         "aten::to", "aten::_to_copy")),
)


def profile_by_kind(fn, model, mb) -> tuple[dict[str, float], list[tuple[str, float]]]:  # noqa: ANN001
    """Self CPU seconds of one forward and backward of ``fn``, summed by :data:`KINDS` (``other`` for the rest),
    and the five largest operators of ``other``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        seconds, _ = timed_step(fn, model, mb)
    print(f"    profiled pass: {seconds:.2f} s wall")
    totals: dict[str, float] = {}
    others: list[tuple[str, float]] = []
    for event in prof.key_averages():
        kind = next((k for k, names in KINDS if any(n in event.key for n in names)), "other")
        seconds = event.self_cpu_time_total / 1e6
        totals[kind] = totals.get(kind, 0.0) + seconds
        if kind == "other":
            others.append((event.key, seconds))
    return totals, sorted(others, key=lambda item: -item[1])[:5]


def timed_step(fn, model, mb) -> tuple[float, object]:  # noqa: ANN001
    """Seconds for one forward and backward of the mean log-prob of the real tokens, and the detached log-probs."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    logp, _ = fn(model, mb, 1.0)
    mask = mb.completion_mask.float()
    ((logp * mask).sum() / mask.sum()).backward()
    return time.perf_counter() - start, logp.detach()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2, help="distinct prompts per micro-batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=1, help="timed micro-batches per path (seeds 0, 1, ...)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's 30, for a quick run")
    parser.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs of each path per micro-batch (median); 0 with --profile: the profiled pass")
    parser.add_argument("--checkpointing", action="store_true",
                        help="activation checkpointing of the decoder layers (long rows: activations otherwise grow "
                             "past the memory)")
    parser.add_argument("--profile", action="store_true", help="also profile each path once, by operator kind")
    parser.add_argument("--paths", default="padded,copies,tree,tree-dense",
                        help="comma-separated paths to run (padded, copies, tree, tree-dense)")
    args = parser.parse_args(argv)
    if args.repeats < 1 and not args.profile:
        parser.error(f"--repeats must be >= 1 (0 only with --profile: its one pass is timed), got {args.repeats}")

    import functools
    import statistics

    import torch
    from make_random_model import smol135_config
    from transformers import AutoModelForCausalLM

    from lit_grpo.core.packing import packed_completion_logprobs, packing_supported
    from lit_grpo.core.prefix_tree import tree_layout
    from lit_grpo.core.scoring import completion_logprobs

    config = smol135_config()
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    config._attn_implementation = args.attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reason = packing_supported(model)
    if reason is not None:
        raise SystemExit(reason)
    paths = {"padded": completion_logprobs,
             "copies": functools.partial(packed_completion_logprobs, layout="packed"),
             "tree": functools.partial(packed_completion_logprobs, layout="packed_tree"),
             "tree-dense": functools.partial(packed_completion_logprobs, layout="packed_tree", dense_mask=True)}
    chosen = args.paths.split(",")
    if unknown := sorted(set(chosen) - set(paths)):
        parser.error(f"--paths: unknown {', '.join(unknown)}; expected some of {', '.join(paths)}")
    paths = {name: paths[name] for name in chosen}
    warm = uneven_micro_batch(1, 2, 8, 16, config.vocab_size, seed=99)
    for fn in paths.values():
        timed_step(fn, model, warm)

    print(f"SmolLM2-135M shape, {config.num_hidden_layers} layers, {args.attn}, float32, "
          f"{torch.get_num_threads()} threads; {args.prompts} prompts x {args.group} completions of "
          f"{args.min_len}..{args.max_len} tokens per micro-batch")
    header = f"{'mb':>3} {'path':>7} {'real tok':>9} {'computed':>9} {'extra %':>8} {'fwd+bwd s':>10} {'tok/s':>8}"
    print(header)
    totals = {name: [0, 0.0] for name in paths}
    for seed in range(args.micro_batches):
        mb = uneven_micro_batch(args.prompts, args.group, args.min_len, args.max_len, config.vocab_size, seed)
        real = int(mb.completion_mask.sum())
        prompt_real = int(mb.prompt_mask[mb.prompt_index].sum())
        computed = {
            "padded": mb.prompt_ids.numel() + mb.completion_ids.shape[0] * (mb.completion_ids.shape[1] - 1),
            "copies": prompt_real + real - mb.completion_ids.shape[0],
            "tree": tree_layout(mb).input_ids.shape[1],
        }
        computed["tree-dense"] = computed["tree"]
        start = time.perf_counter()
        tree_layout(mb)
        print(f"    the tree's layout (Python, host): {1000 * (time.perf_counter() - start):.1f} ms")
        results = {}
        for name, fn in paths.items():
            if args.repeats == 0:
                continue
            runs = [timed_step(fn, model, mb) for _ in range(args.repeats)]
            seconds, logp = statistics.median(r[0] for r in runs), runs[-1][1]
            results[name] = logp
            totals[name][0] += real
            totals[name][1] += seconds
            useful = int(mb.prompt_mask.sum()) + real - mb.completion_ids.shape[0]  # prompts once, no padding
            print(f"{seed:>3} {name:>7} {real:>9} {computed[name]:>9} {100 * (1 - useful / computed[name]):>7.1f}% "
                  f"{seconds:>10.2f} {real / seconds:>8.1f}")
        reference = "padded" if "padded" in results else next(iter(results), None)
        for name in results.keys() - {reference}:
            diff = (results[name] - results[reference])[mb.completion_mask.bool()].abs().max().item()
            print(f"    max |logp {name} - {reference}| = {diff:.2e}")
        if args.profile:
            for name, fn in paths.items():
                kinds, others = profile_by_kind(fn, model, mb)
                total = sum(kinds.values())
                shares = ", ".join(f"{k} {v:.2f} s ({100 * v / total:.0f}%)"
                                   for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))
                print(f"    profile {name:>6}: {total:.2f} s self CPU: {shares}")
                print("        largest of other: " + ", ".join(f"{k} {v:.2f} s" for k, v in others))
    if args.repeats == 0:
        return
    for name, (tokens, seconds) in totals.items():
        print(f"all {name:>7}: {tokens} completion tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s")
    for name in totals.keys() - {"padded"} if "padded" in totals else ():
        print(f"{name} / padded speed: {totals['padded'][1] / totals[name][1]:.2f}x")
    for a, b in (("tree", "copies"), ("tree", "tree-dense")):
        if a in totals and b in totals:
            print(f"{a} / {b} speed: {totals[b][1] / totals[a][1]:.2f}x")


if __name__ == "__main__":
    main()
