"""The race's table and figure from its run files: ``experiments/results/race/<task>/<row>_seed<s>.json``.

The table goes into ``docs/race.md`` between its ``race-table`` markers (the prose around it is written by hand);
the figure, the held-out score against optimizer steps and against training seconds for every row and seed, to
``experiments/results/race/race.png``.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

#: the held-out score each task's time-to-score column reads (stated in the table's heading); the longer race's was
#: 0.6 before its runs, which neither side reached in 30 steps (docs/race.md), so it reads 0.5, which both did
THRESHOLDS: dict[str, float] = {"letter_counting": 0.5, "spell_backward": 0.2, "basic_arithmetic": 0.1,
                                 "letter_counting_reasoning": 0.5}
#: what the curves plot: the task's own score (``score_answer``, in [0, 1], partial credit included), the reward
#: both sides train on; ``accuracy`` is the share of completions scored above 0.5
METRIC = "mean_score"
ROW_ORDER = ("trl", "ours", "ours-v4", "ours-k1", "trl-bf16", "ours-bf16")
ROW_NAMES = {"trl": "TRL GRPOTrainer, on-policy", "ours": "lit_grpo, on-policy (v = 1)",
             "ours-v4": "lit_grpo, off-policy (v = 4)", "ours-k1": "lit_grpo, asynchronous (K = 1, server)",
             "trl-bf16": "TRL GRPOTrainer, on-policy, bf16", "ours-bf16": "lit_grpo, on-policy (v = 1), bf16"}
#: the ratio column of a row compares it with the TRL row of the same precision
BASELINE = {row: "trl-bf16" if row.endswith("-bf16") else "trl" for row in ROW_ORDER}


def precision_of(run: dict[str, Any]) -> str:
    """What the run computed in: lit_grpo's Lightning precision, or TRL's options and what accelerate reported."""
    precision = run["config"].get("precision", "32")
    if run["row"].startswith("trl"):
        return f"bf16={precision == 'bf16'}, accelerate `{run.get('trl_effective_precision')}`"
    return "32-true" if precision == "32" else "bf16-mixed"
BEGIN, END = "<!-- race-table -->", "<!-- /race-table -->"


def load_runs(results: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """task -> row -> the evaluated runs (those with step 0 and the last step scored), by seed."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(results.glob("*/*_seed*.json")):
        run = json.loads(path.read_text())
        if "0" in run["eval"] and str(run["config"]["steps"]) in run["eval"]:
            runs[path.parent.name][run["row"]].append(run)
    return runs


def load_partial(results: Path) -> dict[str, list[dict[str, Any]]]:
    """task -> the runs that stopped before their last step (``<row>_seed<s>.partial.json``: what they logged), which
    the table leaves out and the figure draws dashed."""
    partial: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in sorted(results.glob("*/*.partial.json")):
        partial[path.parent.name].append(json.loads(path.read_text()))
    return partial


def partial_curve(run: dict[str, Any], metric: str = METRIC) -> tuple[list[int], list[float], list[float]]:
    """(steps, training seconds, held-out ``metric``) of a stopped run: its seconds summed from its logged steps."""
    clock, elapsed = 0.0, {0: 0.0}
    for entry in run["train_steps"]:
        clock += entry["seconds_trl_step_time"]
        elapsed[entry["step"]] = clock
    steps = sorted(int(s) for s in run["eval"])
    return steps, [elapsed[s] for s in steps], [run["eval"][str(s)][metric] for s in steps]


def curve(run: dict[str, Any], metric: str = METRIC) -> tuple[list[int], list[float], list[float]]:
    """(steps, training seconds, held-out ``metric``) at the evaluated steps; step 0 at 0 s."""
    steps = sorted(int(s) for s in run["eval"])
    seconds = [0.0 if s == 0 else float(run["train_seconds"][str(s)]) for s in steps]
    return steps, seconds, [run["eval"][str(s)][metric] for s in steps]


def time_to(run: dict[str, Any], threshold: float) -> float | None:
    """Training seconds at the first evaluated step whose held-out score reaches ``threshold`` (None: never)."""
    for _, seconds, score in zip(*curve(run)):
        if score >= threshold:
            return seconds
    return None


