"""A miniature of the paper's Fig. 2 on one CPU machine: the Table 1 rows, an adaptive sync, asynchronous rows and
the REC family on the synthetic task of ``configs/demo_cpu.yaml``, several seeds each.

Every run is ``python -m lit_grpo fit --config configs/demo_cpu.yaml`` with the suite's and the row's overrides, a
seed (``seed_everything``: prompts, sampling, and the RED-Drop choices; the policy starts from the same warm-start
in every run), one thread, and its own folder. Two suites:

``--suite rec`` (the default; the committed miniature and its REC-family table): beta = 0, no reference swaps,
seeds 0 1 2, 100 steps.

- Table 1: ``v1-i1`` (on-policy GRPO), ``v1-i1-mask`` (zero-variance groups dropped and the loss renormalised,
  ``model.drop_zero_variance``: the form this row was run with before ``model.mask_zero_variance`` became eq. 8
  as the paper writes it), ``v10-i1`` (the paper's off-policy GRPO: the rollout weights lag up to 9 optimizer
  steps), ``v1-i10`` (10 SGD iterations on each rollout batch, so a tenth of the rollouts for the same optimizer
  steps);
- ``v10-i1-maxtv``: ``WeightSync(every_n_batches=10, max_tv=DELTA)``, sync early when the measured TV between
  the policy and the rollout weights exceeds DELTA (Theorem 1's term, see docs/theorem1-monitor.md);
- the REC / RED / OPMD / AsymRE losses of ``lit_grpo.math.rec`` at ``v = 10`` (their off-policy setting; the
  second paper syncs every 16 steps of a longer run), next to GRPO's ``v10-i1``.

``--suite paper`` (Fig. 2's settings): beta = ``--beta`` (0.1, the paper's), S = ``--swaps`` (3) reference swaps
(``RefModelSwap``: pi_ref <- pi_theta every ``steps / (S + 1)`` optimizer steps, i.e. S + 1 stages as the paper's
"4 epochs with a swap at the end of each"), seeds 0-4. Rows: ``v1-i1``, ``v1-i1-eq8`` (``model.mask_zero_variance``,
eq. 8 as written), ``v10-i1``, ``v1-i10``, ``v10-i1-maxtv``, and the asynchronous rows ``v1-i1-k1`` and
``v10-i1-k1`` (``data.max_staleness: 1``: the server generates the next batch while the trainer updates). Every
row of this suite samples from a rollout server process of its own (``python -m lit_grpo serve``, one thread,
float32) next to a one-thread trainer, the synchronous rows with ``data.max_staleness: 0``, so all rows have the
same two processes and the wall-clock panel compares overlap against no overlap, not one core against two
(``--sync-engine in_process`` samples the synchronous rows in the trainer instead). Before each trainer starts, the
server's SHA-256 of every parameter is checked against the warm-start the trainer loads. Runs go one at a time
(``--jobs 1``) so that wall-clock times are not shared with another run. ``--task add_3digit`` moves the suite to
three-digit addition (its own warm-start, built on first use and loaded from its cache folder by trainer and
server alike) in case on-policy GRPO saturates; its answers are longer, so at the default label smoothing (0.07) it
starts at Pass@1 ~0.02 (Pass@8 ~0.16): lower it with ``--warm-start-label-smoothing`` (about 0.05 should start
near 0.2; not tried yet).

The x axis is optimizer steps (``trainer.global_step``), as in Fig. 2; the paper suite also plots Pass@1 against
wall-clock seconds since the first evaluation (evaluation time included, the same for every row). Output, in
``--out``: ``curves.json.gz`` (compact gzip'd JSON, ``curves_file.py``: the settings, the warm-start's weight
fingerprint, a per-row summary, and every run's raw ``(step, value)`` series of held-out Pass@1, train reward, KL,
TV, syncs and swaps, ``wall_clock``: the ``(step, seconds)`` of every evaluation, and the run's wall time), the
figure, and the runs' TensorBoard folders.
Runs already finished in ``--out`` are kept, so an interrupted sweep picks up where it stopped. The script ends by
printing the full Markdown table (mean ± std over seeds, to three decimals) and, when ``--out`` is the committed
results folder, rewriting the suite's table in docs/miniature.md (between its ``fig2-miniature-table`` or
``fig2-paper-table`` markers) from the same summary.

    python experiments/fig2_miniature.py                              # the REC suite: all rows, seeds 0 1 2
    python experiments/fig2_miniature.py --suite paper                # Fig. 2's settings: 7 rows x 5 seeds
    python experiments/fig2_miniature.py --suite paper --rows v1-i1 v1-i1-k1 --seeds 0 --steps 8 \\
        --eval-every 4 --eval-questions 16 --out /path/to/smoke      # a quick look
    python experiments/fig2_miniature.py --suite paper --plot-only    # redraw and reprint from curves.json.gz
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from curves_file import CURVES_FILE, read_curves, write_curves
from doc_tables import write_table
from miniature_server import MiniatureServer, parameter_checksums
from miniature_stats import mean_std, seconds_since_first, smooth, summary, table, wall_clock_curve

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "configs" / "demo_cpu.yaml"
RESULTS = REPO_ROOT / "experiments" / "results"
MAX_TV = 0.01  # the adaptive row's delta; one on-policy step moves tv/pi_alpha by ~0.002 here (0.01 early on)
TASKS = ("add_2digit", "add_3digit")  # lit_grpo.data.synthetic.TASKS
MAX_NEW_TOKENS = {"add_2digit": 32, "add_3digit": 48}  # a worked solution is ~23 / ~33 tokens with the end token

TABLE1: dict[str, list[str]] = {
    "v1-i1": [],
    "v1-i1-mask": ["--model.drop_zero_variance", "true"],
    "v10-i1": ["--sync.every_n_batches", "10"],
    "v1-i10": ["--model.iterations_per_batch", "10"],
    "v10-i1-maxtv": ["--sync.every_n_batches", "10", "--sync.max_tv", str(MAX_TV)],
}
REC_LOSSES = ("rec_oneside_nois", "rec_oneside_is", "rec_twoside_is", "rec_ring", "red_drop", "red_weight",
              "opmd", "asymre")
REC_ROWS: dict[str, list[str]] = TABLE1 | {
    f"{loss}-v10": ["--model.loss", loss, "--sync.every_n_batches", "10"] for loss in REC_LOSSES
}

#: the paper suite's rows (the server, beta, swaps and task come on top) and their max_staleness K
PAPER_ROWS: dict[str, list[str]] = {
    "v1-i1": TABLE1["v1-i1"],
    "v1-i1-eq8": ["--model.mask_zero_variance", "true"],
    **{row: TABLE1[row] for row in ("v10-i1", "v1-i10", "v10-i1-maxtv")},
    "v1-i1-k1": TABLE1["v1-i1"],
    "v10-i1-k1": TABLE1["v10-i1"],
}
STALENESS = {"v1-i1-k1": 1, "v10-i1-k1": 1}

SERIES = {"pass@1": "eval/pass@1", "reward": "rollout/reward_mean", "tv_pi_alpha": "tv/pi_alpha",
          "tv_pik_alpha": "tv/pik_alpha", "staleness": "train/staleness", "sync_by_tv": "sync/by_tv",
          "kl": "train/kl", "ref_swaps": "ref/swaps", "trainer_wait_s": "rollout/trainer_wait_seconds"}


@dataclass(frozen=True)
class Suite:
    name: str
    rows: dict[str, list[str]]
    seeds: tuple[int, ...]
    out: Path
    jobs: int
    beta: float = 0.0
    swaps: int = 0
    server: bool = False  # every row samples from a rollout server of its own
    staleness: dict[str, int] = field(default_factory=dict)


SUITES = {
    "rec": Suite("rec", REC_ROWS, (0, 1, 2), RESULTS / "fig2_miniature", jobs=max(1, os.cpu_count() or 1)),
    "paper": Suite("paper", PAPER_ROWS, (0, 1, 2, 3, 4), RESULTS / "fig2_paper", jobs=1, beta=0.1, swaps=3,
                   server=True, staleness=STALENESS),
}


def swap_every(steps: int, swaps: int) -> int:
    """Optimizer steps per stage for ``swaps`` reference swaps over ``steps`` steps: S swaps make S + 1 equal
    stages (the paper's S = 3: four epochs, pi_ref swapped at the end of each of the first three)."""
    if swaps < 0:
        raise ValueError(f"--swaps must be >= 0, got {swaps}")
    if steps < swaps + 1:
        raise ValueError(f"--steps {steps} cannot hold {swaps} reference swaps: at least {swaps + 1} steps needed")
    return steps // (swaps + 1)


def optimizer_steps_per_batch(overrides: list[str]) -> int:
    """i: the x axis of TensorBoard is rollout batches, Fig. 2's is optimizer steps (i per batch)."""
    flag = "--model.iterations_per_batch"
    return int(overrides[overrides.index(flag) + 1]) if flag in overrides else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=list(SUITES), default="rec",
                        help="rec: the committed miniature (beta = 0); paper: Fig. 2's settings (beta, swaps, "
                             "async rows, 5 seeds)")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help=f"rows to run (default: all of the suite): rec: {', '.join(REC_ROWS)}; "
                             f"paper: {', '.join(PAPER_ROWS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (rec), 0-4 (paper)")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (the demo config: 150)")
    parser.add_argument("--eval-every", type=int, default=20, help="optimizer steps between Pass@1 evaluations")
    parser.add_argument("--eval-questions", type=int, default=100, help="held-out questions per evaluation")
    parser.add_argument("--beta", type=float, default=None, help="KL weight of the paper suite (default 0.1)")
    parser.add_argument("--swaps", type=int, default=None, help="reference swaps S of the paper suite (default 3)")
    parser.add_argument("--task", choices=TASKS, default="add_2digit",
                        help="synthetic task of the paper suite (add_3digit: harder, its own warm-start)")
    parser.add_argument("--warm-start-label-smoothing", type=float, default=None,
                        help="paper suite: the warm-start's label smoothing, which sets the starting Pass@1 "
                             "(default 0.07: ~0.22 on add_2digit, ~0.02 on add_3digit, whose answers are longer)")
    parser.add_argument("--sync-engine", choices=("server", "in_process"), default="server",
                        help="paper suite: where the synchronous rows sample (default: a server, like the async rows)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at a time (default: cores for rec, 1 for paper)")
    parser.add_argument("--out", type=Path, default=None, help="default: experiments/results/fig2_<suite>")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill the suite's defaults and refuse bad values, before any model is loaded."""
    suite = SUITES[args.suite]
    args.rows = list(suite.rows) if args.rows is None else args.rows
    unknown = [r for r in args.rows if r not in suite.rows]
    if unknown:
        parser.error(f"unknown row(s) {unknown} for --suite {suite.name}; expected some of {list(suite.rows)}")
    args.seeds = list(suite.seeds) if args.seeds is None else args.seeds
    args.out = suite.out if args.out is None else args.out
    args.jobs = suite.jobs if args.jobs is None else args.jobs
    if suite.name == "rec":
        for name, value in (("--beta", args.beta), ("--swaps", args.swaps)):
            if value is not None:
                parser.error(f"{name} {value}: the rec suite runs at beta = 0 without swaps; use --suite paper")
        if args.task != "add_2digit":
            parser.error(f"--task {args.task}: the rec suite runs on add_2digit; use --suite paper")
        if args.warm_start_label_smoothing is not None:
            parser.error("--warm-start-label-smoothing: the rec suite starts from arith-tiny-sft; use --suite paper")
    smoothing = args.warm_start_label_smoothing
    if smoothing is not None and not 0 <= smoothing < 1:
        parser.error(f"--warm-start-label-smoothing must lie in [0, 1), got {smoothing}")
    args.beta = suite.beta if args.beta is None else args.beta
    args.swaps = suite.swaps if args.swaps is None else args.swaps
    for name, value, low in (("--steps", args.steps, 1), ("--eval-every", args.eval_every, 1),
                             ("--eval-questions", args.eval_questions, 1), ("--jobs", args.jobs, 1)):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    if not args.beta >= 0:
        parser.error(f"--beta must be >= 0, got {args.beta}")
    if args.swaps and not args.beta:
        parser.error(f"--swaps {args.swaps} needs --beta > 0: at beta = 0 there is no reference model to swap")
    try:
        swap_every(args.steps, args.swaps)
    except ValueError as err:
        parser.error(str(err))
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")


