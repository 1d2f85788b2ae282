"""The AVX2 reference cells: one cell of each committed result, recorded under an instruction set every x86-64 CPU
of the last decade runs, so that a machine whose CPU cannot run the result's own (an AVX2 CPU and a result made on
AVX-512) still replays something of it.

A committed result comes from a deterministic one-thread run, but its numbers are the numerics of the CPU that ran
it: torch's kernels dispatch by instruction set (``ATEN_CPU_CAPABILITY``: AVX2 and AVX-512 reductions round
otherwise) and torch can only be told to use a narrower set than the CPU's, never a wider one. Beside each result,
``experiments/results/avx2_reference/<result>.json`` keeps the same cell (config, seed, overrides, the first
``steps`` steps) run under :data:`REPLAY_ENV`, and ``experiments/results/avx2_reference/<warm start>/`` the weights
it started from: the result's own warm start (a plain Hugging Face directory of ~1 MB, its fingerprint the one the
result records), so the reference cell differs from the committed one only in the instruction set of its steps. A
replay puts those weights where the fit, dispatching to AVX2, looks for its warm start (the cache folder its AVX2
cache key names) instead of training one: an AVX2 CPU cannot train the AVX-512 weights, the training is the part of
a run that rounds most with the machine's BLAS, and the calculator warm start takes about 11 minutes on one core.

:data:`REPLAY_ENV` pins every library that picks kernels by CPU: ATen to AVX2, oneMKL (torch's BLAS on x86) to its
``COMPATIBLE`` code path (oneMKL's branches other than ``AUTO`` and ``COMPATIBLE`` exist on Intel CPUs only, so
``COMPATIBLE`` is the one that gives the same results on Intel and AMD CPUs), and oneDNN to AVX2. An AVX-512 CPU runs
this environment too, so the machine that makes a result records its reference in the same change.

Each record also keeps a digest of the committed points it stands beside (:func:`points_digest`): a result
re-measured without re-recording its reference is caught by the default test tier.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lit_grpo.training.warm_start import WarmStartConfig

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "experiments" / "results" / "avx2_reference"
#: the instruction set of the reference cells, as ``torch.backends.cpu.get_cpu_capability`` names it
CAPABILITY = "AVX2"
#: the environment of every reference run (the fit, its rollout server): ATen's kernels at AVX2, oneMKL's portable
#: branch (its default picks kernels by CPU vendor and model, so Intel and AMD CPUs would round otherwise), oneDNN
#: capped at AVX2 (torch uses it for a few operators)
REPLAY_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "AVX2"}
#: x86 instruction sets that run AVX2 code
RUNS_AVX2 = ("AVX2", "AVX512")
X86_MACHINES = ("x86_64", "AMD64", "i686", "x86")


def reference_file(result: str) -> Path:
    """Where the reference record of ``result`` is committed."""
    return REFERENCE / f"{result}.json"


def load(result: str) -> dict | None:
    """The reference record of ``result``, or ``None`` when none is committed."""
    path = reference_file(result)
    return json.loads(path.read_text()) if path.exists() else None


def points_digest(points: dict[str, dict[int, float]]) -> str:
    """16 hex digits of SHA-256 over ``{series: {step: value}}`` (sorted; floats by ``repr``, exact): equal
    digests mean the same committed points."""
    canonical = json.dumps({name: [[step, repr(float(value))] for step, value in sorted(series.items())]
                            for name, series in sorted(points.items())})
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def series_of(record: dict) -> dict[str, dict[int, float]]:
    """The record's measured points as ``{series: {step: value}}``."""
    return {name: {int(step): float(value) for step, value in points.items()} for name, points in
            record["series"].items()}


def for_cpu(record: dict, cpu: str | None) -> dict:
    """The record as a CPU of ``cpu``'s vendor replays it: the recording vendor's own, or the series recorded for
    this vendor (``record["vendors"]``, :func:`with_vendor_series`) in its place; the record itself when there is
    neither (:func:`replay_blocker` then says why it is not compared)."""
    here = vendor_of(cpu or "")
    other = record.get("vendors", {}).get(here) if here else None
    if other is None or here == vendor_of(record.get("recorded_on", "")):
        return record
    return {**record, "recorded_on": other["recorded_on"], "series": other["series"]}


