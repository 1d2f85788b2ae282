r"""GRPO throughput on uneven completion lengths: this tree, an earlier commit and TRL's ``GRPOTrainer``, side by side.

The workload
------------
Completions whose lengths spread from a few tokens to the budget (512 new tokens by default), on two models:

* ``smollm2``: SmolLM2-135M-Instruct (the alias ``smollm2-135m-instruct``) on GSM8K train prompts, sampled at
  temperature 1: its natural lengths, scored by the correctness reward;
* ``random``: a random-init model of SmolLM2-135M's shape (``benchmarks/make_random_model.py smol135``) whose EOS
  row is set so that EOS comes with probability about 1/150 per token (``--eos-rate``: lengths roughly geometric,
  median about 100), scored by ``benchmarks/coin_reward.py`` so that groups still get a spread of rewards. It is
  built on first use into ``benchmarks/results/uneven/models/``.

The prompts, the model settings (float32, beta 0.1, AdamW lr 1e-6, clipping 1.0, one update per batch) and TRL's
configuration are those of ``benchmarks/step_time.py``, whose helpers this script imports.

Same lengths on every side (``--lengths schedule``)
--------------------------------------------------
Sampled lengths differ from side to side (each side draws its own tokens), so at 1 prompt x 8 the sides once
generated 824, 1,529 and 2,192 tokens and their step times could not be compared. With ``--lengths schedule`` no side
samples: each replays completions fixed by :func:`scheduled_completion`, keyed on the prompt's token ids and the
row within its group (a geometric length of rate ``--eos-rate`` capped at ``--max-new-tokens``, ending in EOS below
the cap; token ids drawn from the same key). Every side then updates on the same tokens. Ours replays them from the
in-process engine (``TransformersEngine._generate`` replaced, its sampler log-probs computed by one no-grad padded
pass of the engine's model); TRL from ``GRPOTrainer._generate_single_turn`` (rows are its prompts repeated G times
in a row, as its sampler lays them out). The reward is the coin reward on both models (the replayed text answers
nothing). A step then times the update and the step's bookkeeping, not generation (``generate`` is the replay's
own time). ``--lengths natural`` samples as before.

The sides
---------
Each side runs in its own subprocess, one after the other, in one invocation:

* ``ours``: this working tree, ``lightning.Trainer.fit`` of ``GRPOModule`` + ``RolloutDataModule`` with the
  in-process engine; ``--ours-args data.micro_batch_tokens=4096 model.x=y`` overrides the constructor arguments
  of the data module (``data.``) and of the module (``model.``), dotted keys reaching into dicts and dataclasses,
  values read as YAML (for every ``ours`` side);
* ``ours-tree``: the same with ``model.packing`` and a budget of ``--packed-tokens`` tokens a micro-batch: each
  micro-batch one packed row laid out as a prefix tree, each group's prompt once (``lit_grpo.core.prefix_tree``);
* ``ours-copies``: the same packing in the layout before the tree, each completion after its own copy of its prompt
  (``lit_grpo.core.packing``; forced by replacing ``packed_layout_kind``);
* ``main``: the same side code run on a ``git worktree`` of ``--ref`` (default ``e635164``), its ``lit_grpo``
  first on the worker's path;
* ``trl``: ``step_time.run_trl`` (TRL's ``GRPOTrainer``, no vLLM), with its scored batches recorded.

``--async-sides ours main`` also runs those sides asynchronously: ``data.engine: server`` with
``data.max_staleness: 1``, against ``python -m lit_grpo serve`` (one thread) started from the side's own tree.

What it measures, per measured step
-----------------------------------
* ``step_s``: wall time of the loop iteration (as ``step_time.py``);
* ``generate_tokens_per_s``: completion tokens generated / seconds spent generating them;
* ``update_tokens_per_s``: the batch's real tokens, prompt + completion per sequence (a prompt counted once per
  completion, the same count for every side), / the update's seconds (reference pass, policy forward and
  backward, optimizer step);
* ``padded_fraction``: padded positions / positions the update's forwards process. Ours: over
  ``RolloutBatch.micro_batches()``, each micro-batch running its distinct prompts ``[u, P']`` once and its
  completions ``[s, C' - 1]`` (``lit_grpo.core.scoring``), replaced by the module's own ``train/padded_fraction``
  when it logs one (0 for the packed sides). TRL: its scored batch ``[B, P + C]``, every prompt once per
  completion;
* completion lengths (all of them, for the histogram, and min / median / mean / max);
* asynchronous runs: ``push_wait_s``, the seconds the weight push waited for the producer to drain (the hooks the
  push runs first, ``RemoteEngine.before_push``, timed by a callback), and ``rollout/trainer_wait_seconds``.

The physical limit: the update's model FLOPs (``lit_grpo.training.flops.update_flops``: 8 N per token with the
reference pass, over the tokens the update must read with no padding and each prompt once per group) at the
fp32 matmul rate measured here (``--matmul-size`` square matrices, best of a few), as seconds and as the fraction
of it the measured update reaches.

    python benchmarks/uneven_lengths.py --threads 2                              # both models, all sides
    python benchmarks/uneven_lengths.py --models random --sides ours main --async-sides
    python benchmarks/uneven_lengths.py --ours-args data.micro_batch_tokens=4096

Writes ``benchmarks/results/uneven/uneven_lengths.json`` and ``uneven_lengths.png`` (``--output-dir``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from benchmarks.step_time import (  # noqa: E402  (the path above first)
    SEED,
    TRAINING_PEAK,
    UPDATE_PEAK,
    json_safe,
    make_clock,
    metric,
    peak_rss_mib,
    peak_rss_since_reset_mib,
    prompt_rows,
    reset_peak_rss,
    run_trl,
    versions,
)

OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results" / "uneven"
RESULT_MARKER = "UNEVEN_RESULT "
DEFAULT_REF = "e635164"
MODELS = ("smollm2", "random")
SIDES = ("ours", "ours-tree", "ours-copies", "main", "trl")
#: the constructor overrides each packed side adds (before ``--ours-args``); its budget is ``--packed-tokens``
PACKED_SIDES = {"ours-tree": "packed_tree", "ours-copies": "packed"}
ASYNC_SIDES = ("ours", "main")
REWARDS = {"smollm2": "correctness", "random": "benchmarks.coin_reward:coin"}


# ----------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS), help="workloads to run")
    parser.add_argument("--sides", nargs="*", choices=SIDES, default=["ours", "ours-tree", "ours-copies", "trl"],
                        help="synchronous sides")
    parser.add_argument("--lengths", choices=("schedule", "natural"), default="schedule",
                        help="schedule: every side replays the same completions (scheduled_completion); natural: "
                             "each side samples its own")
    parser.add_argument("--packed-tokens", type=int, default=4096,
                        help="data.micro_batch_tokens of the packed sides (ours-tree, ours-copies)")
    parser.add_argument("--async-sides", nargs="*", choices=ASYNC_SIDES, default=[],
                        help="sides also run at data.max_staleness=1 against the project's server")
    parser.add_argument("--ref", default=DEFAULT_REF, help="git ref of the 'main' side")
    parser.add_argument("--ours-args", nargs="*", default=[],
                        help="dotted overrides for the 'ours' side: data.KEY=VALUE (RolloutDataModule) or "
                             "model.KEY=VALUE (GRPOModule); VALUE is read as YAML")
    parser.add_argument("--steps", type=int, default=2, help="measured training steps")
    parser.add_argument("--warmup", type=int, default=1, help="training steps run first and not measured")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=512, help="completion length budget")
    parser.add_argument("--micro-batch-size", type=int, default=16, help="completions per forward (ours, main)")
    parser.add_argument("--trl-micro-batch-size", type=int, default=None,
                        help="TRL's rows per forward (per_device_train_batch_size, the rest accumulated); default: "
                             "the whole batch in one")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="TRL with gradient_checkpointing=True (its activation checkpointing)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads per side")
    parser.add_argument("--mmap-threshold-kb", default="glibc",
                        help="glibc's mmap threshold on every side, in KiB: ours through the HostMemory callback, "
                             "the others through MALLOC_MMAP_THRESHOLD_; 'glibc' (the default, as the command "
                             "line's) leaves glibc's dynamic threshold")
    parser.add_argument("--eos-rate", type=float, default=1 / 150, help="the random model's p(EOS) per token")
    parser.add_argument("--random-model", type=Path, default=None,
                        help="the random model's directory (default: built on first use under "
                             "benchmarks/results/uneven/models/)")
    parser.add_argument("--matmul-size", type=int, default=2048, help="square fp32 matmul timed for the limit")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    # worker-only
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--side", choices=SIDES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("sync", "async"), default="sync", help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reward", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.mmap_threshold_kb != "glibc" and not args.mmap_threshold_kb.isdigit():
        parser.error(f"--mmap-threshold-kb must be a number of KiB or 'glibc', got {args.mmap_threshold_kb!r}")
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    if not 0.0 < args.eos_rate < 1.0:
        parser.error(f"--eos-rate must be a probability in (0, 1), got {args.eos_rate}")
    if args.lengths == "schedule" and (args.async_sides or "main" in args.sides):
        parser.error("--lengths schedule replays completions in this tree's engine and TRL's: it runs the "
                     "synchronous sides ours, ours-tree, ours-copies and trl; got "
                     f"--sides {' '.join(args.sides)} --async-sides {' '.join(args.async_sides)}")
    if args.packed_tokens < 1:
        parser.error(f"--packed-tokens must be >= 1, got {args.packed_tokens}")
    for item in args.ours_args:
        parse_override(item)  # a malformed one fails here, before any side runs
    # what step_time's helpers read
    args.accelerator, args.precision, args.tf32 = "cpu", "32-true", False
    args.beta, args.temperature, args.lr, args.tv_monitor = 0.1, 1.0, 1e-6, False
    return args


# ----------------------------------------------------------------------------------------------------------
# Pure helpers
# ----------------------------------------------------------------------------------------------------------


def parse_override(item: str) -> tuple[list[str], Any]:
    """``data.a.b=VALUE`` -> (``["data", "a", "b"]``, VALUE read as YAML)."""
    import yaml

    key, sep, raw = item.partition("=")
    parts = key.split(".")
    if not sep or len(parts) < 2 or parts[0] not in ("data", "model") or not all(parts):
        raise SystemExit(f"--ours-args: {item!r} is not data.KEY=VALUE or model.KEY=VALUE")
    return parts, yaml.safe_load(raw)


def with_override(target: Any, keys: list[str], value: Any) -> Any:
    """``target`` (a dict or a dataclass) with ``keys`` (a path into it) set to ``value``; a copy, never in place.
    A missing dict key is added; a dataclass takes only its own fields."""
    head, rest = keys[0], keys[1:]
    if dataclasses.is_dataclass(target):
        if head not in {f.name for f in dataclasses.fields(target)}:
            raise SystemExit(f"--ours-args: {type(target).__name__} has no field {head!r}")
        inner = getattr(target, head)
        return dataclasses.replace(target, **{head: with_override(inner, rest, value) if rest else value})
    if isinstance(target, dict) or target is None:
        copy = dict(target or {})
        copy[head] = with_override(copy.get(head), rest, value) if rest else value
        return copy
    raise SystemExit(f"--ours-args: cannot set {head!r} inside a {type(target).__name__}")


def apply_overrides(module_kwargs: dict[str, Any], data_kwargs: dict[str, Any], items: Iterable[str]
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The constructor kwargs with each ``data.`` / ``model.`` override applied, in order."""
    for item in items:
        keys, value = parse_override(item)
        if keys[0] == "data":
            data_kwargs = with_override(data_kwargs, keys[1:], value)
        else:
            module_kwargs = with_override(module_kwargs, keys[1:], value)
    return module_kwargs, data_kwargs


