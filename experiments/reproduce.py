"""Re-run the cheapest cell of each committed result and compare it with the committed numbers.

Every committed curve comes from a deterministic run: one thread, a seeded warm start, seeded prompts and sampling.
The same code on the same environment gives the same numbers, so a cell re-run here matches its committed curve to
``TOLERANCE``. Each result's cheapest cell is one seed of its cheapest row, run for the first ``steps`` optimizer
steps only (a prefix of the committed run: the learning-rate schedule is constant after its warmup and nothing before
step ``steps`` depends on when the run ends); the comparison takes every committed point of the compared series
before that step, and the evaluations at it.

Two lines per result, each a cell: ``committed`` (the cell of the committed result, on the instruction set it was
made on) and ``avx2 ref`` (its AVX2 reference cell, ``experiments/avx2_reference.py``: the same cell recorded under
AVX2 from a committed warm start, which every x86-64 CPU with AVX2 replays, AVX-512 ones included):

- ``match``: every compared point within ``TOLERANCE``;
- ``differs``: the largest absolute difference and where (series and step); the command exits 1;
- ``stale``: the result was made before a change that moves it (``STALE`` says which, and what a re-measure costs),
  or its reference was recorded beside an earlier version of it or from another warm-start recipe. A stale result
  that differs is printed with its difference but does not fail the command: re-measure it (and re-record its
  reference) and remove it from ``STALE`` in the same change;
- ``skipped``: this machine cannot run the cell, and why: the result was made under an instruction set wider than
  the one torch dispatches to here (AVX-512 on an AVX2 CPU), the CPU is not x86-64 or has no AVX2, torch or
  transformers is another version than the one the cell was made with, or the CPU is another vendor's than the
  recording one's (AMD and Intel CPUs round some kernels otherwise) and no series of its vendor is recorded.

An AVX2 reference holds a series per CPU vendor: the recording machine's, and the other vendor's, replayed from the
same committed warm start on such a CPU (``--record-vendor-series``), so that AMD and Intel machines each compare
the reference cell with their own vendor's numbers.

    OMP_NUM_THREADS=1 python experiments/reproduce.py                  # every result (about 12 minutes on one core)
    OMP_NUM_THREADS=1 python experiments/reproduce.py demo_cpu_seeds   # one of them
    python experiments/reproduce.py --list                             # the results and their cells
    OMP_NUM_THREADS=1 python experiments/reproduce.py --record-avx2-reference fig2_miniature  # after a re-measure
    OMP_NUM_THREADS=1 python experiments/reproduce.py --record-vendor-series   # on the other vendor's CPU

A committed cell whose warm start's cache key names a narrower instruction set than this CPU's (AVX2 on an AVX-512
machine) is rebuilt with torch dispatching to that set (``ATEN_CPU_CAPABILITY``), so a result made on such a machine
is compared here too. ``ATEN_CPU_CAPABILITY=avx2`` in this command's environment makes an AVX-512 machine what an
AVX2 one is to it: the committed AVX-512 cells are skipped and the AVX2 reference cells replayed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import avx2_reference as reference
from doc_tables import demo_table, last_pass_by_seed, write_table

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
DEMO_CONFIG = ROOT / "configs" / "demo_cpu.yaml"
TOOLS_CONFIG = ROOT / "configs" / "demo_tools_cpu.yaml"
DEMO_SEEDS = RESULTS / "demo_cpu_seeds.json"
README = ROOT / "README.md"
DEMO_TABLE = "demo-table"  # the markers of README's five-seed table, which --measure-demo rewrites
#: what "the same number" means: runs at one thread are deterministic, their metrics are float32
TOLERANCE = 1e-6
#: x86 instruction sets torch can be told to dispatch to (``ATEN_CPU_CAPABILITY``), from the widest down
X86_CAPABILITIES = ("AVX512", "AVX2", "DEFAULT")
#: the demo's TensorBoard series that ``demo_cpu_seeds.json`` keeps (its five-seed table and the train reward)
DEMO_TAGS = ("eval/pass@1", "eval/pass@8", "rollout/reward_mean")

#: results made before a change that moves their numbers: the reason, and what re-measuring them costs
STALE: dict[str, str] = {}


@dataclass
class Cell:
    """One run of a committed result: the ``fit`` command's overrides of ``config``, its seed and prefix length,
    and the committed points it is compared with (``{series: {step: value}}``)."""

    config: Path
    seed: int
    steps: int
    overrides: list[str]
    expected: dict[str, dict[int, float]]
    evaluations: tuple[str, ...]  # series measured at step ``steps`` too (evaluations), the rest before it
    #: the TensorBoard tag of each compared series (its name in the committed file -> the tag)
    tags: dict[str, str]
    warm_start_key: str | None = None  # the warm start's cache key the result records, when it records one
    warm_start_fingerprint: str | None = None  # and the SHA-256 of its weights (``weights_fingerprint``)
    warm_start: str = "arith"  # which warm start the run uses: "arith" (arith-tiny-sft) or "calc" (calc-tiny-sft)
    description: str = ""
    scale: int = 1  # optimizer steps per logged step (i): the committed x axis is optimizer steps
    extra: dict = field(default_factory=dict)


# --- the comparison -------------------------------------------------------------------------------------------


def prefix_points(series: dict[str, dict[int, float]], steps: int,
                  evaluations: tuple[str, ...]) -> dict[str, dict[int, float]]:
    """The points of a run of ``steps`` optimizer steps that a run of more steps shares with it: every point
    logged before step ``steps``, and for the evaluation series (measured after an update, at its step) the one at
    ``steps`` too."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return {name: {s: v for s, v in points.items() if s < steps or (name in evaluations and s == steps)}
            for name, points in series.items()}


