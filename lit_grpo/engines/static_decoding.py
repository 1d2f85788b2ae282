"""Sampling with a static KV cache and a compiled decode step (transformers' ``generate`` with
``cache_implementation="static"``), for the in-process engine on a GPU.

Why: decoding 64 rows of a 0.4B model with a dynamic cache costs 21-27 ms per token step on an H100, almost all of
it Python and kernel-launch overhead. A cache of fixed shape lets ``torch.compile`` capture the decode step in a
CUDA graph (``mode="reduce-overhead"``), which transformers does itself when the cache is static and the device
is CUDA; measured on that GPU: 64 x 200 tokens in 1.05 s instead of 4.1 s.

What stays the same as the dynamic path: the distribution (``softmax(logits / T)``, nucleus ``top_p``, nothing
else: no top-k, no repetition penalty, no suppressed tokens, whatever the model's own generation config says, see
``sole_generation_config``), the end-of-sequence ids, and reproducibility for a seed. What differs: transformers'
sampler draws from the global generator (seeded here per call inside ``fork_rng``), not the dynamic path's explicit
generator, so the same seed gives another draw from the same distribution; and the prompt is prefilled once per
completion rather than once per prompt (one forward, small next to the decoding). The reported log-probs come from
one teacher-forced forward over the sampled tokens, exactly the quantity the trainer computes.

Precision: this path samples in the engine's own dtype (float32) even under ``bf16-mixed``: with autocast on,
Llama-family models produce float32 keys (RoPE runs in float32) next to bfloat16 values, and transformers' static
cache stores both in one dtype. So the tokens are drawn from the float32 distribution of the engine's weights,
while alpha in the loss is the engine's re-scoring in the trainer's precision (or pi_k's own log-probs at a synced
step): the same small trainer-sampler gap a vLLM sampler has, and none in the ratio itself. The dynamic path
samples under the trainer's autocast.

Shapes are padded to a few values (prompt width rounded up to ``width_multiple``) so that a new batch recompiles
only when its prompts are longer than any before.
"""

from __future__ import annotations

import copy
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lit_grpo.core.scoring import positions_from_mask
from lit_grpo.math.logprobs import selective_log_softmax


def padded_width(longest: int, multiple: int) -> int:
    """The prompt width a batch is left-padded to: ``longest`` rounded up to a multiple of ``multiple``."""
    if longest < 1 or multiple < 1:
        raise ValueError(f"longest ({longest}) and multiple ({multiple}) must be >= 1")
    return math.ceil(longest / multiple) * multiple


def sampling_config(max_new_tokens: int, temperature: float, top_p: float, eos_token_ids: list[int],
                    pad_token_id: int, compile: bool) -> object:
    """A ``GenerationConfig`` that samples from exactly ``softmax(logits / temperature)`` (nucleus ``top_p``):
    the logits processors whose global default is not a no-op are set to their no-op value. The model's own
    generation config (Qwen2.5-Instruct's ships top_k 20 and a repetition penalty) is kept out of the call by
    ``sole_generation_config``, not by this list: fields left ``None`` here would otherwise be filled from it."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=True, temperature=float(temperature), top_p=float(top_p), top_k=0, min_p=None, typical_p=1.0,
        epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
        max_new_tokens=int(max_new_tokens), min_new_tokens=0, eos_token_id=list(eos_token_ids),
        pad_token_id=int(pad_token_id), cache_implementation="static", disable_compile=not compile,
        num_beams=1, num_return_sequences=1, output_scores=False, return_dict_in_generate=False,
    )


#: held while a model's generation config is swapped for one ``generate`` call (``sole_generation_config``): two
#: overlapping calls on one model would otherwise restore each other's config and leave the sampling one behind
_SWAP_LOCK = threading.Lock()


@contextmanager
def sole_generation_config(model: nn.Module, config: object) -> Iterator[None]:
    """For one ``generate`` call, ``model.generation_config`` is a copy of ``config``.

    Why: ``generate`` fills every field that the config it is given leaves ``None`` from ``model.generation_config``
    (``suppress_tokens``, ``bad_words_ids``, ``min_p``, ``sequence_bias``, ``forced_eos_token_id`` ... and any
    custom entry), and several fields have no value that means "off" other than ``None``. Any of them changes the
    distribution the tokens are drawn from, while the log-probs reported for alpha are the plain
    ``softmax(logits / T)``. With the model's config replaced by the sampling config itself, that merge adds
    nothing, whatever the model's config holds; what is left are transformers' global defaults, which are no-ops
    where ``sampling_config`` does not set a field. The model's own config is put back afterwards."""
    with _SWAP_LOCK:
        own = model.generation_config
        model.generation_config = copy.deepcopy(config)
        try:
            yield
        finally:
            model.generation_config = own


