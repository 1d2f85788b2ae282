"""Which sampler correction holds at which staleness: a one-machine study on the demo's task (issue "off-policy,
complete").

Every run is ``python -m lit_grpo fit --config configs/demo_cpu.yaml`` from the same warm start
(``arith-tiny-sft``), beta = 0, one thread, with a setting (the columns: how stale or how mismatched the sampler
is) and a row (the correction). Settings:

- ``on-policy``: v = 1 (the in-process engine gets the weights every step);
- ``v8``: the engine gets the weights every 8 rollout batches (alpha lags up to 7 optimizer steps);
- ``k2-v4``: a rollout server process next to the trainer, ``data.max_staleness: 2`` and v = 4 (staleness up to
  5 steps, and the batches sampled before the last push carry only the server's log-probs);
- ``severe``: v = 32 at twice the learning rate (1e-3): where plain GRPO degrades here (``--severe`` documents
  how it was chosen);
- ``bf16``: v = 1, but the in-process engine samples under bf16 autocast while the trainer trains in fp32
  (``data.engine_options.sampler_autocast: bf16``): a real mu != pi gap, the CPU's stand-in for vLLM in bf16
  against an fp32 trainer.

Rows: ``none``; ``exact`` (eq. 6 with r' = pi_k / alpha, ``loss_options.grpo.exact_ref_ratio``); ``tis`` (token
truncation, TRL's bound 3); ``mis`` (sequence mask, TRL's default mode); ``icepop``; ``opsm`` (DeepSeek-V3.2's
off-policy sequence mask); ``dppo_tv``; ``maxtv`` (``sync.max_tv`` 0.01: an adaptive sync, not a correction;
only where v > 1). TIS, MIS and IcePop run with ``old_policy: proximal`` (pi_old = pi_k, as verl's decoupled mode
and AReaL: with ``decoupled``, TRL's pi_old, their weight alpha / mu is 1 to rounding wherever alpha is recomputed,
so they would repeat ``none`` except in the bf16 column), OPSM and DPPO-TV with ``old_policy: decoupled`` (the clip
stays around alpha, as DeepSeek-V3.2 and prime-rl use their masks);
``dppo_loss``: DPPO's Binary-TV as the loss (``model.loss: dppo_tv``, the mask instead of the clip).

Output in ``--out``: ``curves.json.gz`` (settings, per-cell summaries, every run's raw curves: held-out Pass@1,
train reward, TV, mismatch, masked and truncated fractions, evaluation times; compact gzip'd JSON, see
``curves_file.py``) and ``corrections_study.png``; the script prints the Markdown tables, and with the default
``--out`` writes them into docs/corrections-study.md (between its ``corrections-pass-table`` and
``corrections-diagnostics-table`` markers). Finished runs are kept (each in ``runs/<cell>/curves.json``), so an
interrupted sweep resumes.

    python experiments/corrections_study.py                      # the committed grid, 3 seeds
    python experiments/corrections_study.py --plot-only
    python experiments/corrections_study.py --settings v8 --rows none tis --seeds 0 --steps 10 --out /tmp/smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from curves_file import CURVES_FILE, read_curves, write_curves
from doc_tables import write_table
from fig2_miniature import model_for, read_run
from miniature_server import MiniatureServer, parameter_checksums
from miniature_stats import mean_std, seconds_since_first, wall_clock_curve

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "configs" / "demo_cpu.yaml"
OUT = REPO_ROOT / "experiments" / "results" / "corrections_study"
DOC = REPO_ROOT / "docs" / "corrections-study.md"  # its tables are written from OUT's runs
MAX_TV = 0.01

#: the columns: overrides of the demo config, and whether the run samples from a server process of its own
SETTINGS: dict[str, tuple[list[str], bool]] = {
    "on-policy": ([], False),
    "v8": (["--sync.every_n_batches", "8"], False),
    "k2-v4": (["--sync.every_n_batches", "4", "--data.max_staleness", "2"], True),
    "severe": (["--sync.every_n_batches", "32", "--model.optimizer.lr", "1e-3"], False),
    "bf16": (["--data.engine_options.sampler_autocast", "bf16"], False),
}


def correction(mode: str, old_policy: str) -> list[str]:
    return ["--model.correction.mode", mode, "--model.correction.old_policy", old_policy]


#: the rows: the correction's overrides. The weights (TIS, MIS, IcePop) against pi_k (``proximal``: eq. 6's ratio
#: becomes pi / pi_k, the weight pi_k / mu carries the lag); the masks on pi_theta against mu (OPSM, DPPO) as
#: DeepSeek-V3.2 and prime-rl apply them, on top of the clip around the sampling policy (``decoupled``)
ROWS: dict[str, list[str]] = {
    "none": [],
    "exact": ["--model.loss_options.grpo.exact_ref_ratio", "true"],
    "tis": correction("token_truncate", "proximal"),
    "mis": correction("sequence_mask", "proximal"),
    "icepop": correction("icepop", "proximal"),
    "opsm": correction("off_policy_mask", "decoupled"),
    "dppo_tv": correction("dppo_tv", "decoupled"),
    # DPPO as its authors use it: the trust-region mask instead of the clip (the dppo_tv loss), where the mask
    # above, on top of eq. 6's clip at eps = delta = 0.2, can drop only tokens the clip already stops
    "dppo_loss": ["--model.loss", "dppo_tv"],
    "maxtv": ["--sync.max_tv", str(MAX_TV)],
}
#: cells left out of the grid, and why (the table says so)
SKIPPED = {("on-policy", "maxtv"): "v = 1 already syncs every step", ("bf16", "maxtv"): "v = 1 syncs every step",
           ("on-policy", "exact"): "r' = pi_k / alpha = 1 at v = 1", ("bf16", "exact"): "alpha is pi_k at v = 1"}
#: the committed grid (the cells SKIPPED names left out): every row where staleness grows (v8, severe); at v = 1
#: every correction's weight is 1 to rounding (tests/test_correction_module.py checks the gradient is the same), so
#: on-policy runs one of them; the server and bf16 columns run the rows that can act there, within the machine's
#: time (docs/corrections-study.md)
GRID: dict[str, list[str]] = {
    "on-policy": ["none", "tis"],
    "v8": list(ROWS),
    "k2-v4": ["none", "tis", "mis", "opsm", "maxtv"],
    "severe": list(ROWS),
    "bf16": ["none", "tis", "mis", "icepop"],
}

SERIES = {"pass@1": "eval/pass@1", "reward": "rollout/reward_mean", "tv_pi_alpha": "tv/pi_alpha",
          "tv_pik_alpha": "tv/pik_alpha", "staleness": "train/staleness", "mismatch_k3": "mismatch/k3_kl",
          "mismatch_abs": "mismatch/abs_mean", "masked": "correction/masked_fraction",
          "truncated": "correction/truncated_fraction", "clip_low": "train/clip_low_fraction",
          "clip_high": "train/clip_high_fraction", "sync_by_tv": "sync/by_tv"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), metavar="SETTING")
    parser.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                        help="default: each setting's rows of the committed grid (GRID)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=20, help="optimizer steps between Pass@1 evaluations")
    parser.add_argument("--eval-questions", type=int, default=64, help="held-out questions per evaluation (x 8)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (a server row takes two processes)")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args(argv)
    for name, chosen, known in (("--settings", args.settings, SETTINGS), ("--rows", args.rows or [], ROWS)):
        unknown = [c for c in chosen if c not in known]
        if unknown:
            parser.error(f"{name}: unknown {unknown}; expected some of {list(known)}")
    for name, value in (("--steps", args.steps), ("--eval-every", args.eval_every),
                        ("--eval-questions", args.eval_questions), ("--jobs", args.jobs)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    return args


def cells(args: argparse.Namespace) -> list[tuple[str, str]]:
    return [(s, r) for s in args.settings for r in (args.rows or GRID[s]) if (s, r) not in SKIPPED]


def run_one(setting: str, row: str, seed: int, args: argparse.Namespace, model_name: str,
            baseline: dict[str, str] | None) -> dict:
    folder = args.out / "runs" / f"{setting}-{row}-seed{seed}"
    done = folder / "curves.json"
    if done.exists():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    setting_overrides, server = SETTINGS[setting]
    cmd = [sys.executable, "-m", "lit_grpo", "fit", "--config", str(CONFIG), "--seed_everything", str(seed),
           "--trainer.default_root_dir", str(folder), "--trainer.logger.init_args.save_dir", str(folder),
           "--trainer.enable_progress_bar", "false", "--model.log_completions_every_n_steps", "null",
           *setting_overrides, *ROWS[row],
           "--trainer.max_steps", str(args.steps), "--eval.every_n_optimizer_steps", str(args.eval_every),
           "--eval.num_questions", str(args.eval_questions)]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        if server:
            with MiniatureServer(model_name, folder, baseline) as srv:
                start = time.perf_counter()
                options = {"url": srv.url, "token_file": str(srv.token_file), "timeout_s": 60}
                proc = subprocess.run(cmd + ["--data.engine", "server", "--data.engine_options", json.dumps(options)],
                                      cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{setting}/{row} seed {seed} exited with {proc.returncode}; see {folder / 'log.txt'}")
    wall_s = time.perf_counter() - start
    scalars, eval_times = read_run(folder)
    result = {"setting": setting, "row": row, "seed": seed, "wall_s": wall_s,
              "series": {name: scalars.get(tag, []) for name, tag in SERIES.items()},
              "wall_clock": seconds_since_first(eval_times)}
    done.write_text(json.dumps(result))
    passes = [v for _, v in result["series"]["pass@1"]]
    print(f"{setting:9} {row:8} seed {seed}: {wall_s:5.0f} s, Pass@1 {passes[0]:.2f} -> {passes[-1]:.2f}", flush=True)
    return result


def deduplicated(run: dict) -> dict:
    """A run whose folder holds the event files of an interrupted attempt too: each series keeps the last value
    logged at each step, and the evaluation times count from the last attempt's first evaluation."""
    series = {name: sorted(dict(points).items()) for name, points in run["series"].items()}
    clock = dict(run.get("wall_clock", []))
    start = clock.get(min(clock), 0.0) if clock else 0.0
    return {**run, "series": series, "wall_clock": sorted((step, t - start) for step, t in clock.items())}