def max_abs_difference(expected: dict[str, dict[int, float]],
                       measured: dict[str, dict[int, float]]) -> tuple[float, str]:
    """The largest ``|expected - measured|`` over every point of ``expected`` and where it is (``series@step``).
    A point ``measured`` lacks, or a NaN on one side only, counts as an infinite difference; no point at all is an
    error (nothing would have been compared)."""
    worst, where, compared = 0.0, "", 0
    for name, points in sorted(expected.items()):
        got = measured.get(name, {})
        for step, value in sorted(points.items()):
            compared += 1
            if step not in got:
                diff = math.inf
            elif math.isnan(value) or math.isnan(got[step]):
                diff = 0.0 if math.isnan(value) and math.isnan(got[step]) else math.inf
            else:
                diff = abs(value - got[step])
            if diff > worst or not where:
                worst, where = diff, f"{name}@{step}"
    if not compared:
        raise ValueError("no committed point to compare: the cell's prefix holds none")
    return worst, where


def first_difference(expected: dict[str, dict[int, float]], measured: dict[str, dict[int, float]],
                     tolerance: float = TOLERANCE) -> str | None:
    """The earliest step at which a point of ``expected`` is off by more than ``tolerance`` (missing counts), as
    ``series@step`` (the first series by name at that step); ``None`` when every point agrees. Where a run first
    leaves its committed curve says what moved it: at step 0, the start (warm start, sampling, evaluation)."""
    off = []
    for name, points in expected.items():
        got = measured.get(name, {})
        for step, value in points.items():
            same = step in got and (abs(value - got[step]) <= tolerance
                                    or (math.isnan(value) and math.isnan(got[step])))
            if not same:
                off.append((step, name))
    if not off:
        return None
    step, name = min(off)
    return f"{name}@{step}"


def verdict(difference: float, where: str, stale_reason: str | None, tolerance: float = TOLERANCE) -> tuple[str, bool]:
    """The result's line (after its name) and whether it fails the command: within ``tolerance`` it matches;
    beyond, a result listed as stale is stale (reported, not failed), any other differs and fails."""
    if difference <= tolerance:
        return (f"match (max abs difference {difference:.1e} at {where})"
                + (" -- listed in STALE but matches: remove it from STALE" if stale_reason else "")), False
    shown = "inf (missing)" if math.isinf(difference) else f"{difference:.3g}"
    if stale_reason:
        return f"stale ({stale_reason}; differs by {shown} at {where})", False
    return f"differs (max abs difference {shown} at {where})", True


def as_points(pairs: list) -> dict[int, float]:
    """A committed ``[[step, value], ...]`` series as ``{step: value}`` (the last value of a step wins, as when
    a run's folder holds an interrupted attempt's events too)."""
    return {int(step): float(value) for step, value in pairs}


# --- the committed results and their cells ----------------------------------------------------------------------


