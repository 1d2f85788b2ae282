"""The tool demo over seeds: ``configs/demo_tools_cpu.yaml`` run with ``seed_everything`` 0, 1 and 2 (the same
``calc-tiny-sft`` warm start; the seed moves the prompt order and the sampling), its held-out Pass@1 and the share of
trajectories that call the calculator, as JSON and one plot.

    OMP_NUM_THREADS=1 python experiments/demo_tools_seeds.py                # runs what is missing, then plots
    python experiments/demo_tools_seeds.py --plot-only

Output in ``--out`` (default ``experiments/results/demo_tools``): ``seeds.json`` (the warm start's record, every
seed's ``eval/pass@1``, ``eval/pass@4``, ``rollout/tool_calls`` and ``rollout/reward_mean`` by step, and each run's
wall time) and
``demo_tools_cpu.png``. The runs themselves go under ``--runs`` (default ``runs/demo_tools_seeds``, not kept in git);
a seed whose run finished is not run again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "demo_tools_cpu.yaml"
TAGS = ("eval/pass@1", "eval/pass@4", "rollout/tool_calls", "rollout/reward_mean")


def run_seed(seed: int, runs: Path) -> float:
    """One fit of the demo with ``seed``, on one thread; its wall seconds."""
    folder = runs / f"seed{seed}"
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "lit_grpo", "fit", "--config", str(CONFIG), "--seed_everything", str(seed),
                    "--trainer.default_root_dir", str(folder), "--trainer.logger.init_args.save_dir", str(folder),
                    "--trainer.enable_progress_bar", "false"],
                   check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    seconds = time.perf_counter() - start
    (folder / "wall_seconds.txt").write_text(f"{seconds:.1f}\n")
    return seconds


def warm_start_record() -> dict:
    """Which calc-tiny-sft the runs start from: its cache key (config, data, torch, transformers, instruction set),
    the instruction set, and the SHA-256 of its weights (``reproduce.py`` rebuilds it from the key)."""
    import torch

    from lit_grpo.training.warm_start import CALC_TINY_SFT, load_warm_started, weights_fingerprint

    model, _ = load_warm_started(CALC_TINY_SFT)
    return {"model": "calc-tiny-sft", "cache_key": CALC_TINY_SFT.key(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "fingerprint": weights_fingerprint(model)}


def curves(folder: Path) -> dict[str, dict[int, float]]:
    from lit_grpo.cli.plots import read_scalars

    scalars = read_scalars(folder)
    return {tag: {int(step): float(value) for step, value in scalars.get(tag, [])} for tag in TAGS}


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for seed, record in results.items():
        for ax, tag in zip(axes, ("eval/pass@1", "rollout/tool_calls", "rollout/reward_mean")):
            points = sorted(record["curves"][tag].items())
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o" if tag.startswith("eval") else None,
                    markersize=3, label=f"seed {seed}")
    titles = ("held-out Pass@1 (100 questions x 4)", "tool calls per trajectory", "train reward (mean)")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("calc-tiny-sft learns to use the calculator: configs/demo_tools_cpu.yaml, 3 seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "demo_tools_seeds")
    parser.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "demo_tools")
    parser.add_argument("--plot-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict = {"warm_start": warm_start_record()}
    for seed in args.seeds:
        folder = args.runs / f"seed{seed}"
        if not args.plot_only and not (folder / "wall_seconds.txt").exists():
            run_seed(seed, args.runs)
        wall = folder / "wall_seconds.txt"
        results[str(seed)] = {"curves": curves(folder),
                              "wall_seconds": float(wall.read_text()) if wall.exists() else None}
    (args.out / "seeds.json").write_text(json.dumps(results, indent=1) + "\n")
    seeds = {seed: record for seed, record in results.items() if seed != "warm_start"}
    plot(seeds, args.out / "demo_tools_cpu.png")
    for seed, record in seeds.items():
        pass_at_1 = sorted(record["curves"]["eval/pass@1"].items())
        print(f"seed {seed}: Pass@1 " + ", ".join(f"{s}: {v:.3f}" for s, v in pass_at_1)
              + (f" ({record['wall_seconds']:.0f} s)" if record["wall_seconds"] else ""))


if __name__ == "__main__":
    main()