def model_for(task: str, label_smoothing: float | None = None) -> tuple[str, dict]:
    """The trainer's (and server's) ``model_name`` for ``task`` and the warm-start's record: the
    ``arith-tiny-sft`` alias for add_2digit at the default label smoothing (the committed runs' model), else the
    cache folder of a warm-start on ``task`` (a plain model directory, built here on first use so no run builds it
    concurrently)."""
    import torch

    from lit_grpo.training.warm_start import (
        ARITH_TINY_SFT,
        WarmStartConfig,
        cached_dir,
        load_warm_started,
        weights_fingerprint,
    )

    config = WarmStartConfig(task=task) if label_smoothing is None else WarmStartConfig(
        task=task, label_smoothing=label_smoothing)
    threads = torch.get_num_threads()
    model, _ = load_warm_started(config)
    torch.set_num_threads(threads)
    name = "arith-tiny-sft" if config == ARITH_TINY_SFT else str(cached_dir(config))
    return name, {"model": name, "task": task, "label_smoothing": config.label_smoothing, "cache_key": config.key(),
                  "fingerprint": weights_fingerprint(model)}


def run_dir(out: Path, row: str, seed: int) -> Path:
    return out / "runs" / f"{row}-seed{seed}"


def overrides(suite: Suite, row: str, args: argparse.Namespace, model_name: str) -> list[str]:
    """The row's command-line overrides of the demo config under the suite's settings (no server URL yet)."""
    extra = list(suite.rows[row])
    if suite.name == "paper":
        extra += ["--model.beta", str(args.beta)]
        if args.swaps:
            extra += ["--ref_swap.every_n_optimizer_steps", str(swap_every(args.steps, args.swaps)),
                      "--ref_swap.max_swaps", str(args.swaps)]
        if model_name != "arith-tiny-sft":
            extra += ["--model.model_name", model_name, "--data.dataset", f"synthetic:{args.task}",
                      "--eval.dataset", f"synthetic:{args.task}",
                      "--data.max_new_tokens", str(MAX_NEW_TOKENS[args.task])]  # eval's is linked to it
        if suite.staleness.get(row):
            extra += ["--data.max_staleness", str(suite.staleness[row])]
    return extra


