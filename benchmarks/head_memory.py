"""Memory of the update's log-probs per completion token, with the full logits and with the chunked head
(``model.head_chunk_mb``, ``lit_grpo.core.chunked_head``), at Qwen2.5's vocabulary.

    OMP_NUM_THREADS=1 python benchmarks/head_memory.py [--tokens 512 4096] [--layouts padded tree] [--vocab 151936]

The model is a 2-layer body of hidden size 64 built from a ``Qwen2Config`` (sdpa, float32, random weights, nothing
downloaded) with the vocabulary of Qwen2.5, so the head dominates as it does in a real run. The micro-batch is one
64-token prompt and 8 completions of ``tokens / 8`` tokens each (no padding), scored ``padded`` (one prompt pass,
its KV cache shared by the completions) or as a prefix ``tree`` (one packed row, ``lit_grpo.core.prefix_tree``),
with the entropy statistic on (``train/entropy``), then ``backward`` of the mean log-prob. Measured: the peak bytes
of tensor storage alive at once that torch's operators allocated during that forward and backward
(``lit_grpo.core.peak_memory.PeakLiveBytes``, counted at the dispatcher, so allocator caching plays no part: the
weights and the inputs, made before, are not counted; the weights' gradients are), and the peak of those whose last
dimension is the vocabulary (logits, their float32 copies, their gradients). Per completion token: peak / tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from lit_grpo.core.peak_memory import PeakLiveBytes  # noqa: E402

QWEN25_VOCAB = 151_936


def qwen_body(vocab: int = QWEN25_VOCAB, tied: bool = False, seed: int = 0) -> torch.nn.Module:
    """A 2-layer Qwen2 of hidden size 64 with ``vocab`` tokens (sdpa, float32, train mode, random weights)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         tie_word_embeddings=tied, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config).float().train()


def group_micro_batch(tokens: int, vocab: int, rows: int = 8, prompt_len: int = 64, seed: int = 0):  # noqa: ANN201
    """One prompt and ``rows`` completions of ``tokens // rows`` tokens each, as ``RolloutBatch`` lays them out."""
    from lit_grpo.core.batch import left_pad, micro_batch_views

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
    prompt_ids, prompt_mask = left_pad([prompt], pad_id=0, device=torch.device("cpu"))
    completion_ids = torch.randint(3, vocab, (rows, tokens // rows), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, torch.zeros(rows, dtype=torch.long), completion_ids,
                              completion_mask, rows)
    return mb


def measure(model: torch.nn.Module, mb: object, layout: str, head_chunk_mb: float | None,
            vocab: int) -> PeakLiveBytes:
    """Peak bytes of one forward (log-probs and the entropy statistic) and backward of the mean log-prob."""
    from lit_grpo.core.packing import packed_completion_logprobs
    from lit_grpo.core.scoring import completion_logprobs

    model.zero_grad(set_to_none=True)
    with PeakLiveBytes(vocab) as meter:
        if layout == "tree":
            logp, _ = packed_completion_logprobs(model, mb, 1.0, with_entropy=True, layout="packed_tree",
                                                 head_chunk_mb=head_chunk_mb)
        else:
            logp, _ = completion_logprobs(model, mb, 1.0, with_entropy=True, head_chunk_mb=head_chunk_mb)
        logp.mean().backward()
        del logp
    return meter


def main(argv: list[str] | None = None) -> int:
    from lit_grpo.core.chunked_head import DEFAULT_HEAD_CHUNK_MB

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--layouts", nargs="+", default=["padded", "tree"], choices=["padded", "tree"])
    parser.add_argument("--vocab", type=int, default=QWEN25_VOCAB)
    parser.add_argument("--head-chunk-mb", type=float, default=DEFAULT_HEAD_CHUNK_MB)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model = qwen_body(args.vocab)
    rows = []
    print(f"V = {args.vocab:,}, chunk budget {args.head_chunk_mb} MiB")
    print(f"{'layout':<7} {'tokens':>6} {'head':<8} {'peak MB':>9} {'MB/token':>9} {'vocab-sized peak MB':>20}")
    for layout in args.layouts:
        for tokens in args.tokens:
            mb = group_micro_batch(tokens, args.vocab)
            for name, budget in (("full", None), ("chunked", args.head_chunk_mb)):
                meter = measure(model, mb, layout, budget, args.vocab)
                row = dict(layout=layout, tokens=tokens, head=name, peak_bytes=meter.peak,
                           vocab_peak_bytes=meter.vocab_peak, mb_per_token=meter.peak / tokens / 1e6)
                rows.append(row)
                print(f"{layout:<7} {tokens:>6} {name:<8} {meter.peak / 1e6:>9.1f} {row['mb_per_token']:>9.3f} "
                      f"{meter.vocab_peak / 1e6:>20.1f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
