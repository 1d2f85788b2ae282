"""Long completions at the paper's scale: the update's memory and speed at 1,024 to 4,096 new tokens, ours (padded,
prefix tree; the chunked lm head on and off) against TRL 1.16's ``GRPOTrainer``, side by side in one run.

    python benchmarks/long_context.py [--models smollm2 qwen05] [--budgets 1024 2048 4096]
        [--prompts 1] [--generations 4] [--steps 1] [--threads 2]

Each (model, budget) cell runs ``benchmarks/uneven_lengths.py`` with ``--lengths schedule``: no side samples, every
side replays the same completions (geometric lengths of rate ``1 / budget``, capped at the budget: mean about 0.63
of it), so the update's tokens are the same on every side; generation is the replay's own time. The models:

* ``smollm2``: SmolLM2-135M-Instruct (real weights, vocabulary 49,152);
* ``qwen05``: a random-init model of Qwen2.5-0.5B's shape and vocabulary (151,936 rows,
  ``make_random_model.py qwen05-152k``), float32, built on first use.

The sides, each in its own process (``uneven_lengths.py`` runs them one after the other):

* ``ours``: padded micro-batches of at most ``--tokens`` tokens (``data.micro_batch_tokens``), the chunked head at
  its default budget (``model.head_chunk_mb`` 256);
* ``ours-tree``: ``model.packing`` with the same budget: each micro-batch one prefix tree, attending in blocks;
* ``ours-tree-copy``: ``ours-tree`` with ``data.engine_options.weights: copy``: the in-process engine keeps a private
  copy of the weights, as before it sampled from the policy itself at v = 1 (``weights: auto``); not in the default
  set;
* ``ours-tree-ckpt``: ``ours-tree`` with ``model.gradient_checkpointing: true`` (one layer's activations at a time in
  the backward, for one more forward); not in the default set;
* ``ours-tree-sac``: ``ours-tree`` with ``model.gradient_checkpointing: selective`` (the matrix products' and
  attention's outputs kept, the elementwise operations recomputed); not in the default set;
* ``ours-full-logits``: ``ours`` with ``model.head_chunk_mb: null``, the head's full logits (before the chunked head);
* ``trl``: TRL 1.16's ``GRPOTrainer`` on the same replayed rows in float32 (``bf16=False, fp16=False``; precision
  and AdamW kernel recorded), its default fused AdamW (ours takes the same kernel: ``--ours-adamw fused``, the
  default; ``loop`` is ours' own default, which the tables of earlier runs used), ``--trl-micro-batch-size`` rows
  per forward, no gradient checkpointing, no vLLM, no Liger kernels
  (their chunked loss needs a GPU): its best settings on a CPU;
* ``trl-ckpt``: ``trl`` with ``gradient_checkpointing=True``, beside ``ours-tree-ckpt``; not in the default set.

Measured per side: peak RSS (the whole process, rollout included), the update's own peak (the resident set's peak
from the batch's hand-over to the step's end: ours after the rollout, TRL after ``_generate_and_score_completions``,
so ours counts pi_ref's pass and TRL's not), update and generation seconds, update tokens per second (the batch's
real tokens), and the update's share of the physical limit (its model FLOPs at the measured fp32 matmul rate). Writes
``long_context.json`` (every cell's report; a later run's sides join the cells already there) and prints the table
docs/speed.md holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results" / "long_context"
MODELS = ("smollm2", "qwen05")
SIDES = ("ours", "ours-tree", "ours-tree-copy", "ours-tree-ckpt", "ours-tree-sac", "ours-full-logits", "trl",
         "trl-ckpt")
#: the sides a run takes only when named in ``--sides``
OPT_IN_SIDES = ("ours-tree-copy", "ours-tree-ckpt", "ours-tree-sac", "trl-ckpt")
#: the sides run in an ``uneven_lengths.py`` invocation of their own: (its side, the ``--ours-args`` they add, the
#: further ``uneven_lengths.py`` arguments)
OWN_RUN = {"ours-full-logits": ("ours", ["model.head_chunk_mb=null"], []),
           "ours-tree-copy": ("ours-tree", ["data.engine_options={weights: copy}"], []),
           "ours-tree-ckpt": ("ours-tree", ["model.gradient_checkpointing=true"], []),
           "ours-tree-sac": ("ours-tree", ["model.gradient_checkpointing=selective"], []),
           "trl-ckpt": ("trl", [], ["--trl-gradient-checkpointing"])}


def cell_argv(args: argparse.Namespace, model: str, budget: int, sides: list[str], ours_args: list[str],
              out: Path) -> list[str]:
    """The ``uneven_lengths.py`` command line of one (model, budget) cell and a set of its sides."""
    argv = ["--lengths", "schedule", "--eos-rate", repr(1 / budget), "--max-new-tokens", str(budget),
            "--prompts", str(args.prompts), "--generations", str(args.generations), "--steps", str(args.steps),
            "--warmup", "0", "--threads", str(args.threads), "--packed-tokens", str(args.tokens),
            "--trl-micro-batch-size", str(args.trl_micro_batch_size), "--output-dir", str(out),
            "--mmap-threshold-kb", args.mmap_threshold_kb,
            "--sides", *sides, "--ours-args", f"data.micro_batch_tokens={args.tokens}",
            f"model.optimizer.fused={str(args.ours_adamw == 'fused').lower()}", *args.ours_args, *ours_args]
    if model == "qwen05":
        argv += ["--models", "random", "--random-model", str(qwen_model())]
    else:
        argv += ["--models", "smollm2"]
    return argv


def qwen_model() -> Path:
    folder = OUTPUT_DIR / "models" / "qwen05-152k"
    if not (folder / "config.json").is_file():
        from benchmarks.make_random_model import build

        build(folder, "qwen05-152k")
    return folder.resolve()


def run_cell(args: argparse.Namespace, model: str, budget: int) -> dict:
    """Every side of one cell: the plain sides in one ``uneven_lengths.py`` run, each of :data:`OWN_RUN` in one of
    its own (its ``--ours-args`` differ); their reports, side by side."""
    from benchmarks import uneven_lengths

    out = args.output_dir / f"{model}-{budget}"
    runs = {}
    chunked = [s for s in args.sides if s in ("ours", "ours-tree", "trl")]
    if chunked:
        uneven_lengths.main(cell_argv(args, model, budget, chunked, [], out / "chunked"))
        report = json.loads((out / "chunked" / "uneven_lengths.json").read_text())
        runs.update(next(iter(report["runs"].values())))
    for side, (runs_as, ours_args, further) in OWN_RUN.items():
        if side not in args.sides:
            continue
        folder = out / ("full" if side == "ours-full-logits" else side)
        uneven_lengths.main(cell_argv(args, model, budget, [runs_as], ours_args, folder) + further)
        own = json.loads((folder / "uneven_lengths.json").read_text())
        runs[side] = next(iter(own["runs"].values()))[runs_as]
        report = report if chunked else own
    return {"runs": runs, "matmul_fp32_flops_per_s": report["matmul_fp32_flops_per_s"],
            "versions": report["versions"], "same_lengths": report["same_lengths"]}


def table(cells: dict) -> str:
    """The markdown table of docs/speed.md: one line per (model, budget, side)."""
    lines = ["| model | budget | side | peak RSS MiB | update's peak MiB | update s | generate s | update tok/s | "
             "of FLOP limit | lengths min / median / max |", "|---|---|---|---|---|---|---|---|---|---|"]
    for key, cell in cells.items():
        model, budget = key.rsplit("-", 1)
        for side in SIDES:
            run = cell["runs"].get(side)
            if run is None:
                continue
            if "error" in run:
                lines.append(f"| {model} | {budget} | {side} | {run['error']} | | | | | | |")
                continue
            summary = run["summary"]
            median, lengths = summary["median"], summary["lengths"]
            update_peak = run.get("update_peak_rss_mib")
            lines.append(f"| {model} | {budget} | {side} | {run.get('peak_rss_mib', 0):,.0f} | "
                         f"{f'{update_peak:,.0f}' if update_peak else 'n/a'} | {median['update']:.1f} | "
                         f"{median['generate']:.1f} | {median['update_tokens_per_s']:.1f} | "
                         f"{summary['update_fraction_of_limit']:.2f} | {lengths['min']:.0f} / "
                         f"{lengths['median']:.0f} / {lengths['max']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--budgets", nargs="+", type=int, default=[1024, 2048, 4096], help="max new tokens")
    parser.add_argument("--sides", nargs="+", choices=SIDES,
                        default=[s for s in SIDES if s not in OPT_IN_SIDES])
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--steps", type=int, default=1, help="measured steps (no warm-up)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096, help="ours: data.micro_batch_tokens (and the tree's)")
    parser.add_argument("--trl-micro-batch-size", type=int, default=1, help="TRL: rows per forward")
    parser.add_argument("--mmap-threshold-kb", default="glibc",
                        help="glibc's mmap threshold on every side (KiB; ours: host_memory.mmap_threshold_kb), or "
                             "'glibc' (the default) for its dynamic threshold")
    parser.add_argument("--ours-adamw", choices=("fused", "loop"), default="fused",
                        help="ours' AdamW kernel (model.optimizer.fused); fused is TRL's default (optim "
                             "adamw_torch_fused), so the two sides step alike; loop is ours' own default")
    parser.add_argument("--ours-args", nargs="*", default=[],
                        help="further overrides for every side of ours (model.x=y)")
    parser.add_argument("--output-dir", type=Path, default=OUTPUT_DIR)
    args = parser.parse_args(argv)
    for budget in args.budgets:
        if budget < 16:
            parser.error(f"--budgets: each budget must be at least 16 tokens, got {budget}")
    out = args.output_dir / "long_context.json"
    # sides run later (--sides ours-tree-ckpt) join the cells already measured: one file, one table
    saved = json.loads(out.read_text()) if out.is_file() else {"runs_config": [], "cells": {}}
    saved["runs_config"] = saved.get("runs_config", []) + [
        {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}]
    cells = saved["cells"]
    for model in args.models:
        for budget in args.budgets:
            cell = run_cell(args, model, budget)
            key = f"{model}-{budget}"
            cells[key] = {**cell, "runs": {**cells.get(key, {}).get("runs", {}), **cell["runs"]}}
            args.output_dir.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(saved, indent=1) + "\n")
    print(table(cells))


if __name__ == "__main__":
    main()