def left_pad_to(rows: list[list[int]], width: int, pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[r, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def cut_at_eos(tokens: torch.Tensor, eos_token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the completion length (through the first end-of-sequence token, or all of it) and whether it
    ended there. ``tokens`` ``[B, T]``; positions after the first EOS are padding."""
    is_eos = torch.isin(tokens, torch.tensor(eos_token_ids, device=tokens.device))
    ended = is_eos.any(dim=1)
    first = torch.where(ended, is_eos.int().argmax(dim=1), torch.full_like(ended, tokens.shape[1], dtype=torch.long))
    lengths = torch.where(ended, first + 1, first)
    return lengths, ended


@torch.no_grad()
def teacher_forced_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, completion: torch.Tensor,
                            completion_mask: torch.Tensor, temperature: float, rows_per_pass: int = 16) -> torch.Tensor:
    """``log softmax(logits / T)`` of each completion token after its prompt, ``[B, C]``, in chunks of rows."""
    out = []
    for start in range(0, ids.shape[0], rows_per_pass):
        part = slice(start, start + rows_per_pass)
        full_ids = torch.cat([ids[part], completion[part, :-1]], dim=1)
        full_mask = torch.cat([mask[part], completion_mask[part, :-1]], dim=1)
        logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions_from_mask(full_mask),
                       use_cache=False, logits_to_keep=completion.shape[1]).logits
        out.append(selective_log_softmax(logits, completion[part], temperature))
    return torch.cat(out, dim=0)


class StaticDecoder:
    """``generate`` with a static cache (and, on CUDA, a compiled decode step) for one model; remembers which
    shapes it has compiled for, to report the compile time once per shape."""

    def __init__(self, compile: bool, width_multiple: int = 64) -> None:
        if width_multiple < 1:
            raise ValueError(f"width_multiple must be >= 1, got {width_multiple}")
        self.compile = bool(compile)
        self.width_multiple = int(width_multiple)
        self.seen_shapes: dict[tuple[int, int, int], float] = {}
        #: seconds the first call of the newest shape took (compilation included), for the log
        self.last_first_call_seconds: float | None = None

    def __call__(self, model: nn.Module, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, eos_token_ids: list[int], pad_token_id: int
                 ) -> tuple[list[list[int]], list[list[float]], list[bool]]:
        device = next(model.parameters()).device
        rows = [p for p in prompts for _ in range(n)]
        width = padded_width(max(len(p) for p in prompts), self.width_multiple)
        ids, mask = left_pad_to(rows, width, pad_token_id, device)
        config = sampling_config(max_new_tokens, temperature, top_p, eos_token_ids, pad_token_id,
                                 self.compile and device.type == "cuda")
        shape = (len(rows), width, max_new_tokens)
        start = time.perf_counter()
        # float32, outside any autocast: under autocast Llama-family keys leave RoPE in float32 while values stay
        # 16-bit, and transformers' static cache holds one dtype for both (see the module docstring)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                torch.autocast(device.type, enabled=False):
            torch.manual_seed(int(seed) % 2**63)
            with sole_generation_config(model, config):
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        completion = out[:, width:]
        if completion.shape[1] == 0:
            raise RuntimeError("generate returned no new tokens")
        lengths, ended = cut_at_eos(completion, eos_token_ids)
        positions = torch.arange(completion.shape[1], device=device)
        completion_mask = (positions.unsqueeze(0) < lengths.unsqueeze(1)).long()
        completion = torch.where(completion_mask.bool(), completion, torch.full_like(completion, pad_token_id))
        with torch.autocast(device.type, enabled=False):  # the distribution the tokens were drawn from
            logps = teacher_forced_logprobs(model, ids, mask, completion, completion_mask, temperature)
        if shape not in self.seen_shapes:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            self.seen_shapes[shape] = time.perf_counter() - start
            self.last_first_call_seconds = self.seen_shapes[shape]
        else:
            self.last_first_call_seconds = None
        token_rows, logp_rows = completion.tolist(), logps.tolist()
        length_list, ended_list = lengths.tolist(), ended.tolist()
        tokens = [token_rows[r][: length_list[r]] for r in range(len(rows))]
        logprobs = [logp_rows[r][: length_list[r]] for r in range(len(rows))]
        return tokens, logprobs, ended_list