def with_vendor_series(record: dict, measured: dict[str, dict[int, float]], capability: str) -> dict:
    """``record`` with this CPU's vendor's series added: the same reference cell (the committed warm start, the
    same steps, :data:`REPLAY_ENV`) as this vendor's CPUs measure it, for the points the record holds. A vendor's
    kernels round otherwise (:func:`other_vendor`), so each vendor's CPUs are compared with their own series."""
    vendor = vendor_of(cpu_name())
    if vendor is None or vendor == vendor_of(record["recorded_on"]):
        raise ValueError(f"{record['result']}: this CPU ({cpu_name()}) is the recording vendor's or names none; "
                         "expected another vendor's CPU (AMD or Intel)")
    missing = [f"{name}@{step}" for name, points in record["series"].items() for step in points
               if int(step) not in measured.get(name, {})]
    if missing:
        raise ValueError(f"{record['result']}: the run logged no {', '.join(missing[:5])}; expected every point of "
                         "the reference")
    series = {name: {step: measured[name][int(step)] for step in points} for name, points in record["series"].items()}
    vendors = {**record.get("vendors", {}),
               vendor: {"recorded_on": f"{cpu_name()} ({capability} here, {CAPABILITY} dispatched)",
                        "series": series}}
    return {**record, "vendors": vendors}


def warm_start_config(alias: str) -> WarmStartConfig:
    """The config of warm start ``alias`` (``arith-tiny-sft`` or ``calc-tiny-sft``)."""
    from lit_grpo.training import warm_start as ws

    configs = {c.alias: c for c in (ws.ARITH_TINY_SFT, ws.CALC_TINY_SFT)}
    if alias not in configs:
        raise ValueError(f"unknown warm start {alias!r}; expected one of {sorted(configs)}")
    return configs[alias]


def versions() -> dict[str, str]:
    """This environment's torch and transformers versions, the libraries whose kernels a record depends on."""
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def avx2_key(alias: str) -> str:
    """The cache key this environment gives warm start ``alias`` under AVX2 (its torch and transformers)."""
    from lit_grpo.training import warm_start as ws

    config = warm_start_config(alias)
    return ws.cache_key(config, {**ws.build_environment(), "cpu_capability": CAPABILITY},
                        ws.training_data_digest(config))


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def vendor_of(cpu: str) -> str | None:
    """``"AMD"`` or ``"Intel"`` from a CPU's model name, None when neither names it."""
    return next((vendor for vendor in ("AMD", "Intel") if vendor in cpu), None)


def other_vendor(recorded_on: str, cpu: str | None) -> str | None:
    """Why a result recorded on the CPU ``recorded_on`` is not compared on ``cpu`` (None: not checked), or None.
    Measured on an Intel Xeon with AVX-512: the AMD-recorded demo drifts from step 40 and the AVX2 miniature from
    step 13 (MKL_CBWR=COMPATIBLE and ATEN_CPU_CAPABILITY=avx2 notwithstanding), and the commit before this check
    drifts the same way, so some kernel still rounds by vendor; the results are checked on the recording vendor's
    CPUs only."""
    recorded, here = vendor_of(recorded_on), vendor_of(cpu or "")
    if cpu is None or recorded is None or here is None or recorded == here:
        return None
    return (f"recorded on an {recorded_on}; this CPU is {cpu}, another vendor's, on which the committed curve was "
            f"measured to drift (some kernel rounds by vendor): compared on {recorded} CPUs only")


def replay_blocker(record: dict, capability: str, machine: str, here: dict[str, str],
                   cpu: str | None = None) -> str | None:
    """Why this environment cannot replay ``record`` (its words for the skipped line), or ``None`` when it can:
    the CPU is not x86-64, torch here dispatches to an instruction set narrower than AVX2, or torch or
    transformers is another version than the record's (their kernels round otherwise). ``capability`` is what
    ``torch.backends.cpu.get_cpu_capability`` says here, ``here`` :func:`versions`."""
    if machine not in X86_MACHINES:
        return f"the reference cells are x86-64 runs (AVX2); this CPU is {machine}"
    if capability not in RUNS_AVX2:
        return (f"the reference cells run AVX2 code; torch here dispatches to {capability} at most "
                "(the CPU's widest instruction set, or a narrower ATEN_CPU_CAPABILITY)")
    other = [f"{lib} {record[lib]}, this environment has {here[lib]}" for lib in ("torch", "transformers")
             if record[lib] != here[lib]]
    if other:
        return "recorded with " + " and ".join(other)
    if cpu is not None and vendor_of(cpu) in record.get("vendors", {}):
        return None  # this vendor's own series is recorded beside the reference
    blocked = other_vendor(record.get("recorded_on", "").split(" (")[0], cpu)
    return blocked and (f"{blocked}; record this vendor's series: python experiments/reproduce.py "
                        f"--record-vendor-series {record.get('result', 'RESULT')}")