def uses_server(suite: Suite, row: str, args: argparse.Namespace) -> bool:
    return bool(suite.staleness.get(row)) or (suite.server and args.sync_engine == "server")


def command(row_overrides: list[str], seed: int, folder: Path, args: argparse.Namespace,
            server: MiniatureServer | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "lit_grpo", "fit", "--config", str(CONFIG), "--seed_everything", str(seed),
           "--trainer.default_root_dir", str(folder), "--trainer.logger.init_args.save_dir", str(folder),
           "--trainer.enable_progress_bar", "false", "--model.log_completions_every_n_steps", "null",
           *row_overrides]
    if server is not None:
        options = {"url": server.url, "token_file": str(server.token_file), "timeout_s": 60}
        cmd += ["--data.engine", "server", "--data.engine_options", json.dumps(options)]
    return cmd + ["--trainer.max_steps", str(args.steps), "--eval.every_n_optimizer_steps", str(args.eval_every),
                  "--eval.num_questions", str(args.eval_questions)]


def read_run(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, float]]]:
    """TensorBoard scalars ``{tag: [(step, value)]}`` of a run and the event times ``[(step, wall_time)]`` of its
    Pass@1 evaluations."""
    from lit_grpo.cli.plots import read_scalars, scalar_events

    eval_times = [(e.step, e.wall_time) for e in scalar_events(folder).get(SERIES["pass@1"], [])]
    return read_scalars(folder), eval_times