def demo_cell(steps: int = 50, seed: int = 0, path: Path = DEMO_SEEDS) -> Cell:
    """The demo's five-seed table (``demo_cpu_seeds.json``): seed ``seed`` of ``configs/demo_cpu.yaml``, the
    first ``steps`` steps (50: up to its first evaluation after the start)."""
    saved = json.loads(path.read_text())
    if "seeds" not in saved:
        raise ValueError(f"{path}: no 'seeds' record; expected the layout reproduce.py --measure-demo writes")
    record = saved["seeds"].get(str(seed))
    if record is None:
        raise ValueError(f"{path} has no seed {seed}; it has {sorted(saved['seeds'])}")
    expected = {tag: {int(s): float(v) for s, v in record[tag].items()} for tag in DEMO_TAGS}
    return Cell(DEMO_CONFIG, seed, steps, [], expected, ("eval/pass@1", "eval/pass@8"), {t: t for t in DEMO_TAGS},
                warm_start_key=saved["warm_start"]["cache_key"],
                warm_start_fingerprint=saved["warm_start"]["fingerprint"],
                description=f"demo, seed {seed}, {steps} steps")


def tools_cell(steps: int = 10, seed: int = 0) -> Cell:
    """The tool demo's seeds (``demo_tools/seeds.json``): seed ``seed`` of ``configs/demo_tools_cpu.yaml``, the
    first ``steps`` steps (10: up to its first evaluation after the start)."""
    saved = json.loads((RESULTS / "demo_tools" / "seeds.json").read_text())
    curves = saved[str(seed)]["curves"]
    tags = ("eval/pass@1", "eval/pass@4", "rollout/tool_calls", "rollout/reward_mean")
    expected = {tag: {int(s): float(v) for s, v in curves[tag].items()} for tag in tags}
    return Cell(TOOLS_CONFIG, seed, steps, ["--trainer.enable_progress_bar", "false"], expected,
                ("eval/pass@1", "eval/pass@4"), {t: t for t in tags}, warm_start="calc",
                warm_start_key=saved.get("warm_start", {}).get("cache_key"),
                warm_start_fingerprint=saved.get("warm_start", {}).get("fingerprint"),
                description=f"tool demo, seed {seed}, {steps} steps")


#: the compared series of the sweeps (names in their curves file -> TensorBoard tags); timings are left out
SWEEP_SERIES = {"pass@1": "eval/pass@1", "reward": "rollout/reward_mean", "tv_pi_alpha": "tv/pi_alpha",
                "tv_pik_alpha": "tv/pik_alpha", "kl": "train/kl", "mismatch_k3": "mismatch/k3_kl",
                "clip_low": "train/clip_low_fraction", "clip_high": "train/clip_high_fraction"}