def mean_of(run: dict, name: str) -> float | None:
    values = [v for _, v in run["series"].get(name, [])]
    return statistics.fmean(values) if values else None


def summarise(results: list[dict]) -> dict[str, dict[str, dict]]:
    """Per setting and row: Pass@1 at the end (mean, std, worst seed), its best, the run's mean TV(pi, alpha),
    mismatch k3 KL, masked and truncated fractions, and seconds from the first to the last evaluation."""
    out: dict[str, dict[str, dict]] = {}
    for r in results:
        out.setdefault(r["setting"], {}).setdefault(r["row"], {"runs": []})["runs"].append(r)
    for rows in out.values():
        for cell in rows.values():
            runs = cell.pop("runs")
            last = [r["series"]["pass@1"][-1][1] for r in runs]
            first = [r["series"]["pass@1"][0][1] for r in runs]

            def avg(name: str, runs: list[dict] = runs) -> float | None:
                values = [m for m in (mean_of(r, name) for r in runs) if m is not None]
                return statistics.fmean(values) if values else None

            cell.update({"seeds": len(runs), "pass@1_start": statistics.fmean(first),
                         "pass@1_end": statistics.fmean(last), "pass@1_end_std": statistics.pstdev(last),
                         "pass@1_end_min": min(last),
                         "pass@1_best": statistics.fmean(max(v for _, v in r["series"]["pass@1"]) for r in runs),
                         "tv_pi_alpha": avg("tv_pi_alpha"), "mismatch_k3": avg("mismatch_k3"),
                         "masked": avg("masked"), "truncated": avg("truncated"),
                         "train_s": statistics.fmean(r["wall_clock"][-1][1] for r in runs if r["wall_clock"])})
    return out


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def pass_table(stats: dict[str, dict[str, dict]], settings: list[str], rows: list[str]) -> str:
    """A row per correction, a column per setting: held-out Pass@1 at the end (mean ± std over seeds, worst seed in
    brackets); a cell SKIPPED leaves out says why."""
    lines = ["| correction | " + " | ".join(settings) + " |", "|---|" + "---:|" * len(settings)]
    for row in rows:
        cells_ = []
        for setting in settings:
            cell = stats.get(setting, {}).get(row)
            if cell is None:
                why = SKIPPED.get((setting, row))
                cells_.append(f"n/a ({why})" if why else "-")
            else:
                cells_.append(f"{cell['pass@1_end']:.2f} ± {cell['pass@1_end_std']:.2f} "
                              f"[{cell['pass@1_end_min']:.2f}]")
        lines.append(f"| {row} | " + " | ".join(cells_) + " |")
    return "\n".join(lines)