def recipe_changed(record: dict) -> str | None:
    """Why the reference no longer replays as recorded because the warm-start recipe, its config or its training data
    changed since (the AVX2 cache key under which the fit looks for its warm start differs), or ``None``. Call it
    with the record's torch and transformers (the key hashes them too)."""
    key = avx2_key(record["warm_start"]["model"])
    if key != record["warm_start"]["replay_key"]:
        return (f"it was recorded when its warm start's AVX2 cache key was {record['warm_start']['replay_key']}, "
                f"this code's is {key}: the warm-start recipe or its data changed since; re-record it")
    return None


def prepare(record: dict, cache: Path) -> tuple[dict[str, str], dict[str, str]]:
    """Put the reference's committed warm start where the fit under AVX2 looks for it (in ``cache``, the run's
    ``$LIT_GRPO_CACHE``, as the folder its AVX2 cache key names) and check its weights are the recorded ones.
    Returns the run's environment and the parameters' checksums (a rollout server's weights must equal them)."""
    from transformers import LlamaForCausalLM

    from lit_grpo.training.warm_start import weights_fingerprint
    from lit_grpo.wire.weight_transfer import checksum

    warm = record["warm_start"]
    source = REFERENCE / warm["folder"]
    if not (source / "config.json").exists():
        raise FileNotFoundError(f"{source}: the reference's warm start is not committed; expected a Hugging Face "
                                "model directory (reproduce.py --record-avx2-reference writes it)")
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # one line per cell: no loading bar between them
    try:
        model = LlamaForCausalLM.from_pretrained(source)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    fingerprint = weights_fingerprint(model)
    if fingerprint != warm["fingerprint"]:
        raise ValueError(f"{source}: its weights' fingerprint is {fingerprint[:16]}..., the record's "
                         f"{warm['fingerprint'][:16]}...; expected the committed weights unchanged")
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{warm['model']}-{warm['replay_key']}"
    if not target.exists():
        try:
            target.symlink_to(source, target_is_directory=True)
        except OSError:  # no symlinks on this file system
            shutil.copytree(source, target)
    env = {**REPLAY_ENV, "LIT_GRPO_CACHE": str(cache)}
    return env, {name: checksum(p) for name, p in model.named_parameters()}


def commit_warm_start(alias: str, built: Path, fingerprint: str) -> dict:
    """Copy the committed result's warm start, ``built`` (its cache folder), into the reference folder and return
    its record: model, folder, the cache key and instruction set it was built under, its fingerprint (which must be
    ``fingerprint``, the one the result records) and ``replay_key``, the AVX2 cache key a replay files it under."""
    saved = json.loads((built / "warm_start.json").read_text())
    if saved["fingerprint"] != fingerprint:
        raise ValueError(f"{built}: its weights' fingerprint is {saved['fingerprint'][:16]}..., the result's "
                         f"{fingerprint[:16]}...; expected the warm start the result started from")
    target = REFERENCE / built.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(built, target)
    return {"model": alias, "folder": built.name, "cache_key": built.name.removeprefix(f"{alias}-"),
            "built_under": saved["environment"]["cpu_capability"], "fingerprint": fingerprint,
            "replay_key": avx2_key(alias)}


def record_for(result: str, description: str, steps: int, committed: dict[str, dict[int, float]],
               measured: dict[str, dict[int, float]], warm: dict, capability: str) -> dict:
    """The reference record of a run: the points of ``committed`` (the native cell's compared prefix) as the
    reference run measured them, and what the run depended on. A point the run did not log is an error."""
    missing = [f"{name}@{step}" for name, points in committed.items() for step in points
               if step not in measured.get(name, {})]
    if missing:
        raise ValueError(f"{result}: the reference run logged no {', '.join(missing[:5])}; expected every point "
                         "the committed cell compares")
    return {"result": result, "description": description, "steps": steps,
            "result_digest": points_digest(committed), **versions(), "cpu_capability": capability,
            "environment": {**REPLAY_ENV, "OMP_NUM_THREADS": "1"},
            "recorded_on": f"{cpu_name()} ({capability} here, {CAPABILITY} dispatched)", "warm_start": warm,
            "series": {name: {str(step): measured[name][step] for step in sorted(points)}
                       for name, points in sorted(committed.items())}}