def sweep_cell(folder: str, run_key: dict, steps: int, label: str) -> Cell:
    """A sweep's run (``curves.json.gz``) picked by ``run_key`` (e.g. row and seed), the first ``steps`` steps,
    with the overrides the sweep's script gives it."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from curves_file import CURVES_FILE, read_curves

    saved = read_curves(RESULTS / folder / CURVES_FILE)
    runs = [r for r in saved["runs"] if all(r.get(k) == v for k, v in run_key.items())]
    if len(runs) != 1:
        raise ValueError(f"{folder}: {len(runs)} runs match {run_key}; expected one")
    run = runs[0]
    expected = {name: as_points(run["series"][name]) for name in SWEEP_SERIES if run["series"].get(name)}
    settings = saved.get("settings", {})
    eval_questions = settings.get("eval_questions", 100)
    eval_every = settings.get("eval_every", 20)
    if folder == "corrections_study":
        import corrections_study as study

        setting_overrides, server = study.SETTINGS[run["setting"]]
        if server:
            raise ValueError(f"{folder}: the cell {run_key} samples from a server; pick an in-process one")
        overrides = [*setting_overrides, *study.ROWS[run["row"]]]
    else:
        overrides = list(run["overrides"])
    sync_engine = settings.get("sync_engine", "in_process")
    return Cell(DEMO_CONFIG, run["seed"], steps, overrides, expected, ("pass@1",),
                {name: SWEEP_SERIES[name] for name in expected},
                warm_start_key=settings.get("warm_start", {}).get("cache_key"),
                warm_start_fingerprint=settings.get("warm_start", {}).get("fingerprint"), description=label,
                extra={"eval_every": eval_every, "eval_questions": eval_questions, "server": sync_engine == "server"})


#: each committed result's cheapest cell
CELLS: dict[str, Callable[[], Cell]] = {
    "demo_cpu_seeds": demo_cell,
    "demo_tools": tools_cell,
    "fig2_miniature": lambda: sweep_cell("fig2_miniature", {"row": "v1-i1", "seed": 0}, 20,
                                         "rec suite, v1-i1, seed 0, 20 steps"),
    "fig2_paper": lambda: sweep_cell("fig2_paper", {"row": "v1-i1", "seed": 0}, 20,
                                     "paper suite, v1-i1 (a rollout server), seed 0, 20 steps"),
    "corrections_study": lambda: sweep_cell("corrections_study", {"setting": "on-policy", "row": "none", "seed": 0},
                                            20, "on-policy, none, seed 0, 20 steps"),
}


# --- running a cell ------------------------------------------------------------------------------------------------


def key_capability(key: str, warm_start: str = "arith") -> str | None:
    """The x86 instruction set under which this environment (its torch, transformers and warm-start recipe) builds
    the warm start of cache key ``key``, whether or not this CPU runs it; ``None`` when none does."""
    from lit_grpo.training import warm_start as ws

    config = ws.ARITH_TINY_SFT if warm_start == "arith" else ws.CALC_TINY_SFT
    digest = ws.training_data_digest(config)
    for capability in X86_CAPABILITIES:
        if ws.cache_key(config, {**ws.build_environment(), "cpu_capability": capability}, digest) == key:
            return capability
    return None


def runnable(native: str) -> tuple[str, ...]:
    """The instruction sets torch can dispatch to where it dispatches to ``native``: it and the narrower x86 ones
    (``ATEN_CPU_CAPABILITY`` narrows, never widens)."""
    return X86_CAPABILITIES[X86_CAPABILITIES.index(native):] if native in X86_CAPABILITIES else (native,)


def capability_for(key: str | None, warm_start: str = "arith") -> str | None:
    """The instruction set (``ATEN_CPU_CAPABILITY``) under which this environment builds the warm start of cache
    key ``key``: this CPU's own, or a narrower x86 one it can also run; ``None`` when none builds it
    (:func:`native_blocker` says why). A result that records no key runs on this CPU's own."""
    import torch

    native = torch.backends.cpu.get_cpu_capability()
    if key is None:
        return native
    made = key_capability(key, warm_start)
    return made if made in runnable(native) else None


#: the CPU every committed native cell (the demo's seeds, the miniature's, the corrections study's) was run on
NATIVE_CELLS_RECORDED_ON = "AMD EPYC"


def native_blocker(cell: Cell, native: str, machine: str | None = None, cpu: str | None = None) -> str | None:
    """Why this environment cannot re-run ``cell``, the cell of a committed result, in words for its ``skipped``
    line; ``None`` when it can. ``native`` is the instruction set torch dispatches to here (the CPU's widest, or
    the narrower one ``ATEN_CPU_CAPABILITY`` asks for), ``machine`` the CPU's architecture, ``cpu`` its model name
    (None: the vendor is not checked)."""
    if cell.warm_start_key is None:
        return None
    import torch
    import transformers

    made = key_capability(cell.warm_start_key, cell.warm_start)
    if made is None:
        return (f"its warm start (cache key {cell.warm_start_key}) is none this environment builds under any "
                f"instruction set: another torch (here {torch.__version__}), transformers (here "
                f"{transformers.__version__}) or warm-start recipe made it")
    machine = machine or platform.machine()
    if machine not in reference.X86_MACHINES:
        return f"made on an x86-64 CPU under {made}; this CPU is {machine}"
    if made not in runnable(native):
        capped = os.environ.get("ATEN_CPU_CAPABILITY")
        why = f"ATEN_CPU_CAPABILITY={capped} here" if capped else "this CPU's widest instruction set"
        return f"made under {made}; torch here dispatches to {native} at most ({why})"
    if cell.extra.get("server") and made != native:
        return (f"its rows sample from a rollout server, which this command starts at the instruction set torch "
                f"dispatches to ({native}) only; the result was made under {made}")
    return reference.other_vendor(NATIVE_CELLS_RECORDED_ON, cpu)


