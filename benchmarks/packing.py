"""Forward + backward of the update's log-probs on uneven lengths: padded micro-batches against one packed row.

    OMP_NUM_THREADS=2 python benchmarks/packing.py [--prompts 2] [--group 4] [--min-len 16] [--max-len 512]

A random-init model of SmolLM2-135M's shape (``make_random_model.smol135_config``, built in memory, nothing saved)
scores the same micro-batches two ways, side by side in one run:

* ``padded``: ``lit_grpo.core.scoring.completion_logprobs``, today's path: one forward over the distinct prompts
  (left-padded), their KV cache shared by the completions, then the completions right-padded to the longest;
* ``packed``: ``lit_grpo.core.packing.packed_completion_logprobs``: every row's real tokens in one row, no padding,
  each completion with its own copy of the prompt.

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
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=1, help="timed micro-batches per path (seeds 0, 1, ...)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's 30, for a quick run")
    parser.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, eager)")
    args = parser.parse_args(argv)

    import torch
    from make_random_model import smol135_config
    from transformers import AutoModelForCausalLM

    from lit_grpo.core.packing import packed_completion_logprobs, packing_supported
    from lit_grpo.core.scoring import completion_logprobs

    config = smol135_config()
    if args.layers is not None:
        config.num_hidden_layers = args.layers
    config._attn_implementation = args.attn
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    reason = packing_supported(model)
    if reason is not None:
        raise SystemExit(reason)
    paths = {"padded": completion_logprobs, "packed": packed_completion_logprobs}
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
            "packed": prompt_real + real - mb.completion_ids.shape[0],
        }
        results = {}
        for name, fn in paths.items():
            seconds, logp = timed_step(fn, model, mb)
            results[name] = logp
            totals[name][0] += real
            totals[name][1] += seconds
            useful = int(mb.prompt_mask.sum()) + real - mb.completion_ids.shape[0]  # prompts once, no padding
            print(f"{seed:>3} {name:>7} {real:>9} {computed[name]:>9} {100 * (1 - useful / computed[name]):>7.1f}% "
                  f"{seconds:>10.2f} {real / seconds:>8.1f}")
        diff = (results["packed"] - results["padded"])[mb.completion_mask.bool()].abs().max().item()
        print(f"    max |logp packed - padded| = {diff:.2e}")
    speedup = (totals["padded"][1]) / totals["packed"][1]
    for name, (tokens, seconds) in totals.items():
        print(f"all {name:>7}: {tokens} completion tokens in {seconds:.2f} s, {tokens / seconds:.1f} tok/s")
    print(f"packed / padded speed: {speedup:.2f}x")


if __name__ == "__main__":
    main()
