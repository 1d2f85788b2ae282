"""Plot runs' TensorBoard scalars to a PNG: ``python -m lit_grpo plots RUN_DIR [RUN_DIR ...] -o out.png``.

Each run directory is searched for event files; one panel per metric, one labelled line per version: each folder
that holds event files (a logger's ``version_N``) is a series of its own, so a run folder with a first run and a
rerun draws two lines, not one that zig-zags between them. The event files of one folder are read together, in
order, as TensorBoard reads them: a run resumed with ``--ckpt_path last`` writes into the version it resumes with a
``purge_step`` (``lit_grpo.cli.resume``), so what the stopped run logged after its checkpoint is dropped and the
version is one continued line.
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
EVENT_FILES = "events.out.tfevents.*"


def version_dirs(run_dir: str | Path) -> list[Path]:
    """The folders under ``run_dir`` (itself included) that hold TensorBoard event files, sorted."""
    found = sorted({path.parent for path in Path(run_dir).rglob(EVENT_FILES)})
    if not found:
        raise ValueError(f"no TensorBoard event files under {str(run_dir)!r}")
    return found


def folder_events(folder: str | Path) -> dict[str, list[Any]]:
    """The scalar events (``step``, ``wall_time``, ``value``) of the event files directly in ``folder``, by tag,
    read in file order by one accumulator, so a restart's ``purge_step`` drops the events it supersedes."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: list(acc.Scalars(tag)) for tag in acc.Tags().get("scalars", [])}


def scalar_events(run_dir: str | Path) -> dict[str, list[Any]]:
    """TensorBoard's scalar events of every version under ``run_dir``, by tag, version after version."""
    events: dict[str, list[Any]] = {}
    for folder in version_dirs(run_dir):
        for tag, found in folder_events(folder).items():
            events.setdefault(tag, []).extend(found)
    return events


def read_scalars(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every version under ``run_dir``, together."""
    return {tag: sorted((e.step, e.value) for e in events) for tag, events in scalar_events(run_dir).items()}


def read_series(run_dirs: Sequence[str | Path]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """One series per version: ``{label: {tag: [(step, value), ...]}}``. A run folder with one version is labelled
    by its name (by its path as given when another run folder has that name); each version of a folder with
    several by that label and the version's path under the folder."""
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    names = [Path(d).name for d in run_dirs]
    for run_dir, name in zip(run_dirs, names):
        run = Path(run_dir)
        folders = version_dirs(run)
        name = name if names.count(name) == 1 else str(run_dir)
        for folder in folders:
            label = name if len(folders) == 1 else f"{name}/{folder.relative_to(run).as_posix()}"
            series[label] = {tag: sorted((e.step, e.value) for e in events)
                             for tag, events in folder_events(folder).items()}
    return series


def runs_figure(run_dirs: Sequence[str | Path], tags: tuple[str, ...] = DEFAULT_TAGS) -> Any:  # noqa: ANN401
    """The matplotlib figure of ``run_dirs``: a panel per tag of ``tags`` that was logged, a labelled line per
    version (:func:`read_series`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = read_series(run_dirs)
    present = [t for t in tags if any(t in s for s in series.values())]
    if not present:
        raise ValueError(f"none of the tags {list(tags)} were logged in {[str(d) for d in run_dirs]}")
    cols = min(3, len(present))
    rows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.2 * rows), squeeze=False)
    for ax, tag in zip(axes.flat, present):
        for label, scalars in series.items():
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                ax.plot(steps, values, marker="o" if len(steps) < 20 else None, label=label)
        ax.set_title(tag)
        ax.set_xlabel("training step (rollout batch)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_runs(run_dirs: list[str], out: str, tags: tuple[str, ...] = DEFAULT_TAGS) -> Path:
    """:func:`runs_figure` written to ``out`` (a PNG)."""
    import matplotlib.pyplot as plt

    fig = runs_figure(run_dirs, tags)
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