def diagnostics_table(stats: dict[str, dict[str, dict]], settings: list[str], rows: list[str]) -> str:
    """A row per cell run: its mean TV(pi, alpha), mismatch, masked and truncated fractions, and seconds."""
    lines = ["| setting | correction | TV(pi, alpha) | k3 KL(mu, pi_k) | masked | truncated | train + eval s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for setting in settings:
        for row in rows:
            cell = stats.get(setting, {}).get(row)
            if cell is not None:
                lines.append(f"| {setting} | {row} | {fmt(cell['tv_pi_alpha'], '.4f')} | "
                             f"{fmt(cell['mismatch_k3'], '.2e')} | {fmt(cell['masked'], '.4f')} | "
                             f"{fmt(cell['truncated'], '.4f')} | {cell['train_s']:.0f} |")
    return "\n".join(lines)


def table(stats: dict[str, dict[str, dict]], settings: list[str], rows: list[str]) -> str:
    """Both tables docs/corrections-study.md quotes: held-out Pass@1 per correction and setting, then the
    per-cell diagnostics."""
    return pass_table(stats, settings, rows) + "\n\n" + diagnostics_table(stats, settings, rows)


def ordered(stats: dict[str, dict[str, dict]]) -> tuple[list[str], list[str]]:
    """The settings and rows that have runs, in the order of SETTINGS and ROWS."""
    settings = [s for s in SETTINGS if s in stats]
    return settings, [r for r in ROWS if any(r in stats[s] for s in settings)]


def doc_tables(stats: dict[str, dict[str, dict]]) -> dict[str, str]:
    """docs/corrections-study.md's two tables, by the name of their markers, from :func:`summarise`'s ``stats``."""
    settings, rows = ordered(stats)
    return {"corrections-pass-table": pass_table(stats, settings, rows),
            "corrections-diagnostics-table": diagnostics_table(stats, settings, rows)}


def plot(results: list[dict], path: Path, settings: list[str], rows: list[str]) -> None:
    """A column per setting: held-out Pass@1 against optimizer steps (top) and against seconds (bottom), a line
    per correction, mean ± std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(settings), figsize=(4.2 * len(settings), 8), squeeze=False)
    colors = dict(zip(ROWS, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2))
    for col, setting in enumerate(settings):
        for row in rows:
            runs = [r for r in results if r["setting"] == setting and r["row"] == row]
            if not runs:
                continue
            style = {"color": colors[row], "linestyle": "--" if row == "none" else "-", "marker": "."}
            for ax, (x, mean, std) in ((axes[0][col], mean_std(runs, "pass@1")),
                                       (axes[1][col], wall_clock_curve(runs))):
                if not x:
                    continue
                ax.plot(x, mean, label=row, **style)
                ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)],
                                alpha=0.08, color=colors[row])
        axes[0][col].set_title(f"{setting}: held-out Pass@1 vs steps", fontsize=10)
        axes[1][col].set_title(f"{setting}: vs seconds since the first eval", fontsize=10)
        axes[0][col].set_xlabel("optimizer steps")
        axes[1][col].set_xlabel("seconds")
        for ax in axes[:, col]:
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
    handles = {row: plt.Line2D([], [], color=colors[row], linestyle="--" if row == "none" else "-", marker=".")
               for row in rows}
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=len(handles), fontsize=9)
    fig.suptitle("Sampler corrections by staleness and mismatch (demo task, mean ± std over seeds)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves = args.out / CURVES_FILE
    if args.plot_only:
        saved = read_curves(curves)
        results, settings = saved["runs"], saved["settings"]
    else:
        model_name, warm_start = model_for("add_2digit")
        grid = cells(args)
        baseline = parameter_checksums(model_name) if any(SETTINGS[s][1] for s, _ in grid) else None
        settings = {"steps": args.steps, "eval_every": args.eval_every, "eval_questions": args.eval_questions,
                    "jobs": args.jobs, "warm_start": warm_start, "grid": grid}
        jobs = [(s, r, seed) for seed in args.seeds for s, r in grid]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda job: run_one(*job, args, model_name, baseline), jobs))
        settings["sweep_seconds"] = time.perf_counter() - start
        print(f"{len(jobs)} runs in {settings['sweep_seconds']:.0f} s", flush=True)
        if curves.exists():  # keep cells of earlier sweeps that this one did not run
            earlier = read_curves(curves)["runs"]
            keys = {(r["setting"], r["row"], r["seed"]) for r in results}
            results = [r for r in earlier if (r["setting"], r["row"], r["seed"]) not in keys] + results
    results = [deduplicated(r) for r in results]
    stats = summarise(results)
    order_s, order_r = ordered(stats)
    write_curves(curves, {"config": str(CONFIG.relative_to(REPO_ROOT)), "max_tv": MAX_TV, "settings": settings,
                          "summary": stats, "runs": results})
    figure = args.out / "corrections_study.png"
    plot(results, figure, order_s, order_r)
    print(table(stats, order_s, order_r))
    written = [str(curves), str(figure)]
    if args.out.resolve() == OUT.resolve():  # the committed results: the doc quotes them
        for name, text in doc_tables(stats).items():
            write_table(DOC, name, text)
        written.append(f"the tables in {DOC}")
    print(f"wrote {', '.join(written)}")


if __name__ == "__main__":
    main()
