"""What the in-process engine's decoding holds: the resident memory a rollout of long completions adds, against the
KV cache the memory check states (``lit_grpo.training.memory_check.kv_cache_bytes``).

    OMP_NUM_THREADS=2 python benchmarks/decode_memory.py --shape smol135 --rows 16 --max-new-tokens 4096
    OMP_NUM_THREADS=2 python benchmarks/decode_memory.py --shape smol135 --rows 16 --max-new-tokens 1024 \\
        --max-num-seqs 16 8 4

Each setting runs in a subprocess of its own: a random-init model of the shape (``make_random_model.py``: random
weights almost never sample EOS, so every sequence decodes its whole budget), float32, ``--prompts`` prompts of
``--prompt-tokens`` random tokens x ``rows / prompts`` completions each, sampled by ``TransformersEngine``'s dynamic
path (the KV cache preallocated per sequence for prompt plus budget, finished sequences' slots taken by waiting
ones under ``max_num_seqs``). The process's peak resident set is reset (``/proc/self/clear_refs``) after the model
is built, so *added* is the rollout's own high-water mark above what the process held before it. *KV cache* is the
formula at the sequences decoding at once and every position they reach (prompt and budget); *check's bound* is
the one the fit's check compares with the memory available (the budget's positions only, prompts not counted).
Prints one JSON line per setting and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

GIB = 1024**3


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(args: argparse.Namespace) -> dict:
    import torch
    from make_random_model import SHAPES
    from transformers import AutoModelForCausalLM

    from lit_grpo.engines.base import SamplingConfig
    from lit_grpo.engines.transformers_engine import TransformersEngine
    from lit_grpo.training.memory_check import kv_cache_bytes

    torch.manual_seed(0)
    config = SHAPES[args.shape]()
    model = AutoModelForCausalLM.from_config(config).float().eval()
    engine = TransformersEngine(model, [config.eos_token_id], config.pad_token_id, copy_weights=False,
                                decode="dynamic", max_num_seqs=args.max_num_seqs)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, config.vocab_size, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.prompts)]
    n = args.rows // args.prompts
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak resident set restarts from the current one
    before = status_kib("VmRSS")
    began = time.perf_counter()
    groups = engine.generate(prompts, n, SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0), seed=0)
    seconds = time.perf_counter() - began
    added = (status_kib("VmHWM") - before) * 1024
    lengths = [len(c.token_ids) for group in groups for c in group]
    at_once = args.rows if args.max_num_seqs is None else min(args.rows, args.max_num_seqs)
    cache = kv_cache_bytes(config, at_once, args.prompt_tokens + args.max_new_tokens, 4)
    bound = kv_cache_bytes(config, at_once, args.max_new_tokens, 4)
    return {"shape": args.shape, "rows": args.rows, "max_new_tokens": args.max_new_tokens,
            "max_num_seqs": args.max_num_seqs, "prompt_tokens": args.prompt_tokens, "added_bytes": added,
            "kv_cache_bytes": cache, "check_bound_bytes": bound, "seconds": seconds,
            "tokens": sum(lengths), "min_length": min(lengths), "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smol135", help="make_random_model.py's shape")
    parser.add_argument("--rows", type=int, default=16, help="sequences in the request")
    parser.add_argument("--prompts", type=int, default=2, help="prompts (rows / prompts completions each)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, nargs="+", default=[4096])
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[0], help="0: every row at once")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rows % args.prompts:
        parser.error(f"--rows {args.rows} must be a multiple of --prompts {args.prompts}")
    if args.worker:
        args.max_new_tokens = args.max_new_tokens[0]
        args.max_num_seqs = args.max_num_seqs[0] or None
        print(json.dumps(worker(args)), flush=True)
        return
    results = []
    for budget in args.max_new_tokens:
        for cap in args.max_num_seqs:
            command = [sys.executable, __file__, "--worker", "--shape", args.shape, "--rows", str(args.rows),
                       "--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens),
                       "--max-new-tokens", str(budget), "--max-num-seqs", str(cap)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            results.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    print("\n| shape | sequences | at once | new tokens | added GiB | KV cache GiB | check's bound GiB | seconds | "
          "tokens/s |\n|---|---|---|---|---|---|---|---|---|")
    for r in results:
        at_once = r["rows"] if r["max_num_seqs"] is None else min(r["rows"], r["max_num_seqs"])
        print(f"| {r['shape']} | {r['rows']} | {at_once} | {r['max_new_tokens']:,} | {r['added_bytes'] / GIB:.2f} | "
              f"{r['kv_cache_bytes'] / GIB:.2f} | {r['check_bound_bytes'] / GIB:.2f} | {r['seconds']:.0f} | "
              f"{r['tokens'] / r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
