"""Plot a run's TensorBoard scalars to a PNG: ``python -m lit_grpo plots RUN_DIR [RUN_DIR ...] -o out.png``.

Each run directory is searched for event files; one panel per metric, one line per run.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_TAGS = (
    "rollout/reward_mean",
    "eval/pass@1",
    "train/kl",
    "train/loss",
    "rollout/frac_zero_variance",
    "train/clip_high_fraction",
    "train/ratio_max",
    "train/staleness",
    "rollout/completion_length",
)


def scalar_events(run_dir: str | Path) -> dict[str, list[Any]]:
    """TensorBoard's scalar events (``step``, ``wall_time``, ``value``) of every event file under ``run_dir``, by
    tag, in file order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events: dict[str, list[Any]] = {}
    files = sorted(Path(run_dir).rglob("events.out.tfevents.*"))
    if not files:
        raise ValueError(f"no TensorBoard event files under {str(run_dir)!r}")
    for path in files:
        acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            events.setdefault(tag, []).extend(acc.Scalars(tag))
    return events


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every event file under ``run_dir``."""
    return {tag: sorted((e.step, e.value) for e in events) for tag, events in scalar_events(run_dir).items()}


def plot_runs(run_dirs: list[str], out: str, tags: tuple[str, ...] = DEFAULT_TAGS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = {str(d): read_scalars(d) for d in run_dirs}
    present = [t for t in tags if any(t in s for s in runs.values())]
    if not present:
        raise ValueError(f"none of the tags {list(tags)} were logged in {run_dirs}")
    cols = min(3, len(present))
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, present):
        for name, series in runs.items():
            if tag in series:
                steps, values = zip(*series[tag])
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=Path(name).name)
        ax.set_title(tag)
        ax.set_xlabel("training step (rollout batch)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m lit_grpo plots`` (also ``python -m lit_grpo.cli.plots``) on ``argv`` (default: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(prog="python -m lit_grpo plots", description=__doc__)
    parser.add_argument("runs", nargs="+", help="run directories containing TensorBoard event files")
    parser.add_argument("-o", "--out", default="grpo_run.png")
    parser.add_argument("--tags", nargs="*", default=list(DEFAULT_TAGS))
    args = parser.parse_args(argv)
    print(plot_runs(args.runs, args.out, tuple(args.tags)))


if __name__ == "__main__":
    main()
