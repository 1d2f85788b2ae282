"""A miniature of the paper's Fig. 2 on one CPU machine: the Table 1 rows, an adaptive sync and the REC family on
the synthetic task of ``configs/demo_cpu.yaml``, several seeds each.

Every run is ``python -m lit_grpo fit --config configs/demo_cpu.yaml`` with the row's overrides, a seed
(``seed_everything``: prompts, sampling, and the RED-Drop choices; the policy starts from the same warm-start in
every run), one thread, and its own folder. Rows:

- Table 1: ``v1-i1`` (on-policy GRPO), ``v1-i1-mask`` (eq. 8: zero-variance groups masked), ``v10-i1`` (the
  paper's off-policy GRPO: the rollout weights lag up to 9 optimizer steps), ``v1-i10`` (10 SGD iterations on each
  rollout batch, so a tenth of the rollouts for the same optimizer steps);
- ``v10-i1-maxtv``: ``WeightSync(every_n_batches=10, max_tv=DELTA)``, sync early when the measured TV between
  the policy and the rollout weights exceeds DELTA (Theorem 1's term, see the README);
- the REC / RED / OPMD / AsymRE losses of ``lit_grpo.math.rec`` at ``v = 10`` (their off-policy setting; the
  second paper syncs every 16 steps of a longer run), next to GRPO's ``v10-i1``.

The x axis is optimizer steps (``trainer.global_step``), as in Fig. 2. Output, in ``--out``:
``curves.json`` (every run's raw ``(step, value)`` series of held-out Pass@1, train reward, TV and syncs, plus
the wall time), ``fig2_miniature.png`` (mean +- std over seeds, one curve per row: Pass@1 and train reward, the
Table 1 rows on top and the REC family below) and the runs' TensorBoard folders. Runs already finished in
``--out`` are kept, so an interrupted sweep picks up where it stopped.

    python experiments/fig2_miniature.py                              # all rows, seeds 0 1 2, 2 runs at a time
    python experiments/fig2_miniature.py --rows v1-i1 v10-i1 --seeds 0 --steps 40   # a quick look
    python experiments/fig2_miniature.py --plot-only                  # redraw from curves.json
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

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = REPO_ROOT / "configs" / "demo_cpu.yaml"
OUT = REPO_ROOT / "experiments" / "results" / "fig2_miniature"
MAX_TV = 0.01  # the adaptive row's delta; one on-policy step moves tv/pi_alpha by ~0.002 here (0.01 early on)

TABLE1: dict[str, list[str]] = {
    "v1-i1": [],
    "v1-i1-mask": ["--model.mask_zero_variance", "true"],
    "v10-i1": ["--sync.every_n_batches", "10"],
    "v1-i10": ["--model.iterations_per_batch", "10"],
    "v10-i1-maxtv": ["--sync.every_n_batches", "10", "--sync.max_tv", str(MAX_TV)],
}
REC_LOSSES = ("rec_oneside_nois", "rec_oneside_is", "rec_twoside_is", "rec_ring", "red_drop", "red_weight",
              "opmd", "asymre")
ROWS: dict[str, list[str]] = TABLE1 | {
    f"{loss}-v10": ["--model.loss", loss, "--sync.every_n_batches", "10"] for loss in REC_LOSSES
}
SERIES = {"pass@1": "eval/pass@1", "reward": "rollout/reward_mean", "tv_pi_alpha": "tv/pi_alpha",
          "tv_pik_alpha": "tv/pik_alpha", "staleness": "train/staleness", "sync_by_tv": "sync/by_tv"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS), metavar="ROW",
                        help=f"rows to run (default: all): {', '.join(ROWS)}")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per run (the demo config: 150)")
    parser.add_argument("--eval-every", type=int, default=20, help="optimizer steps between Pass@1 evaluations")
    parser.add_argument("--jobs", type=int, default=max(1, os.cpu_count() or 1), help="runs at a time, 1 thread each")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--plot-only", action="store_true")
    return parser.parse_args(argv)


def run_dir(out: Path, row: str, seed: int) -> Path:
    return out / "runs" / f"{row}-seed{seed}"


def command(row: str, seed: int, folder: Path, args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "lit_grpo", "fit", "--config", str(CONFIG), "--seed_everything", str(seed),
           "--trainer.default_root_dir", str(folder), "--trainer.logger.init_args.save_dir", str(folder),
           "--trainer.enable_progress_bar", "false", "--model.log_completions_every_n_steps", "null", *ROWS[row]]
    return cmd + ["--trainer.max_steps", str(args.steps), "--eval.every_n_optimizer_steps", str(args.eval_every)]


def run_one(row: str, seed: int, args: argparse.Namespace) -> dict:
    """One fit in its own process (one thread); its curves read back from TensorBoard."""
    from lit_grpo.plots import read_scalars

    folder = run_dir(args.out, row, seed)
    done = folder / "curves.json"
    if done.exists():
        return json.loads(done.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        proc = subprocess.run(command(row, seed, folder, args), cwd=REPO_ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{row} seed {seed} exited with {proc.returncode}; see {folder / 'log.txt'}")
    scalars = read_scalars(folder)
    # TensorBoard's x axis is Lightning's logging step, one per rollout batch; Fig. 2's is optimizer steps
    i = int(ROWS[row][ROWS[row].index("--model.iterations_per_batch") + 1]) if "--model.iterations_per_batch" in \
        ROWS[row] else 1
    result = {"row": row, "seed": seed, "overrides": ROWS[row], "wall_s": time.perf_counter() - start,
              "series": {name: [(step * i, value) for step, value in scalars.get(tag, [])]
                         for name, tag in SERIES.items()}}
    done.write_text(json.dumps(result))
    passes = [v for _, v in result["series"]["pass@1"]]
    ends = f"{passes[0]:.2f} -> {passes[-1]:.2f}" if passes else "not evaluated"
    print(f"{row:22} seed {seed}: {result['wall_s']:6.0f} s, Pass@1 {ends}", flush=True)
    return result


def mean_std(runs: list[dict], name: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and std over seeds at the steps every run logged."""
    per_run = [dict(r["series"][name]) for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    values = [[p[s] for p in per_run] for s in steps]
    return (steps, [statistics.fmean(v) for v in values],
            [statistics.pstdev(v) if len(v) > 1 else 0.0 for v in values])


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the train reward of one batch is noisy)."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_row: dict[str, list[dict]] = {}
    for r in results:
        by_row.setdefault(r["row"], []).append(r)
    groups = [("GRPO: Table 1 rows and adaptive sync", [r for r in ROWS if r in TABLE1 and r in by_row]),
              ("REC / RED / OPMD / AsymRE at v = 10 (GRPO v10-i1 for reference)",
               [r for r in ROWS if r not in TABLE1 and r in by_row] + (["v10-i1"] if "v10-i1" in by_row else []))]
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