def fit_command(cell: Cell, folder: Path) -> list[str]:
    """The ``fit`` of ``cell`` into ``folder``: its config, seed and overrides, cut at ``cell.steps``; the sweeps'
    through their scripts' own command (``fig2_miniature.command``)."""
    common = ["--trainer.default_root_dir", str(folder), "--trainer.logger.init_args.save_dir", str(folder)]
    if cell.config == DEMO_CONFIG and cell.extra:  # a sweep's run
        sys.path.insert(0, str(ROOT / "experiments"))
        import fig2_miniature as fig2

        args = argparse.Namespace(steps=cell.steps, eval_every=cell.extra["eval_every"],
                                  eval_questions=cell.extra["eval_questions"])
        return fig2.command(cell.overrides, cell.seed, folder, args)
    return [sys.executable, "-m", "lit_grpo", "fit", "--config", str(cell.config), "--seed_everything",
            str(cell.seed), *common, *cell.overrides, "--trainer.max_steps", str(cell.steps)]


def run_cell(cell: Cell, folder: Path, capability: str | None = None, env: dict[str, str] | None = None,
             baseline: dict[str, str] | None = None) -> dict[str, dict[int, float]]:
    """Run ``cell`` (one thread; with a rollout server of its own where its sweep samples from one) and read its
    compared series back from TensorBoard, under their committed names, steps in optimizer steps. ``env`` adds to
    the environment of the fit and of the server; ``baseline`` is the checksums the server's weights must equal
    (default: the warm start as this process loads it)."""
    from lit_grpo.cli.plots import read_scalars

    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               **(env or {}))
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability.lower()
    cmd = fit_command(cell, folder)
    with open(folder / "log.txt", "w") as log:
        if cell.extra.get("server"):
            sys.path.insert(0, str(ROOT / "experiments"))
            from miniature_server import MiniatureServer, parameter_checksums

            baseline = baseline if baseline is not None else parameter_checksums("arith-tiny-sft")
            with MiniatureServer("arith-tiny-sft", folder, baseline, env=env) as server:
                options = {"url": server.url, "token_file": str(server.token_file), "timeout_s": 60}
                proc = subprocess.run(cmd + ["--data.engine", "server", "--data.engine_options",
                                             json.dumps(options)], cwd=ROOT, env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
        else:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise RuntimeError(f"{cell.description}: fit exited with {proc.returncode}; see {folder / 'log.txt'}")
    scalars = read_scalars(folder)
    return {name: {step * cell.scale: value for step, value in scalars.get(tag, [])}
            for name, tag in cell.tags.items()}


def compared(cell: Cell, measured: dict[str, dict[int, float]], stale: str | None, seconds: float) -> tuple[str, bool]:
    """The line of a cell run (its verdict, where it first left the committed curve, what it was) and whether it
    fails the command."""
    expected = prefix_points(cell.expected, cell.steps, cell.evaluations)
    difference, where = max_abs_difference(expected, measured)
    line, fails = verdict(difference, where, stale)
    first = first_difference(expected, measured)
    first = f", first at {first}" if first else ""
    return f"{line}{first}; {cell.description}, {seconds:.0f} s", fails


def native_capability() -> str:
    """The instruction set torch dispatches to in this process (``ATEN_CPU_CAPABILITY`` can narrow it)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def check(name: str, work: Path) -> tuple[str, bool]:
    """Run result ``name``'s committed cell in ``work`` and compare: its line and whether it fails the command."""
    cell = CELLS[name]()
    stale = STALE.get(name)
    blocked = native_blocker(cell, native_capability(), cpu=reference.cpu_name())
    if blocked:
        return f"skipped ({blocked})" + (f"; listed stale: {stale}" if stale else ""), False
    start = time.perf_counter()
    measured = run_cell(cell, work / name, capability_for(cell.warm_start_key, cell.warm_start))
    return compared(cell, measured, stale, time.perf_counter() - start)


def reference_cell(cell: Cell, record: dict) -> Cell:
    """The AVX2 reference of ``cell`` (a committed result's cell): the same run, compared with the points the
    reference ``record`` measured."""
    record = reference.for_cpu(record, reference.cpu_name())
    return replace(cell, steps=record["steps"], expected=reference.series_of(record),
                   warm_start_key=record["warm_start"]["cache_key"], description=f"{cell.description}, AVX2")


def reference_blocker(name: str, record: dict | None) -> tuple[str, str] | None:
    """Why result ``name``'s AVX2 reference is not replayed here, as ``(word, reason)`` (``skipped`` where this
    machine cannot run it, ``stale`` where the record no longer stands for the result); ``None`` when it is."""
    if record is None:
        return "skipped", ("no AVX2 reference is committed for it (record one: python experiments/reproduce.py "
                           f"--record-avx2-reference {name})")
    cell = CELLS[name]()
    if reference.points_digest(prefix_points(cell.expected, cell.steps, cell.evaluations)) != record["result_digest"]:
        return "stale", ("its AVX2 reference was recorded beside an earlier version of the result (the committed "
                         f"cell's points changed since); re-record it: --record-avx2-reference {name}")
    blocked = reference.replay_blocker(record, native_capability(), platform.machine(), reference.versions(),
                                       reference.cpu_name())
    if blocked:
        return "skipped", blocked
    changed = reference.recipe_changed(record)
    return ("stale", changed) if changed else None


def replay_reference(name: str, work: Path, record: dict) -> dict[str, dict[int, float]]:
    """Run result ``name``'s AVX2 reference cell in ``work`` from its committed warm start, under
    ``avx2_reference.REPLAY_ENV``: the measured points."""
    cell = reference_cell(CELLS[name](), record)
    with tempfile.TemporaryDirectory(prefix="avx2-reference-") as cache:
        env, baseline = reference.prepare(record, Path(cache))
        return run_cell(cell, work / f"{name}-avx2", reference.CAPABILITY, env=env, baseline=baseline)


def check_reference(name: str, work: Path) -> tuple[str, bool]:
    """Replay result ``name``'s AVX2 reference cell and compare: its line and whether it fails the command."""
    record = reference.load(name)
    stale = STALE.get(name)
    blocked = reference_blocker(name, record)
    if blocked:
        return f"{blocked[0]} ({blocked[1]})" + (f"; listed stale: {stale}" if stale else ""), False
    start = time.perf_counter()
    measured = replay_reference(name, work, record)
    return compared(reference_cell(CELLS[name](), record), measured, stale, time.perf_counter() - start)


def record_reference(name: str, work: Path) -> str:
    """Record result ``name``'s AVX2 reference: check that its committed cell still matches here (a reference
    recorded from code that no longer gives the committed numbers would stand for another result; the check also
    builds the result's warm start here), commit that warm start, run the cell from it under
    ``avx2_reference.REPLAY_ENV`` and write the record. Returns what it did, in a line."""
    from lit_grpo.models.loading import cache_dir

    native = native_capability()
    if platform.machine() not in reference.X86_MACHINES or native not in reference.RUNS_AVX2:
        raise SystemExit(f"{name}: the AVX2 reference is recorded on an x86-64 CPU with AVX2; torch here dispatches "
                         f"to {native} on {platform.machine()}")
    line, _ = check(name, work)
    if not line.startswith("match"):
        raise SystemExit(f"{name}: its committed cell does not match here ({line}); the reference is recorded where "
                         "it does (the machine that measured the result, after a re-measure)")
    cell = CELLS[name]()
    alias = "arith-tiny-sft" if cell.warm_start == "arith" else "calc-tiny-sft"
    warm = reference.commit_warm_start(alias, cache_dir() / f"{alias}-{cell.warm_start_key}",
                                       cell.warm_start_fingerprint)
    start = time.perf_counter()
    measured = replay_reference(name, work, {"warm_start": warm, "steps": cell.steps, "series": {}})
    committed = prefix_points(cell.expected, cell.steps, cell.evaluations)
    record = reference.record_for(name, cell.description, cell.steps, committed, measured, warm, native)
    path = reference.reference_file(name)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return (f"recorded {path.relative_to(ROOT)} ({time.perf_counter() - start:.0f} s; the committed cell here: "
            f"{line.split(';')[0]})")


def record_vendor_series(name: str, work: Path) -> str:
    """Add this CPU vendor's series to result ``name``'s AVX2 reference (recorded on another vendor's CPU): the
    reference must stand for the result (not stale), its warm start is checked by its fingerprint, and the cell is
    replayed here (:func:`avx2_reference.with_vendor_series`)."""
    record = reference.load(name)
    bare = record and {k: v for k, v in record.items() if k != "vendors"}
    blocked = reference_blocker(name, bare)  # on another vendor's CPU: blocked by the vendor alone
    if blocked and "another vendor's" not in blocked[1]:
        raise SystemExit(f"{name}: its AVX2 reference is {blocked[0]} here ({blocked[1]})")
    start = time.perf_counter()
    updated = reference.with_vendor_series(record, replay_reference(name, work, bare), native_capability())
    path = reference.reference_file(name)
    path.write_text(json.dumps(updated, indent=1) + "\n")
    return f"added this vendor's series to {path.relative_to(ROOT)} ({time.perf_counter() - start:.0f} s)"


# --- measuring the demo's seeds ----------------------------------------------------------------------------------


def measure_demo(seeds: list[int], runs: Path, steps: int = 150, out: Path = DEMO_SEEDS) -> dict:
    """Run the demo (``configs/demo_cpu.yaml``, one thread) for each seed and write ``demo_cpu_seeds.json``: the
    warm start's record and, per seed, ``DEMO_TAGS`` by step and the run's wall seconds. A seed whose run
    finished in ``runs`` is read back, not run again."""
    import torch

    from lit_grpo.cli.plots import read_scalars
    from lit_grpo.training.warm_start import ARITH_TINY_SFT, load_warm_started, weights_fingerprint

    model, _ = load_warm_started(ARITH_TINY_SFT)
    record = {"config": str(DEMO_CONFIG.relative_to(ROOT)), "steps": steps, "threads": 1,
              "warm_start": {"model": "arith-tiny-sft", "cache_key": ARITH_TINY_SFT.key(),
                             "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                             "fingerprint": weights_fingerprint(model)},
              "seeds": {}}
    for seed in seeds:
        folder = runs / f"seed{seed}"
        wall = folder / "wall_seconds.txt"
        if not wall.exists():
            cell = Cell(DEMO_CONFIG, seed, steps, ["--trainer.enable_progress_bar", "false"], {}, (), {})
            start = time.perf_counter()
            run_cell(cell, folder)
            wall.write_text(f"{time.perf_counter() - start:.1f}\n")
        scalars = read_scalars(folder)
        record["seeds"][str(seed)] = {**{tag: {str(s): v for s, v in scalars[tag]} for tag in DEMO_TAGS},
                                      "wall_seconds": float(wall.read_text())}
        print(f"seed {seed}: Pass@1 " + ", ".join(f"{s}: {v:.3f}" for s, v in scalars["eval/pass@1"]), flush=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", metavar="RESULT", help=f"default: all of {', '.join(CELLS)}")
    parser.add_argument("--work", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--list", action="store_true", help="print each result's cell and exit")
    parser.add_argument("--measure-demo", type=int, nargs="+", metavar="SEED", default=None,
                        help="run the demo with these seeds; write experiments/results/demo_cpu_seeds.json and "
                             "README.md's table")
    parser.add_argument("--demo-runs", type=Path, default=ROOT / "runs" / "demo_seeds",
                        help="--measure-demo's run folders (a finished seed is not run again)")
    parser.add_argument("--record-avx2-reference", action="store_true",
                        help="record the results' AVX2 reference cells (experiments/results/avx2_reference/)")
    parser.add_argument("--record-vendor-series", action="store_true",
                        help="add this CPU vendor's series to the results' AVX2 references (another vendor's CPU)")
    args = parser.parse_args(argv)
    unknown = [r for r in args.results if r not in CELLS]
    if unknown:
        parser.error(f"unknown result(s) {unknown}; expected some of {list(CELLS)}")
    if args.measure_demo is not None:
        record = measure_demo(args.measure_demo, args.demo_runs)
        write_table(README, DEMO_TABLE, demo_table(record))
        print(demo_table(record), last_pass_by_seed(record), f"wrote {DEMO_SEEDS} and README.md's table", sep="\n")
        return 0
    names = args.results or list(CELLS)
    if args.list:
        for name in names:
            print(f"{name:18} {CELLS[name]().description}" + (" [stale]" if name in STALE else ""))
        return 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        work = args.work or Path(tmp)
        for name in names:
            if args.record_avx2_reference:
                print(f"{name:18} {record_reference(name, work)}", flush=True)
                continue
            if args.record_vendor_series:
                print(f"{name:18} {record_vendor_series(name, work)}", flush=True)
                continue
            for kind, checker in (("committed", check), ("avx2 ref", check_reference)):
                line, fails = checker(name, work)
                failed |= fails
                print(f"{name:18} {kind:9} {line}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
