"""Generation on uneven lengths: the in-process engine's dynamic decoding that frees finished slots, against the
loop that kept every row until the longest completion ended (copied below), in one run on the same machine.

Lengths: a forward hook sets the EOS probability of the k-th completion token to ``1 / (max_len - k + 1)`` for
``k >= min_len`` (0 before), so the lengths are uniform on ``[min_len, max_len]`` whatever the model's weights are;
the prompts all have ``prompt_len`` random tokens. The model is random-init, of the tiny test model's shape or of
SmolLM2-135M's (``--shape smollm2``), in float32.

    python benchmarks/continuous_batching.py --shape tiny --prompts 16 --n 4
    python benchmarks/continuous_batching.py --shape smollm2 --prompts 8 --n 4 --threads 2

Prints one table: tokens per second of each way, its rebuild fraction and slot cap, and the speed-up over the old
loop. Every way samples the same distribution; the new ones share their random stream, the old one has its own.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import lit_grpo.engines.continuous_batching as cb
from lit_grpo.core.batch import left_pad
from lit_grpo.core.cache_argument import cache_kwarg, output_cache
from lit_grpo.core.scoring import positions_from_mask
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.kv_cache import preallocate
from lit_grpo.engines.transformers_engine import TransformersEngine, top_p_filter
from lit_grpo.math.logprobs import selective_log_softmax

SHAPES = {
    "tiny": dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "smollm2": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
}
EOS, PAD = 2, 0


def eos_hazard(k: torch.Tensor, min_len: int, max_len: int) -> torch.Tensor:
    """The EOS probability of the ``k``-th completion token that makes lengths uniform on [min_len, max_len]: the
    hazard of a discrete uniform, 1 / (tokens left in the range), 0 before ``min_len``."""
    left = (max_len - k + 1).clamp(min=1).double()
    return torch.where(k >= min_len, 1.0 / left, torch.zeros_like(left))


def uneven_lengths_hook(prompt_len: int, min_len: int, max_len: int) -> Callable:
    """A forward hook (with kwargs) that overwrites the last position's EOS logit so that its probability is
    :func:`eos_hazard` of the token about to be sampled (read from the position ids: all prompts are
    ``prompt_len`` long)."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, out: object) -> object:
        logits = out.logits[:, -1]
        k = kwargs["position_ids"][:, -1] - prompt_len + 2
        h = eos_hazard(k, min_len, max_len).clamp(max=1 - 1e-12)
        others = logits.double().clone()
        others[:, EOS] = float("-inf")
        rest = others.logsumexp(-1)
        logits[:, EOS] = torch.where(h > 0, rest + torch.log(h / (1 - h)), torch.full_like(rest, -1e4)).to(logits.dtype)
        return out
    return hook


@torch.inference_mode()
def old_generate(model: torch.nn.Module, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                 seed: int) -> int:
    """The dynamic decoding loop before finished rows left the batch (with the preallocated cache); returns the
    number of completion tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids, mask = left_pad(prompts, PAD, "cpu")
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=True,
                logits_to_keep=1)
    expand = torch.arange(len(prompts)).repeat_interleave(n)
    cache = output_cache(out)
    cache.batch_select_indices(expand)
    preallocate(cache, sampling.max_new_tokens)
    logits, attention = out.logits[:, -1][expand], mask[expand]
    finished = torch.zeros(expand.numel(), dtype=torch.bool)
    lengths = torch.zeros(expand.numel(), dtype=torch.long)
    for step in range(sampling.max_new_tokens):
        scaled = logits.float() / sampling.temperature
        probs = torch.softmax(top_p_filter(scaled, sampling.top_p), dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        sampled = torch.where(finished, torch.full_like(sampled, PAD), sampled)
        selective_log_softmax(scaled, sampled)
        lengths += (~finished).long()
        finished = finished | (sampled == EOS)
        if step + 1 == sampling.max_new_tokens or bool(finished.all()):
            break
        attention = torch.cat([attention, (~finished).long().unsqueeze(-1)], dim=1)
        logits = model(input_ids=sampled.unsqueeze(-1), attention_mask=attention,
                       position_ids=(attention.sum(-1, keepdim=True) - 1).clamp(min=0), use_cache=True,
                       **{cache_kwarg(model): cache}).logits[:, -1]
    return int(lengths.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.0, 0.125, 0.25, 0.5])
    parser.add_argument("--caps", type=int, nargs="*", default=None,
                        help="max_num_seqs values to time at the default fraction (default: rows / 2)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=args.prompt_len + args.max_len + 8,
                                         **SHAPES[args.shape])).eval()
    model.register_forward_hook(uneven_lengths_hook(args.prompt_len, args.min_len, args.max_len), with_kwargs=True)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(3, vocab, (args.prompts, args.prompt_len)).tolist()
    sampling = SamplingConfig(max_new_tokens=args.max_len, temperature=1.0)
    rows = args.prompts * args.n
    caps = args.caps if args.caps is not None else [max(1, rows // 2)]

    def timed(run: Callable[[], int]) -> tuple[int, float]:
        start = time.perf_counter()
        tokens = run()
        return tokens, time.perf_counter() - start

    def new(cap: int | None) -> Callable[[], int]:
        engine = TransformersEngine(model, [EOS], PAD, copy_weights=False, decode="dynamic", max_num_seqs=cap)
        return lambda: sum(len(c.token_ids) for g in engine.generate(prompts, args.n, sampling, seed=0) for c in g)

    results = [("old loop (every row to the end)", "-", "-", *timed(lambda: old_generate(model, prompts, args.n,
                                                                                         sampling, seed=0)))]
    default = cb.REBUILD_FRACTION
    for fraction in args.fractions:
        cb.REBUILD_FRACTION = fraction
        results.append(("finished rows leave", f"{fraction:g}", "-", *timed(new(None))))
    cb.REBUILD_FRACTION = default
    for cap in caps:
        results.append(("slot cap (continuous batching)", f"{default:g}", str(cap), *timed(new(cap))))
    base = results[0][3] / results[0][4]
    print(f"{args.shape} random-init, {args.prompts} prompts x {args.n} = {rows} rows, prompt {args.prompt_len} "
          f"tokens, completions uniform on [{args.min_len}, {args.max_len}], {args.threads} thread(s)")
    print(f"{'way':34} {'fraction':>8} {'cap':>5} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'speed-up':>8}")
    for name, fraction, cap, tokens, seconds in results:
        print(f"{name:34} {fraction:>8} {cap:>5} {tokens:>7} {seconds:>8.2f} {tokens / seconds:>9.1f} "
              f"{tokens / seconds / base:>7.2f}x")


if __name__ == "__main__":
    main()