def summary(results: list[dict]) -> dict[str, dict]:
    """Per row: Pass@1 at the first and last evaluation, and wall time (mean +- std over seeds)."""
    out: dict[str, dict] = {}
    for row in ROWS:
        runs = [r for r in results if r["row"] == row]
        if not runs:
            continue
        first = [r["series"]["pass@1"][0][1] for r in runs if r["series"]["pass@1"]]
        last = [r["series"]["pass@1"][-1][1] for r in runs if r["series"]["pass@1"]]
        best = [max(v for _, v in r["series"]["pass@1"]) for r in runs if r["series"]["pass@1"]]
        # sync/by_tv is a running count: its last value is the run's total
        syncs_by_tv = [r["series"]["sync_by_tv"][-1][1] if r["series"]["sync_by_tv"] else 0.0 for r in runs]
        out[row] = {"seeds": len(runs), "pass@1_start": statistics.fmean(first), "pass@1_end": statistics.fmean(last),
                    "pass@1_end_std": statistics.pstdev(last), "pass@1_best": statistics.fmean(best),
                    "syncs_by_tv": statistics.fmean(syncs_by_tv),
                    "wall_s": statistics.fmean(r["wall_s"] for r in runs)}
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    curves = args.out / "curves.json"
    if args.plot_only:
        results = json.loads(curves.read_text())["runs"]
    else:
        jobs = [(row, seed) for seed in args.seeds for row in args.rows]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            results = list(pool.map(lambda job: run_one(*job, args), jobs))
        print(f"{len(jobs)} runs in {time.perf_counter() - start:.0f} s", flush=True)
        if curves.exists():  # keep rows of earlier sweeps that this one did not run
            earlier = json.loads(curves.read_text())["runs"]
            keys = {(r["row"], r["seed"]) for r in results}
            results = [r for r in earlier if (r["row"], r["seed"]) not in keys] + results
    table = summary(results)
    curves.write_text(json.dumps({"config": str(CONFIG.relative_to(REPO_ROOT)), "max_tv": MAX_TV,
                                  "summary": table, "runs": results}, indent=1))
    plot(results, args.out / "fig2_miniature.png")
    print(f"{'row':22} {'seeds':>5} {'Pass@1 start':>12} {'end (mean+-std)':>16} {'best':>6} {'wall s':>7}")
    for row, s in table.items():
        print(f"{row:22} {s['seeds']:>5} {s['pass@1_start']:>12.3f} {s['pass@1_end']:>9.3f} +- "
              f"{s['pass@1_end_std']:.3f} {s['pass@1_best']:>6.3f} {s['wall_s']:>7.0f}")
    print(f"wrote {curves} and {args.out / 'fig2_miniature.png'}")


if __name__ == "__main__":
    main()
