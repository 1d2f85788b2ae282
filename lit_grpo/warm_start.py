"""A small policy for the synthetic arithmetic tasks: a ~1M-parameter Llama with the character tokenizer, given a
short, deliberately *noisy* supervised warm-start so that GRPO has something to improve.

Why noisy. A policy trained to the end on correct solutions is already right, and one that never saw the task
is never right; either way every group of G samples gets the same reward and GRPO has no signal. The warm-start
therefore trains on solutions of which a fraction ``slip_rate`` carry one wrong digit in one step (the later
steps carry the error on, as a solver who slipped would). The slip is drawn afresh every time an example is
used, so the model learns a *distribution* over solutions: the right procedure as the single most likely
answer, but with much of its probability spread over near-misses. Sampled at temperature 1 it is right about
``1 - slip_rate`` of the time; this is the situation of a pretrained LLM on a math benchmark (the right answer
is within reach, Pass@k >> Pass@1), and GRPO's job is the same: move probability mass onto the completions the
verifier accepts.

The warm-started weights are a pure function of :class:`WarmStartConfig` (seeded data, noise and init; one
thread), built on first use and cached under ``$LIT_GRPO_CACHE`` (default ``~/.cache/lit_grpo``), keyed by a
hash of the config, so every run reuses them. Model alias: ``arith-tiny-sft`` (``lit_grpo.models``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_grpo.data.prompts import prompt_ids
from lit_grpo.data.synthetic import Column, Problem, generate_problems, worked_answer

#: bump when the training recipe changes in a way the config does not capture, to invalidate old caches
RECIPE_VERSION = 1


@dataclass(frozen=True)
class WarmStartConfig:
    """Architecture and supervised warm-start of the small arithmetic policy.

    ``slip_rate`` is the fraction of training solutions with one wrong digit; it sets where GRPO starts
    (held-out Pass@1 at temperature 1 is about ``1 - slip_rate`` once the procedure is learned).
    """

    task: str = "add_2digit"
    data_seed: int = 0
    seed: int = 0
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-2
    warmup_steps: int = 50
    slip_rate: float = 0.7
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4

    def key(self) -> str:
        payload = json.dumps({"recipe": RECIPE_VERSION, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


ARITH_TINY_SFT = WarmStartConfig()


def build_model(config: WarmStartConfig, vocab_size: int) -> LlamaForCausalLM:
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return LlamaForCausalLM(llama)


def slipped(problem: Problem, rng: random.Random) -> list[Column]:
    """The worked columns with one slip: one column's written sum off by 1 to 3 (kept within 0..19); the later
    columns carry on from the wrong sum, so the final answer is wrong and consistent with the steps."""
    columns = problem.columns()
    i = rng.randrange(len(columns))
    right = columns[i].total
    wrong = [t for t in range(right - 3, right + 4) if t != right and 0 <= t <= 19]
    return problem.columns({i: rng.choice(wrong)})


def _batch(examples: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask and labels (-100 on prompt and padding: loss on the answer only)."""
    width = max(len(p) + len(a) for p, a in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (p, a) in enumerate(examples):
        n = len(p) + len(a)
        ids[row, :n] = torch.tensor(p + a)
        mask[row, :n] = 1
        labels[row, len(p):n] = torch.tensor(a)
    return ids, mask, labels


def train_warm_start(config: WarmStartConfig = ARITH_TINY_SFT, log: Callable[[str], None] | None = print,
                     log_every: int = 100) -> tuple[LlamaForCausalLM, object]:
    """SFT of a fresh model on noisy worked solutions of the task's *train* split (the test split is never
    seen). Prompts are those GRPO and Pass@k build: the chat template with no system prompt."""
    from lit_grpo.models import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = build_model(config, len(tokenizer))
    problems = generate_problems(config.task, config.data_seed)["train"]
    prompts = [prompt_ids(tokenizer, p.question, None) for p in problems]
    eos = tokenizer.eos_token_id
    rng = random.Random(f"warm_start:{config.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    model.train()
    start = time.perf_counter()
    for step in range(config.steps):
        examples = []
        for _ in range(config.batch_size):
            i = rng.randrange(len(problems))
            steps = slipped(problems[i], rng) if rng.random() < config.slip_rate else problems[i].columns()
            answer = list(tokenizer(worked_answer(steps), add_special_tokens=False)["input_ids"]) + [eos]
            examples.append((prompts[i], answer))
        ids, mask, labels = _batch(examples, tokenizer.pad_token_id)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if log is not None and (step + 1) % log_every == 0:
            log(f"warm-start step {step + 1}/{config.steps} loss {loss.item():.4f} "
                f"({time.perf_counter() - start:.0f} s)")
    model.eval()
    return model, tokenizer


def _cache_root() -> Path:
    return Path(os.environ.get("LIT_GRPO_CACHE", Path.home() / ".cache" / "lit_grpo"))


def cached_dir(config: WarmStartConfig) -> Path:
    return _cache_root() / f"arith-tiny-sft-{config.key()}"


def load_warm_started(config: WarmStartConfig = ARITH_TINY_SFT, dtype: torch.dtype = torch.float32,
                      log: Callable[[str], None] | None = print) -> tuple[LlamaForCausalLM, object]:
    """``(model, tokenizer)`` warm-started with ``config``: from the cache, or trained now (single-threaded,
    so the weights do not depend on the machine's core count) and cached for the next run."""
    from lit_grpo.models import tiny_tokenizer

    folder = cached_dir(config)
    if (folder / "config.json").exists():
        return LlamaForCausalLM.from_pretrained(folder, dtype=dtype), tiny_tokenizer()
    if log is not None:
        log(f"warm-starting the arithmetic model ({config.steps} SFT steps on {config.task}); cached in {folder}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = train_warm_start(config, log=log)
    finally:
        torch.set_num_threads(threads)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + ".tmp"))
        model.save_pretrained(staging)
        (staging / "warm_start.json").write_text(json.dumps(dataclasses.asdict(config), indent=1))
        try:
            staging.rename(folder)  # atomic: a concurrent run sees either no folder or a complete one
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another process cached it first
    except OSError:
        pass  # read-only cache: keep working without it
    return model.to(dtype), tokenizer
