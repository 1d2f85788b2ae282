"""Seed statistics of the miniature Fig. 2 runs (``fig2_miniature.py``): curves averaged over seeds, against
optimizer steps and against wall-clock seconds, per-row summaries and their full Markdown table (docs/miniature.md
quotes a shorter one, ``doc_table`` of ``fig2_miniature.py``).

A run is the dict ``fig2_miniature.py`` writes to ``curves.json.gz``: ``{"row", "seed", "wall_s", "series": {name:
[(step, value), ...]}, "wall_clock": [(step, seconds), ...]}``, where ``wall_clock`` gives, for every Pass@1
evaluation, the seconds since the first one (older runs lack it).
"""

from __future__ import annotations

import statistics


def mean_std(runs: list[dict], name: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and population std over seeds of series ``name`` at the steps every run logged."""
    per_run = [dict(r["series"][name]) for r in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run))) if per_run else []
    values = [[p[s] for p in per_run] for s in steps]
    return (steps, [statistics.fmean(v) for v in values],
            [statistics.pstdev(v) if len(v) > 1 else 0.0 for v in values])


def wall_clock_curve(runs: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Pass@1 against wall-clock seconds, over seeds: at every evaluation step all runs share, the mean seconds
    since the first evaluation (x), and the mean and std of Pass@1 (y). Runs without wall-clock times are left
    out; ``([], [], [])`` when none has them."""
    timed = [r for r in runs if r.get("wall_clock")]
    if not timed:
        return [], [], []
    seconds = [dict(r["wall_clock"]) for r in timed]
    steps, mean, std = mean_std(timed, "pass@1")
    keep = [i for i, s in enumerate(steps) if all(s in t for t in seconds)]
    x = [statistics.fmean(t[steps[i]] for t in seconds) for i in keep]
    return x, [mean[i] for i in keep], [std[i] for i in keep]


def seconds_since_first(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """``(step, wall_time)`` pairs (e.g. TensorBoard event times of the Pass@1 evaluations) as seconds since the
    earliest one, in step order."""
    if not points:
        return []
    start = min(t for _, t in points)
    return [(step, t - start) for step, t in sorted(points)]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the train reward of one batch is noisy)."""
    return [statistics.fmean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def summary(results: list[dict], rows: list[str]) -> dict[str, dict]:
    """Per row (in ``rows`` order, rows without runs left out): Pass@1 at the first and last evaluation (mean,
    std and worst seed at the end), the best Pass@1 of each run averaged, syncs triggered by TV, the seconds from
    the first to the last evaluation and the whole run's wall time (mean and std over seeds)."""
    out: dict[str, dict] = {}
    for row in rows:
        runs = [r for r in results if r["row"] == row and r["series"]["pass@1"]]
        if not runs:
            continue
        first = [r["series"]["pass@1"][0][1] for r in runs]
        last = [r["series"]["pass@1"][-1][1] for r in runs]
        best = [max(v for _, v in r["series"]["pass@1"]) for r in runs]
        # sync/by_tv is a running count: its last value is the run's total
        syncs_by_tv = [r["series"]["sync_by_tv"][-1][1] if r["series"].get("sync_by_tv") else 0.0 for r in runs]
        train_s = [r["wall_clock"][-1][1] for r in runs if r.get("wall_clock")]
        wall = [r["wall_s"] for r in runs]
        out[row] = {"seeds": len(runs), "pass@1_start": statistics.fmean(first), "pass@1_end": statistics.fmean(last),
                    "pass@1_end_std": statistics.pstdev(last), "pass@1_end_min": min(last),
                    "pass@1_best": statistics.fmean(best), "syncs_by_tv": statistics.fmean(syncs_by_tv),
                    "train_s": statistics.fmean(train_s) if train_s else None,
                    "train_s_std": statistics.pstdev(train_s) if train_s else None,
                    "wall_s": statistics.fmean(wall), "wall_s_std": statistics.pstdev(wall)}
    return out


TABLE_HEADER = ("| row | seeds | Pass@1 start | Pass@1 end (mean ± std) | worst seed | best (mean) "
                "| train + eval s (mean ± std) |\n|---|---:|---:|---:|---:|---:|---:|")


def table_row(row: str, s: dict) -> str:
    """One Markdown table row of :func:`summary`'s entry ``s``: Pass@1 to 3 decimals, seconds to whole ones
    (``-`` when the runs carry no wall-clock times)."""
    seconds = f"{s['train_s']:.0f} ± {s['train_s_std']:.0f}" if s.get("train_s") is not None else "-"
    return (f"| {row} | {s['seeds']} | {s['pass@1_start']:.3f} | {s['pass@1_end']:.3f} ± {s['pass@1_end_std']:.3f} "
            f"| {s['pass@1_end_min']:.3f} | {s['pass@1_best']:.3f} | {seconds} |")


def table(stats: dict[str, dict]) -> str:
    """The Markdown table of a sweep (header, one row per entry of :func:`summary`), every summary column."""
    return "\n".join([TABLE_HEADER, *(table_row(row, s) for row, s in stats.items())])
