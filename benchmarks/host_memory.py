"""What a long CPU update's process holds against what is alive: glibc's dynamic mmap threshold against the fixed
one of ``HostMemory`` (``lit_grpo.core.host_memory``).

    OMP_NUM_THREADS=1 python benchmarks/host_memory.py --mmap-threshold-kb 1024 [--shape smol135] [--tokens 2048]
    OMP_NUM_THREADS=1 python benchmarks/host_memory.py --mmap-threshold-kb glibc

A random-init model of the shape (``make_random_model.py``'s shapes, float32, sdpa), with an Adam optimizer; two
updates (the second with Adam's state alive, as every step after the first) of one row of a 64-token prompt and
``--tokens`` completion tokens, through the trainer's own scoring (``completion_logprobs``: the chunked lm head,
activation checkpointing unless ``--no-checkpointing``). Prints one JSON line: the process's peak resident set
(``VmHWM``), the peak of tensor bytes alive at once (``--live``: counted at the dispatcher, slower), and the
seconds of each update. Time it against the other setting with a timer that pairs runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mmap-threshold-kb", default="1024", help="KiB, or 'glibc' for its dynamic default")
    parser.add_argument("--shape", default="smol135")
    parser.add_argument("--tokens", type=int, default=2048, help="completion tokens of the row")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--live", action="store_true", help="also count the peak of tensor bytes alive at once")
    args = parser.parse_args(argv)
    if args.mmap_threshold_kb != "glibc" and not args.mmap_threshold_kb.isdigit():
        parser.error(f"--mmap-threshold-kb must be a number of KiB or 'glibc', got {args.mmap_threshold_kb!r}")

    import torch
    from make_random_model import SHAPES
    from step_time import peak_rss_since_reset_mib  # VmHWM: the process's peak, never reset here
    from transformers import AutoModelForCausalLM

    from lit_grpo.core.batch import left_pad, micro_batch_views
    from lit_grpo.core.host_memory import fix_mmap_threshold
    from lit_grpo.core.peak_memory import PeakLiveBytes
    from lit_grpo.core.scoring import completion_logprobs
    from lit_grpo.models.loading import checkpointing_call

    why_not = None if args.mmap_threshold_kb == "glibc" else fix_mmap_threshold(int(args.mmap_threshold_kb))
    if why_not is not None:
        raise SystemExit(f"--mmap-threshold-kb {args.mmap_threshold_kb}: not applied, {why_not}")
    torch.manual_seed(0)
    config = SHAPES[args.shape]()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).float().train()
    if not args.no_checkpointing:
        checkpointing_call(model, "enable")()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(0)
    prompt_ids, prompt_mask = left_pad([torch.randint(0, 1000, (64,), generator=gen).tolist()], 0, torch.device("cpu"))
    completion = torch.randint(0, 1000, (1, args.tokens), generator=gen)
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, torch.zeros(1, dtype=torch.long), completion,
                              torch.ones_like(completion), 1)
    seconds, live_peak = [], 0
    for _ in range(2):
        start = time.perf_counter()
        meter = PeakLiveBytes() if args.live else None
        with meter if meter is not None else torch.enable_grad():
            logp, _ = completion_logprobs(model, mb, temperature=1.0)
            (-logp.mean()).backward()
            del logp
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        live_peak = max(live_peak, meter.peak if meter is not None else 0)
    result = {"mmap_threshold_kb": args.mmap_threshold_kb, "shape": args.shape, "tokens": args.tokens,
              "checkpointing": not args.no_checkpointing, "peak_rss_mib": round(peak_rss_since_reset_mib(), 1),
              "live_peak_mib": round(live_peak / 2**20, 1) if args.live else None,
              "update_seconds": [round(s, 2) for s in seconds], "threads": torch.get_num_threads()}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