def mean_sd(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def throughput_options(config: dict[str, Any]) -> str:
    """lit_grpo's throughput options a row ran with, as the row's name states them."""
    options = (["packed"] if config.get("packing") else []) + (
        [f"micro_batch_tokens {config['micro_batch_tokens']}"] if config.get("micro_batch_tokens") else [])
    return f", {', '.join(options)}" if options else ""


def table(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = []
    for task, rows in sorted(runs.items()):
        threshold = THRESHOLDS.get(task, 0.5)
        any_run = next(iter(rows.values()))[0]
        config = any_run["config"]
        lines += [f"**{task}** (`{config['task']}`), model `{config['model']}`, prompt `{config['prompt']}`, "
                  f"{config['steps']} steps of {config['prompts_per_step']} prompts x {config['num_generations']}, "
                  f"up to {config['max_new_tokens']} new tokens, held-out score on {config['eval_questions']} test "
                  f"questions x {config['eval_samples']} samples; time to a held-out score of {threshold}:", "",
                  "| row | precision | seeds | score, step 0 | score, last step | exact, last step | s / step | "
                  f"mean length | time to {threshold} (median) | vs TRL | peak RSS |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        baseline_time: dict[str, float | None] = {}
        for baseline in set(BASELINE.values()) & set(rows):
            times = [t for t in (time_to(r, threshold) for r in rows[baseline]) if t is not None]
            baseline_time[baseline] = statistics.median(times) if times else None
        for row in [r for r in ROW_ORDER if r in rows]:
            trl_time = baseline_time.get(BASELINE[row])
            group = sorted(rows[row], key=lambda r: r["config"]["seed"])
            last = str(config["steps"])
            finals = [r["eval"][last][METRIC] for r in group]
            exact = [r["eval"][last]["accuracy"] for r in group]
            start = group[0]["eval"]["0"][METRIC]
            per_step = statistics.median(float(r["train_seconds"][last]) / config["steps"] for r in group)
            times = [time_to(r, threshold) for r in group]
            reached = [t for t in times if t is not None]
            median = statistics.median(reached) if reached else None
            when = "not reached" if median is None else f"{median:.0f} s" + (
                f" ({len(reached)} of {len(times)} seeds)" if len(reached) < len(times) else "")
            ratio = "" if median is None or trl_time is None else f"{median / trl_time:.2f}x"
            measured = [r["peak_rss_mib"] for r in group if r.get("peak_rss_mib")]  # recorded by later runs
            rss = f"{statistics.median(measured) / 1024:.1f} GiB" if measured else "not recorded"
            seeds = ", ".join(str(r["config"]["seed"]) for r in group)
            precision = " / ".join(sorted({precision_of(r) for r in group}))
            lengths = [s["completion_length"] for r in group for s in r.get("train_steps", [])
                       if s.get("completion_length") is not None]
            length = f"{statistics.mean(lengths):.1f}" if lengths else "not recorded"
            lines.append(f"| {ROW_NAMES[row]}{throughput_options(group[0]['config'])} | {precision} | {seeds} | "
                         f"{start:.3f} | {mean_sd(finals)} | {mean_sd(exact)} | {per_step:.1f} | {length} | {when} | "
                         f"{ratio} | {rss} |")
        lines.append("")
    return "\n".join(lines)


def figure(runs: dict[str, dict[str, list[dict[str, Any]]]], path: Path,
           partial: dict[str, list[dict[str, Any]]] | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"trl": "tab:red", "ours": "tab:blue", "ours-v4": "tab:green", "ours-k1": "tab:purple",
              "trl-bf16": "tab:orange", "ours-bf16": "tab:cyan"}
    partial = partial or {}
    tasks = sorted(runs)
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)), squeeze=False)
    for (by_step, by_time), task in zip(axes, tasks):
        for row in [r for r in ROW_ORDER if r in runs[task]]:
            for i, run in enumerate(sorted(runs[task][row], key=lambda r: r["config"]["seed"])):
                steps, seconds, accuracy = curve(run)
                count = len(runs[task][row])
                label = f"{ROW_NAMES[row]} ({count} seed{'s' if count > 1 else ''})" if i == 0 else None
                by_step.plot(steps, accuracy, color=colors[row], alpha=0.75, marker=".", label=label)
                by_time.plot(seconds, accuracy, color=colors[row], alpha=0.75, marker=".")
        for run in partial.get(task, []):
            steps, seconds, accuracy = partial_curve(run)
            label = f"{ROW_NAMES[run['row']]} (stopped after step {run['train_steps'][-1]['step']})"
            by_step.plot(steps, accuracy, color=colors[run["row"]], alpha=0.75, marker=".", ls="--", label=label)
            by_time.plot(seconds, accuracy, color=colors[run["row"]], alpha=0.75, marker=".", ls="--")
        by_step.set(title=f"{task}: held-out score", xlabel="optimizer step", ylabel="task score (mean)")
        by_time.set(title=f"{task}: against training time", xlabel="training seconds (one core)")
        by_step.legend(fontsize=8)
        for ax in (by_step, by_time):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(results: Path, document: Path) -> None:
    runs = load_runs(results)
    text = table(runs)
    figure(runs, results / "race.png", load_partial(results))
    if document.exists() and BEGIN in document.read_text():
        before, rest = document.read_text().split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        document.write_text(f"{before}{BEGIN}\n{text}\n{END}{after}")
    print(text)