def run_one(suite: Suite, row: str, seed: int, args: argparse.Namespace, model_name: str,
            baseline: dict[str, str] | None) -> dict:
    """One fit in its own process (one thread; with a rollout server process of its own where the row samples
    from one); its curves read back from TensorBoard."""
    folder = run_dir(args.out, row, seed)
    done = folder / "curves.json"
    if done.exists():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    row_overrides = overrides(suite, row, args, model_name)
    start = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        if uses_server(suite, row, args):
            with MiniatureServer(model_name, folder, baseline) as server:
                start = time.perf_counter()  # the trainer's time, as for the other rows
                proc = subprocess.run(command(row_overrides, seed, folder, args, server), cwd=REPO_ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.run(command(row_overrides, seed, folder, args), cwd=REPO_ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{row} seed {seed} exited with {proc.returncode}; see {folder / 'log.txt'}")
    wall_s = time.perf_counter() - start
    scalars, eval_times = read_run(folder)
    i = optimizer_steps_per_batch(suite.rows[row])
    result = {"row": row, "seed": seed, "overrides": row_overrides, "wall_s": wall_s,
              "series": {name: [(step * i, value) for step, value in scalars.get(tag, [])]
                         for name, tag in SERIES.items()},
              "wall_clock": [(step * i, seconds) for step, seconds in seconds_since_first(eval_times)]}
    done.write_text(json.dumps(result))
    passes = [v for _, v in result["series"]["pass@1"]]
    ends = f"{passes[0]:.2f} -> {passes[-1]:.2f}" if passes else "not evaluated"
    seconds = f", {result['wall_clock'][-1][1]:.0f} s first to last eval" if result["wall_clock"] else ""
    print(f"{row:22} seed {seed}: {wall_s:6.0f} s, Pass@1 {ends}{seconds}", flush=True)
    return result


def plot_rec(results: list[dict], path: Path) -> None:
    """The rec suite's figure: Pass@1 and train reward against optimizer steps, Table 1 rows on top, the REC
    family below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_row = rows_of(results)
    groups = [("GRPO: Table 1 rows and adaptive sync", [r for r in REC_ROWS if r in TABLE1 and r in by_row]),
              ("REC / RED / OPMD / AsymRE at v = 10 (GRPO v10-i1 for reference)",
               [r for r in REC_ROWS if r not in TABLE1 and r in by_row] + (["v10-i1"] if "v10-i1" in by_row else []))]
    groups = [(title, rows) for title, rows in groups if rows]
    fig, axes = plt.subplots(len(groups), 2, figsize=(13, 4.6 * len(groups)), squeeze=False)
    for (title, rows), (ax_pass, ax_reward) in zip(groups, axes):
        for row in rows:
            runs = by_row[row]
            for ax, name, window in ((ax_pass, "pass@1", 1), (ax_reward, "reward", 10)):
                steps, mean, std = mean_std(runs, name)
                if not steps:
                    continue
                mean, std = smooth(mean, window), smooth(std, window)
                style = {"linestyle": "--", "color": "black"} if row == "v10-i1" and title.startswith("REC") else {}
                line, = ax.plot(steps, mean, label=f"{row} ({len(runs)} seeds)", **style)
                ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                alpha=0.15, color=line.get_color())
        ax_pass.set_title(f"{title}\nheld-out Pass@1 (mean +- std over seeds)", fontsize=10)
        ax_reward.set_title("train reward (mean +- std over seeds, moving average of 10 batches)", fontsize=10)
        for ax in (ax_pass, ax_reward):
            ax.set_xlabel("optimizer steps")
            ax.grid(alpha=0.3)
        ax_pass.set_ylim(0, 1)
        ax_pass.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_paper(results: list[dict], path: Path, rows: list[str], settings: dict) -> None:
    """The paper suite's figure: held-out Pass@1 (mean +- std over seeds) against optimizer steps, with the
    reference swaps marked, and against wall-clock seconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_row = rows_of(results)
    fig, (ax_steps, ax_wall) = plt.subplots(1, 2, figsize=(13, 4.8))
    for row in [r for r in rows if r in by_row]:
        runs = by_row[row]
        style = {"linestyle": "--"} if row in STALENESS else {}
        for ax, (x, mean, std) in ((ax_steps, mean_std(runs, "pass@1")), (ax_wall, wall_clock_curve(runs))):
            if not x:
                continue
            line, = ax.plot(x, mean, marker=".", label=f"{row} ({len(runs)} seeds)", **style)
            ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.12,
                            color=line.get_color())
    every = settings.get("swap_every")
    for k in range(1, settings.get("swaps", 0) + 1):
        ax_steps.axvline(k * every, color="grey", linestyle=":", linewidth=1)
    where = f"synthetic:{settings['task']}, beta = {settings['beta']}, S = {settings['swaps']} swaps (dotted)"
    ax_steps.set_title(f"held-out Pass@1 vs optimizer steps\n{where}", fontsize=10)
    ax_wall.set_title("held-out Pass@1 vs wall-clock seconds since the first evaluation\n"
                      "(trainer + rollout server, one thread each; dashed: asynchronous, K = 1)", fontsize=10)
    ax_steps.set_xlabel("optimizer steps")
    ax_wall.set_xlabel("seconds")
    for ax in (ax_steps, ax_wall):
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: how docs/miniature.md's tables name the GRPO rows of both suites
ROW_LABELS = {"v1-i1": "v1-i1 (on-policy)", "v1-i1-mask": "v1-i1 + eq. 8 mask", "v1-i1-eq8": "v1-i1 + eq. 8 as written",
              "v10-i1": "v10-i1 (off-policy)", "v1-i10": "v1-i10 (sample reuse)",
              "v10-i1-maxtv": f"v10-i1 + `max_tv` {MAX_TV}", "v1-i1-k1": "v1-i1, asynchronous K = 1",
              "v10-i1-k1": "v10-i1, asynchronous K = 1"}
DOC = REPO_ROOT / "docs" / "miniature.md"
#: each suite's table in docs/miniature.md: the name of its markers
DOC_TABLES = {"rec": "fig2-miniature-table", "paper": "fig2-paper-table"}


def markdown_row(cells: list[str]) -> str:
    """A Markdown table row; an empty cell is one space (``| |``), as the side-by-side table pads its columns."""
    return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"


def end_pass(s: dict) -> str:
    """Held-out Pass@1 at the last evaluation, mean +- std over seeds, to two decimals."""
    return f"{s['pass@1_end']:.2f} +- {s['pass@1_end_std']:.2f}"


def rec_doc_table(stats: dict[str, dict]) -> str:
    """docs/miniature.md's table of the rec suite (:func:`summary`'s ``stats``): the Table 1 rows on the left, the
    REC family at v = 10 beside them, each row's held-out Pass@1 at the end."""
    left = [[ROW_LABELS[row], end_pass(stats[row])] for row in TABLE1 if row in stats]
    right = [[loss, end_pass(stats[f"{loss}-v10"])] for loss in REC_LOSSES if f"{loss}-v10" in stats]
    blank = ["", ""]
    lines = ["| row | Pass@1 | | row (all at v = 10) | Pass@1 |", "|---|---|---|---|---|"]
    for i in range(max(len(left), len(right))):
        cells = (left[i] if i < len(left) else blank) + [""] + (right[i] if i < len(right) else blank)
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def paper_doc_table(stats: dict[str, dict]) -> str:
    """docs/miniature.md's table of the paper suite: held-out Pass@1 at the end (mean +- std), the worst seed and
    the seconds from the first to the last evaluation (mean +- std). In bold: the highest Pass@1, and the fewest
    seconds among the rows that sample a batch per optimizer step (v1-i10 samples a tenth of them, so its seconds
    are not a rival's)."""
    rows = [row for row in PAPER_ROWS if row in stats]
    best = max(rows, key=lambda row: stats[row]["pass@1_end"])
    timed = [row for row in rows if optimizer_steps_per_batch(PAPER_ROWS[row]) == 1
             and stats[row].get("train_s") is not None]
    fastest = min(timed, key=lambda row: stats[row]["train_s"]) if timed else None
    lines = ["| row | Pass@1 | worst seed | seconds |", "|---|---|---|---|"]
    for row in rows:
        s = stats[row]
        passed = end_pass(s)
        seconds = "-" if s.get("train_s") is None else f"{s['train_s']:.0f} +- {s['train_s_std']:.0f}"
        lines.append(markdown_row([ROW_LABELS[row], f"**{passed}**" if row == best else passed,
                                   f"{s['pass@1_end_min']:.2f}", f"**{seconds}**" if row == fastest else seconds]))
    return "\n".join(lines)


def doc_table(suite: str, stats: dict[str, dict]) -> str:
    """The table docs/miniature.md quotes from ``suite``'s summary."""
    return rec_doc_table(stats) if suite == "rec" else paper_doc_table(stats)


def rows_of(results: list[dict]) -> dict[str, list[dict]]:
    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    return by_row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    suite = SUITES[args.suite]
    args.out.mkdir(parents=True, exist_ok=True)
    curves = args.out / CURVES_FILE
    figure = args.out / ("fig2_miniature.png" if suite.name == "rec" else "fig2_paper.png")
    if args.plot_only:
        saved = read_curves(curves)
        results, settings = saved["runs"], saved.get("settings", {})
    else:
        model_name, warm_start = model_for(args.task, args.warm_start_label_smoothing)
        baseline = parameter_checksums(model_name) if any(uses_server(suite, r, args) for r in args.rows) else None
        settings = {"suite": suite.name, "task": args.task, "beta": args.beta, "swaps": args.swaps,
                    "swap_every": swap_every(args.steps, args.swaps), "steps": args.steps,
                    "eval_every": args.eval_every, "eval_questions": args.eval_questions,
                    "sync_engine": args.sync_engine if suite.server else "in_process", "warm_start": warm_start}
        jobs = [(row, seed) for seed in args.seeds for row in args.rows]
        if suite.server and args.jobs > 1:
            print(f"note: --jobs {args.jobs}: runs share the cores, so their wall-clock times are not comparable")
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda job: run_one(suite, *job, args, model_name, baseline), jobs))
        print(f"{len(jobs)} runs in {time.perf_counter() - start:.0f} s", flush=True)
        if curves.exists():  # keep rows of earlier sweeps that this one did not run
            earlier = read_curves(curves)["runs"]
            keys = {(r["row"], r["seed"]) for r in results}
            results = [r for r in earlier if (r["row"], r["seed"]) not in keys] + results
    stats = summary(results, list(suite.rows))
    write_curves(curves, {"config": str(CONFIG.relative_to(REPO_ROOT)), "max_tv": MAX_TV, "settings": settings,
                          "summary": stats, "runs": results})
    if suite.name == "rec":
        plot_rec(results, figure)
    else:
        plot_paper(results, figure, list(suite.rows), settings)
    print(table(stats))
    written = [str(curves), str(figure)]
    if args.out.resolve() == suite.out.resolve():  # the committed results: the doc quotes them
        write_table(DOC, DOC_TABLES[suite.name], doc_table(suite.name, stats))
        written.append(f"the table in {DOC}")
    print(f"wrote {', '.join(written)}")


if __name__ == "__main__":
    main()