def padded_fraction(real: float, processed: float) -> float:
    """Padded positions over the positions processed, ``1 - real / processed`` (0 when nothing was processed)."""
    return 1.0 - real / processed if processed > 0 else 0.0


def length_stats(lengths: list[int]) -> dict[str, float]:
    """Min, median, mean, max of completion lengths, and the share shorter than 16 tokens."""
    if not lengths:
        return {}
    return {"min": float(min(lengths)), "median": float(statistics.median(lengths)),
            "mean": float(statistics.fmean(lengths)), "max": float(max(lengths)),
            "below_16": sum(n < 16 for n in lengths) / len(lengths)}


def histogram(lengths: list[int], budget: int, bins: int = 16) -> dict[str, list[float]]:
    """Counts of ``lengths`` in ``bins`` equal bins over ``[0, budget]`` (the last bin includes the budget)."""
    width = max(1, -(-budget // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(n // width, bins - 1)] += 1
    return {"edges": [float(i * width) for i in range(bins + 1)], "counts": [float(c) for c in counts]}


def scheduled_completion(prompt: Sequence[int], row: int, budget: int, rate: float, low: int, vocab: int,
                         eos: int) -> list[int]:
    """The completion every side replays as row ``row`` of ``prompt``'s group (``--lengths schedule``): its length
    the position of the first EOS when each token is EOS with probability ``rate`` (geometric), capped at ``budget``
    tokens (then no EOS: truncated); its other tokens uniform over ``[low, vocab)`` (above the special tokens). All
    drawn from a generator keyed on the prompt's token ids and the row, so no side's sampling enters."""
    key = zlib.crc32(",".join(map(str, prompt)).encode())
    rng = random.Random(key * 1_000_003 + row)
    length = 1
    while length < budget and rng.random() >= rate:
        length += 1
    ended = length < budget or rng.random() < rate
    tokens = [rng.randrange(low, vocab) for _ in range(length - 1)]
    return tokens + [eos if ended else rng.randrange(low, vocab)]


def replay_tokens(model_name: str) -> tuple[int, int, int]:
    """``(low, vocab, eos)`` of :func:`scheduled_completion` for this model's tokenizer, the same on every side: the
    first id above every special token (replayed text carries no chat markers), the vocabulary size, and the first
    end-of-sequence id both engines stop at."""
    from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(model_name, "float32")
    return max(tokenizer.all_special_ids, default=-1) + 1, len(tokenizer), min(eos_token_ids(tokenizer, model))


def replay_in_ours(args: argparse.Namespace, low: int, vocab: int, eos: int) -> None:
    """``TransformersEngine`` replays :func:`scheduled_completion` instead of sampling; the sampler's log-probs are
    the engine model's, from one no-grad padded pass (what the rollouts would carry had it sampled them)."""
    from lit_grpo.core.batch import left_pad, micro_batch_views
    from lit_grpo.core.scoring import completion_logprobs
    from lit_grpo.engines.base import Completion
    from lit_grpo.engines.transformers_engine import TransformersEngine

    def replay(self: Any, prompts: list[list[int]], n: int, sampling: Any, seed: int, *rest: Any) -> Any:
        import torch

        if eos not in self.eos_token_ids:
            raise SystemExit(f"the replay's EOS {eos} is not one the engine stops at ({self.eos_token_ids})")
        rows = [scheduled_completion(p, j, sampling.max_new_tokens, args.eos_rate, low, vocab, eos)
                for p in prompts for j in range(n)]
        device = self.device
        prompt_ids, prompt_mask = left_pad(prompts, self.pad_token_id, device)
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, tokens in enumerate(rows):
            ids[i, : len(tokens)] = torch.tensor(tokens, device=device)
            mask[i, : len(tokens)] = 1
        groups = torch.arange(len(prompts), device=device).repeat_interleave(n)
        (mb,) = micro_batch_views(prompt_ids, prompt_mask, groups, ids, mask, len(rows))
        logps = completion_logprobs(self.model, mb, sampling.temperature)[0].tolist()
        out = [Completion(tokens, logps[i][: len(tokens)], truncated=tokens[-1] != eos)
               for i, tokens in enumerate(rows)]
        return [out[p * n: (p + 1) * n] for p in range(len(prompts))]

    TransformersEngine._generate = replay
    TransformersEngine._generate_static = replay


def replay_in_trl(args: argparse.Namespace, low: int, vocab: int, eos: int) -> None:
    """TRL's ``_generate_single_turn`` replays :func:`scheduled_completion`: its rows are its prompts, each repeated
    G times in a row (its ``RepeatSampler``), so row ``b`` is completion ``b % G`` of its prompt."""
    from trl import GRPOTrainer

    def replay(self: Any, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any, num_generations: int,
               has_tool_images: bool = False) -> tuple[list[list[int]], None]:
        if eos not in self.eos_token_ids:
            raise SystemExit(f"the replay's EOS {eos} is not one TRL stops at ({self.eos_token_ids})")
        rows = [scheduled_completion(list(p), b % num_generations, args.max_new_tokens, args.eos_rate, low, vocab,
                                     eos) for b, p in enumerate(prompt_ids)]
        return rows, None

    GRPOTrainer._generate_single_turn = replay


def matmul_flops_per_s(size: int, repeats: int = 5) -> float:
    """The best fp32 matmul rate of ``repeats`` products of two ``size`` x ``size`` matrices (2 size^3 FLOPs each)
    at the current torch thread count."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


# ----------------------------------------------------------------------------------------------------------
# Batch statistics
# ----------------------------------------------------------------------------------------------------------


def lit_batch_stats(batch: Any) -> dict[str, Any]:
    """Token counts of a ``RolloutBatch``: completions, the update's real tokens, the positions its forwards
    process (prompts once per micro-batch, completions but their last column) and the FLOP tokens."""
    from lit_grpo.training.flops import processed_tokens

    completion_lengths = batch.completion_mask.sum(1)
    prompt_lengths = batch.prompt_mask.sum(1)[batch.group_index]
    real = processed = 0.0
    for mb in batch.micro_batches():
        real += float(processed_tokens(mb.prompt_mask, mb.completion_mask))
        processed += mb.prompt_mask.numel() + mb.completion_mask[:, :-1].numel()
    return {
        "completion_tokens": float(batch.token_mask.sum()),
        "update_tokens": float(prompt_lengths.sum() + completion_lengths.sum()),
        "flop_tokens": float(processed_tokens(batch.prompt_mask, batch.completion_mask)),
        "processed_positions": processed,
        "padded_fraction": padded_fraction(real, processed),
        "lengths": [int(n) for n in completion_lengths.tolist()],
    }


def trl_batch_stats(scored: dict[str, Any], group: int) -> dict[str, Any]:
    """The same counts for TRL's scored batch (``prompt_mask [B, P]``, ``completion_mask [B, C]``, each prompt's
    ``group`` rows consecutive): every forward runs ``[B, P + C]``, each prompt once per row."""
    pm, cm = scored["prompt_mask"], scored["completion_mask"]
    real = float(pm.sum() + cm.sum())
    processed = float(pm.numel() + cm.numel())
    return {
        "completion_tokens": float(cm.sum()),
        "update_tokens": real,
        # the tokens the update needs with each prompt once per group (the FLOP count), as for ours
        "flop_tokens": float(pm[::group].sum() + cm[:, :-1].sum()),
        "processed_positions": processed,
        "padded_fraction": padded_fraction(real, processed),
        "lengths": [int(n) for n in cm.sum(1).tolist()],
    }


def step_rates(step: dict[str, Any]) -> dict[str, Any]:
    """Tokens per second of the generation and of the update of one recorded step."""
    gen, upd = step.get("generate"), step.get("update")
    return {
        "generate_tokens_per_s": step["completion_tokens"] / gen if gen and gen == gen and gen > 0 else None,
        "update_tokens_per_s": step["update_tokens"] / upd if upd and upd == upd and upd > 0 else None,
    }


# ----------------------------------------------------------------------------------------------------------
# Lightning sides (ours and main): one fit, per-step batch statistics
# ----------------------------------------------------------------------------------------------------------


def run_lit(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import Callback
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.data.prompts import DEFAULT_SYSTEM_PROMPT
    from lit_grpo.training.module import GRPOModule
    from lit_grpo.training.optim import OptimizerArgs

    clock = make_clock(args)

    class Recorder(Callback):
        """Per step: the logged metrics, the batch's token counts, the loop's wall time, and the seconds the
        weight pushes spent in the engine's ``before_push`` hooks (the producer's drain)."""

        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.last_end = 0.0
            self.push_wait: float | None = None  # None: the engine has no hooks before a push (synchronous)

        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            engine = getattr(trainer.datamodule, "rollout_engine", None)
            hooks = getattr(engine, "before_push", None)
            if hooks:
                hooks[:] = [self.timed(h) for h in hooks]
                self.push_wait = 0.0
            self.last_end = clock()

        def timed(self, hook: Any) -> Any:
            def wrapper() -> None:
                start = clock()
                hook()
                self.push_wait += clock() - start
            return wrapper

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                                 batch_idx: int) -> None:
            reset_peak_rss()  # the batch is sampled (on_after_batch_transfer): the update's own peak starts here

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            now = clock()
            TRAINING_PEAK["rss_mib"] = peak_rss_mib()
            UPDATE_PEAK["rss_mib"] = peak_rss_since_reset_mib()
            m = {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
            step = {
                "total": now - self.last_end,
                "generate": metric(m, "rollout/generate_seconds"),
                "rollout": metric(m, "rollout/rollout_seconds"),
                "update": metric(m, "train/update_seconds"),
                "weight_sync": metric(m, "sync/seconds"),
                "trainer_wait": metric(m, "rollout/trainer_wait_seconds"),
                "module_padded_fraction": metric(m, "train/padded_fraction"),
                "push_wait": self.push_wait,
                "reward_mean": metric(m, "rollout/reward_mean"),
                **lit_batch_stats(batch),
            }
            if step["module_padded_fraction"] is not None:  # what the module fed: 0 when packed
                step["padded_fraction"] = step["module_padded_fraction"]
            self.steps.append({**step, **step_rates(step)})
            self.push_wait = None if self.push_wait is None else 0.0
            self.last_end = now

    L.seed_everything(SEED, verbose=False)
    indices, _ = prompt_rows(args)
    module_kwargs: dict[str, Any] = {
        "model_name": args.model, "dtype": "float32", "beta": args.beta, "temperature": args.temperature,
        "max_completion_length": args.max_new_tokens, "optimizer": OptimizerArgs(lr=args.lr),
        "monitor_tv_after_update": False,
    }
    data_kwargs: dict[str, Any] = {
        "dataset": "bundled", "split": "train", "prompts_per_step": args.prompts,
        "num_generations": args.generations, "micro_batch_size": args.micro_batch_size,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "rewards": [args.reward],
        "system_prompt": DEFAULT_SYSTEM_PROMPT, "engine": "transformers", "seed": SEED,
    }
    if args.mode == "async":
        data_kwargs.update(engine="server", max_staleness=1, engine_options={
            "url": os.environ["UNEVEN_SERVER_URL"], "timeout_s": 120, "generate_timeout_s": 1800})
    if args.side.startswith("ours"):
        packed = [f"data.micro_batch_tokens={args.packed_tokens}", "model.packing=true"]
        module_kwargs, data_kwargs = apply_overrides(
            module_kwargs, data_kwargs, (packed if args.side in PACKED_SIDES else []) + list(args.ours_args))
    module = GRPOModule(**module_kwargs)
    data = RolloutDataModule(**data_kwargs)
    recorder = Recorder()  # after WeightSync: each step's time includes its weight push
    if args.tree is None:
        from lit_grpo.callbacks import HostMemory

        host_memory = HostMemory(None if args.mmap_threshold_kb == "glibc" else int(args.mmap_threshold_kb))
    else:  # an older tree has no HostMemory: its side gets the threshold through the environment
        host_memory = Callback()
    with tempfile.TemporaryDirectory() as workdir:
        trainer = L.Trainer(
            max_steps=args.warmup + args.steps, accelerator="cpu", devices=1, precision="32-true", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            default_root_dir=workdir, callbacks=[WeightSync(every_n_batches=1), host_memory, recorder],
        )
        start = clock()
        trainer.fit(module, datamodule=data)
        fit_seconds = clock() - start
    parameters = sum(p.numel() for p in module.policy.parameters())
    return {"prompt_rows": indices, "fit_seconds": fit_seconds, "parameters": parameters,
            "mmap_threshold_kb": args.mmap_threshold_kb,
            "host_memory_applied": getattr(host_memory, "applied", os.environ.get("MALLOC_MMAP_THRESHOLD_")),
            "micro_batch_layout": module.micro_batch_layout,
            # the in-process engine sampled from the policy itself (data.engine_options.weights) or from a copy
            "engine_weights": "shared" if getattr(data.rollout_engine, "shares_policy", False) else "copy",
            "module_kwargs": {k: repr(v) for k, v in module_kwargs.items()},
            "data_kwargs": {k: repr(v) for k, v in data_kwargs.items()},
            "warmup_steps": recorder.steps[: args.warmup], "measured_steps": recorder.steps[args.warmup:]}


# ----------------------------------------------------------------------------------------------------------
# TRL: step_time.run_trl, with each scored batch recorded
# ----------------------------------------------------------------------------------------------------------


def run_trl_recorded(args: argparse.Namespace) -> dict[str, Any]:
    from trl import GRPOTrainer

    scored: list[dict[str, Any]] = []
    parameters: list[int] = []
    original = GRPOTrainer._generate_and_score_completions

    def recording(self: Any, *a: Any, **kw: Any) -> Any:
        out = original(self, *a, **kw)
        scored.append(trl_batch_stats(out, self.num_generations))
        parameters[:] = [sum(p.numel() for p in self.model.parameters())]
        return out

    GRPOTrainer._generate_and_score_completions = recording
    result = run_trl(args)
    steps = result["warmup_steps"] + result["measured_steps"]
    if len(scored) != len(steps):
        raise SystemExit(f"TRL scored {len(scored)} batches in {len(steps)} steps; expected one per step")
    for step, stats in zip(steps, scored):
        step.update(stats)
        step.update(step_rates(step))
        step["push_wait"] = None
    return {**{k: v for k, v in result.items() if k != "median"}, "parameters": parameters[0]}


# ----------------------------------------------------------------------------------------------------------
# Worker and driver
# ----------------------------------------------------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    if args.tree is not None:  # the 'main' side: that tree's lit_grpo, not this one's
        sys.path.insert(0, str(args.tree))
    import torch

    import lit_grpo

    torch.set_num_threads(args.threads)
    if args.lengths == "schedule":
        spec = replay_tokens(args.model)
        replay_in_trl(args, *spec) if args.side == "trl" else replay_in_ours(args, *spec)
    if args.side == "ours-copies":
        from benchmarks.packing import force_copies_layout

        force_copies_layout()
    source = Path(lit_grpo.__file__).resolve().parents[1]
    if args.tree is not None and source != args.tree.resolve():
        raise SystemExit(f"the main side imported lit_grpo from {source}, expected {args.tree}")
    result = run_trl_recorded(args) if args.side == "trl" else run_lit(args)
    result["lit_grpo_source"] = str(source)
    result["peak_rss_mib"] = TRAINING_PEAK["rss_mib"]
    result["update_peak_rss_mib"] = UPDATE_PEAK["rss_mib"]  # the last step's update alone, after its rollout
    result["torch_threads"] = torch.get_num_threads()
    print(RESULT_MARKER + json.dumps(json_safe(result)), flush=True)


def worker_command(args: argparse.Namespace, side: str, mode: str, model: str, reward: str,
                   tree: Path | None) -> list[str]:
    command = [
        sys.executable, str(Path(__file__).resolve()), "--worker", "--side", side, "--mode", mode,
        "--model", model, "--reward", reward, "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--prompts", str(args.prompts), "--generations", str(args.generations),
        "--max-new-tokens", str(args.max_new_tokens), "--micro-batch-size", str(args.micro_batch_size),
        "--threads", str(args.threads), "--lengths", args.lengths, "--eos-rate", repr(args.eos_rate),
        "--packed-tokens", str(args.packed_tokens), "--mmap-threshold-kb", args.mmap_threshold_kb,
    ]
    if args.trl_micro_batch_size is not None:
        command += ["--trl-micro-batch-size", str(args.trl_micro_batch_size)]
    if side == "trl" and args.trl_gradient_checkpointing:
        command += ["--trl-gradient-checkpointing"]
    if tree is not None:
        command += ["--tree", str(tree)]
    if side.startswith("ours") and args.ours_args:
        command += ["--ours-args", *args.ours_args]
    return command


def run_side(args: argparse.Namespace, side: str, mode: str, model: str, reward: str, tree: Path | None
             ) -> dict[str, Any]:
    """One side in a subprocess (with the project's server beside it, from the same tree, when asynchronous)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if side in ("main", "trl") and args.mmap_threshold_kb != "glibc":  # read by glibc when the process starts
        env["MALLOC_MMAP_THRESHOLD_"] = str(int(args.mmap_threshold_kb) * 1024)
    command = worker_command(args, side, mode, model, reward, tree)
    print(f"[uneven] {side} ({mode}) on {model}", file=sys.stderr, flush=True)
    server = None
    try:
        if mode == "async":
            server = start_server(tree or REPO_ROOT, model)
            env.update(UNEVEN_SERVER_URL=server.url, LIT_GRPO_SERVER_TOKEN=server.token)
        proc = subprocess.run(command, stdout=subprocess.PIPE, text=True, env=env, cwd=tree or REPO_ROOT)
    finally:
        if server is not None:
            server.kill()
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-5000:])
        return {"error": f"the worker exited with {proc.returncode}"}
    return json.loads(lines[-1][len(RESULT_MARKER):])


