r"""Rollout generation on vLLM against the in-process transformers engine, on the demo shape (CPU by default).

The job: SmolLM2-135M-Instruct in float32, 2 GSM8K train prompts (chat-formatted with the default system prompt)
x n = 8 completions, up to 64 new tokens at temperature 1.0; the same prompts, seeds and stop tokens for every
engine. For each engine it records:

* ``startup_s``: building the engine (for vLLM: loading, the KV cache, and its compiled graphs unless eager);
* ``generate_s``: each ``generate`` call (the first one, with its warm-up, is reported apart);
* ``tokens_per_s``: sampled tokens over the median call;
* ``logprob_gap``: mean |engine log-prob - teacher-forced log-prob| of the sampled tokens, the teacher-forced ones
  computed by one plain forward pass of the same weights in float32 (0 for the transformers engine up to
  batching: it re-scores nothing here, so this is its sampler's own gap).

Engines: ``transformers`` (``TransformersEngine``, dynamic decoding on a CPU), ``vllm`` (``VLLMEngine``, vLLM's
compiled graphs), ``vllm-eager`` (``enforce_eager``: start-up without compilation). vLLM needs the vLLM tier's
environment (README, Install: CPU with vLLM).

    python benchmarks/vllm_generation.py                          # all three, 3 calls each
    python benchmarks/vllm_generation.py --engines vllm transformers --calls 5 --threads 2

Each engine runs in a subprocess of its own (``--worker``), so vLLM's thread binding and memory do not reach the
next one. Results go to ``benchmarks/results/vllm_generation.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from worker_runs import report, run_worker

ENGINES = ("transformers", "vllm", "vllm-eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="lit_grpo alias or local model directory")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=3, help="generate calls after the first (warm-up) one")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", default="benchmarks/results/vllm_generation.json")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def model_dir(name: str) -> Path:
    """A model directory vLLM can load: the alias's converted copy in lit_grpo's cache, or the directory given."""
    from lit_grpo.models.loading import ALIASES, cache_dir, load_model_and_tokenizer

    if name in ALIASES:
        load_model_and_tokenizer(name, "float32")  # writes the cache on first use
        return cache_dir() / name
    return Path(name)


def job(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]]]:
    from lit_grpo.data.gsm8k import load_gsm8k
    from lit_grpo.data.prompts import prompt_ids
    from lit_grpo.models.loading import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(model_dir(args.model)), "float32")
    rows = load_gsm8k("bundled", split="train")[: args.prompts]
    return model.eval(), tokenizer, [prompt_ids(tokenizer, row["question"]) for row in rows]


def build_engine(name: str, args: argparse.Namespace, model: Any, tokenizer: Any) -> Any:
    from lit_grpo.models.loading import eos_token_ids

    if name == "transformers":
        from lit_grpo.engines.transformers_engine import TransformersEngine

        return TransformersEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
    from lit_grpo.engines.vllm_engine import VLLMEngine

    return VLLMEngine(str(model_dir(args.model)), tokenizer=tokenizer, dtype="float32", max_model_len=1024,
                      enforce_eager=name == "vllm-eager")


def logprob_gap(model: Any, prompts: list[list[int]], groups: list[list[Any]]) -> float:
    import torch

    gaps = []
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            for completion in group:
                ids = torch.tensor([prompt + completion.token_ids])
                logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
                expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
                gaps.append((torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs())
    return float(torch.cat(gaps).mean())


def worker(args: argparse.Namespace) -> None:
    import torch

    from lit_grpo.engines.base import SamplingConfig

    torch.set_num_threads(args.threads)
    model, tokenizer, prompts = job(args)
    start = time.perf_counter()
    engine = build_engine(args.worker, args, model, tokenizer)
    startup = time.perf_counter() - start
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=1.0)
    seconds, tokens = [], []
    for call in range(args.calls + 1):
        start = time.perf_counter()
        groups = engine.generate(prompts, args.generations, sampling, seed=call)
        seconds.append(time.perf_counter() - start)
        tokens.append(sum(len(c.token_ids) for g in groups for c in g))
    median = statistics.median(seconds[1:])
    report({"engine": args.worker, "startup_s": startup, "first_generate_s": seconds[0],
            "generate_s": seconds[1:], "median_generate_s": median,
            "tokens": tokens[1:], "tokens_per_s": statistics.median(tokens[1:]) / median,
            "logprob_gap": logprob_gap(model, prompts, groups), "threads": args.threads})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    results = []
    for name in args.engines:
        cmd = [__file__, "--worker", name, "--model", args.model, "--prompts", str(args.prompts),
               "--generations", str(args.generations), "--max-new-tokens", str(args.max_new_tokens),
               "--calls", str(args.calls), "--threads", str(args.threads)]
        results.append(run_worker(name, cmd, env))
    print(f"{'engine':<14}{'start-up s':>12}{'1st call s':>12}{'median s':>10}{'tokens/s':>10}{'log-prob gap':>14}")
    for r in results:
        print(f"{r['engine']:<14}{r['startup_s']:>12.1f}{r['first_generate_s']:>12.2f}{r['median_generate_s']:>10.2f}"
              f"{r['tokens_per_s']:>10.0f}{r['logprob_gap']:>14.2e}")
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"config": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