def start_server(tree: Path, model: str) -> Any:
    """``python -m lit_grpo serve`` from ``tree`` (its own ``tests/server_process.py``: the server runs that tree's
    code, one thread), ready."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"server_process_{abs(hash(tree))}", tree / "tests" /
                                                  "server_process.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    server = loaded.ServerProcess(Path(tempfile.mkdtemp(prefix="uneven-server-")), model=model)
    server.wait_ready()
    return server


def main_worktree(ref: str, folder: Path) -> Path:
    """A detached ``git worktree`` of ``ref`` in ``folder``."""
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(folder), ref], check=True,
                   stdout=subprocess.DEVNULL)
    return folder


def random_model(args: argparse.Namespace) -> Path:
    """The random model with spread EOS, built on first use."""
    folder = args.random_model or OUTPUT_DIR / "models" / f"smol135-eos{round(1 / args.eos_rate)}"
    if not (folder / "config.json").is_file():
        from benchmarks.make_random_model import build

        build(folder, "smol135", eos_rate=args.eos_rate)
    return folder.resolve()  # the 'main' side runs in another folder


def summarize_side(result: dict[str, Any], flops_per_s: float, beta: float) -> dict[str, Any]:
    """Medians over the measured steps, the lengths over them, and the physical limit of the update."""
    from lit_grpo.training.flops import update_flops

    steps = result.get("measured_steps") or []
    if not steps:
        return {}
    keys = ("total", "generate", "update", "generate_tokens_per_s", "update_tokens_per_s", "padded_fraction",
            "module_padded_fraction", "push_wait", "trainer_wait", "completion_tokens", "update_tokens")
    median = {}
    for key in keys:
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float)) and s[key] == s[key]]
        median[key] = statistics.median(values) if values else None
    lengths = [n for s in steps for n in s["lengths"]]
    limit = [update_flops(result["parameters"], s["flop_tokens"], 1, beta > 0, 0) / flops_per_s for s in steps]
    limit_s = statistics.median(limit)
    return {"median": median, "lengths": length_stats(lengths), "limit_update_s": limit_s,
            "update_fraction_of_limit": limit_s / median["update"] if median["update"] else None}


def lengths_agree(sides: dict[str, Any]) -> dict[str, bool]:
    """Per side, whether every step (warm-up included) had the completion lengths of the first side's step, as a
    multiset (rows may come in another order): what ``--lengths schedule`` promises."""
    def per_step(run: dict[str, Any]) -> list[list[int]]:
        return [sorted(step["lengths"]) for step in run.get("warmup_steps", []) + run.get("measured_steps", [])]

    runs = {name: per_step(run) for name, run in sides.items() if "error" not in run}
    if not runs:
        return {}
    first = next(iter(runs.values()))
    return {name: steps == first for name, steps in runs.items()}


def plot(report: dict[str, Any], path: Path) -> str:
    """Bars of the side-by-side medians, one panel per quantity; returns what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    panels = [("update_tokens_per_s", "update tokens/s"), ("generate_tokens_per_s", "generation tokens/s"),
              ("total", "step s"), ("push_wait", "push wait s (K = 1)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, title) in zip(axes, panels):
        labels, values = [], []
        for model, runs in report["runs"].items():
            for name, run in runs.items():
                if key == "push_wait" and not name.endswith("async"):
                    continue
                value = run.get("summary", {}).get("median", {}).get(key)
                labels.append(f"{model}\n{name}")
                values.append(value or 0.0)
        colours = {"ours-tree": "C0", "ours-copies": "C3", "ours": "C4", "main": "C1", "trl": "C2"}
        ax.bar(range(len(values)), values,
               color=[next((c for side, c in colours.items() if f"\n{side}" in lb), "C7") for lb in labels])
        ax.set_xticks(range(len(values)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
        if not values:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"uneven lengths (<= {report['config']['max_new_tokens']} new tokens), medians", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return str(path)


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{'model':8} {'side':12} {'step s':>8} {'gen s':>7} {'upd s':>7} {'gen tok/s':>10} {'upd tok/s':>10} "
          f"{'padded':>7} {'push wait':>10} {'len min/med/max':>16} {'limit s':>8} {'of limit':>9}")
    for model, runs in report["runs"].items():
        for name, run in runs.items():
            summary = run.get("summary") or {}
            m, ln = summary.get("median", {}), summary.get("lengths", {})

            def f(value: Any, width: int, digits: int) -> str:
                return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"

            lengths = f"{ln.get('min', 0):.0f}/{ln.get('median', 0):.0f}/{ln.get('max', 0):.0f}" if ln else "n/a"
            print(f"{model:8} {name:12} {f(m.get('total'), 8, 1)} {f(m.get('generate'), 7, 1)} "
                  f"{f(m.get('update'), 7, 1)} {f(m.get('generate_tokens_per_s'), 10, 1)} "
                  f"{f(m.get('update_tokens_per_s'), 10, 1)} {f(m.get('padded_fraction'), 7, 3)} "
                  f"{f(m.get('push_wait'), 10, 2)} {lengths:>16} {f(summary.get('limit_update_s'), 8, 2)} "
                  f"{f(summary.get('update_fraction_of_limit'), 9, 3)}" + (f"  {run['error']}" if "error" in run
                                                                            else ""))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    import signal

    import torch

    # a plain kill still removes the worktree of the main side (the finally below)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    flops_per_s = matmul_flops_per_s(args.matmul_size)
    models = {"smollm2": "smollm2-135m-instruct"}
    if "random" in args.models:
        models["random"] = str(random_model(args))
    runs: dict[str, dict[str, Any]] = {}
    needs_main = "main" in args.sides or "main" in args.async_sides
    with tempfile.TemporaryDirectory(prefix="uneven-main-") as tmp:
        tree = main_worktree(args.ref, Path(tmp) / "tree") if needs_main else None
        try:
            for model_key in args.models:
                runs[model_key] = {}
                plan = [(s, "sync") for s in args.sides] + [(s, "async") for s in args.async_sides]
                for side, mode in plan:
                    reward = "benchmarks.coin_reward:coin" if args.lengths == "schedule" else REWARDS[model_key]
                    result = run_side(args, side, mode, models[model_key], reward,
                                      tree if side == "main" else None)
                    if "error" not in result:
                        result["summary"] = summarize_side(result, flops_per_s, args.beta)
                    runs[model_key][side if mode == "sync" else f"{side}-async"] = result
                    # kept as each side ends: a long run that fails later keeps what it measured
                    (args.output_dir / "uneven_lengths.partial.json").write_text(json.dumps(json_safe(runs)))
        finally:
            if tree is not None:
                subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(tree)],
                               check=False)
    ref = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", args.ref], capture_output=True, text=True)
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    report = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("worker", "side", "mode", "model", "reward", "tree")},
        "models": models, "main_commit": ref.stdout.strip(), "ours_head": head.stdout.strip(),
        "matmul_fp32_flops_per_s": flops_per_s, "versions": versions(), "runs": runs,
        "same_lengths": {model_key: lengths_agree(run) for model_key, run in runs.items()},
    }
    print_table(report)
    print(f"same completion lengths as the first side, every step: {report['same_lengths']}")
    for model_key, run in runs.items():
        for name, side in run.items():
            if "summary" in side and side["summary"]:
                lengths = [n for step in side["measured_steps"] for n in step["lengths"]]
                side["summary"]["histogram"] = histogram(lengths, args.max_new_tokens)
                print(f"{model_key} {name} lengths {side['summary']['lengths']} "
                      f"histogram {side['summary']['histogram']['counts']}")
    print(f"fp32 matmul {args.matmul_size}^2 at {args.threads} threads: {flops_per_s / 1e9:.1f} GFLOP/s")
    out = args.output_dir / "uneven_lengths.json"
    out.write_text(json.dumps(json_safe(report), indent=1) + "\n")
    print(f"wrote {out}; plot: {plot(report, args.output_dir / 'uneven_lengths.png')}")


if __name__ == "__main__":
    main()
