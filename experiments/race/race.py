"""A race on a task no one here wrote: lit_grpo against TRL's ``GRPOTrainer`` on a real pretrained model
(SmolLM2-135M-Instruct by default, any model directory with ``--model``) and reasoning-gym tasks, scored by the
tasks' own scorers. The results and how they were made: ``docs/race.md``.

One row is a side and its options: ``--side trl``; ``--side ours`` (on-policy, v = 1); ``--side ours
--sync-every 4`` (off-policy, v = 4); ``--side ours --max-staleness 1`` (asynchronous, K = 1, with the project's
rollout server started here on the loopback). Each row trains, saving its weights at every ``--eval-every`` steps
and timing the training alone, then the one evaluator (``race_eval.py``) scores every saved step on the same
held-out questions, and the weights are deleted.

    python experiments/race/race.py train --side ours --seed 0            # one row: train, then evaluate
    python experiments/race/race.py train --side trl --seed 0
    python experiments/race/race.py evaluate                              # evaluate what a train left pending
    python experiments/race/race.py report                                # table (docs/race.md) and figure

Each run writes ``experiments/results/race/<task>/<row>_seed<seed>.json``: its configuration, the training
seconds and held-out accuracy at each evaluated step, and its logged per-step reward. Threads: ``--threads``
(default 1), so a row measured on one core can be compared with another measured on one core.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _threads_from_argv(argv: list[str]) -> str:
    """``--threads N`` of the command line (1 by default), read before torch is imported: OpenMP sizes its pool
    from ``OMP_NUM_THREADS`` once, and both trainers should run on exactly the threads asked for."""
    for i, arg in enumerate(argv):
        if arg == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--threads="):
            return arg.split("=", 1)[1]
    return "1"


for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = _threads_from_argv(sys.argv)
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # experiments/: the rollout server helper of the miniature runs

from race_config import RaceConfig, dumps  # noqa: E402

REPO = HERE.parents[1]
RESULTS = REPO / "experiments" / "results" / "race"
WEIGHTS = REPO / "runs" / "race"


def task_label(task: str) -> str:
    """``reasoning_gym:letter_counting:min_words=3:...`` -> ``letter_counting``."""
    return task.split(":")[1] if task.startswith("reasoning_gym:") else task.replace("/", "_")


def race_name(config: RaceConfig) -> str:
    """The folder of the row's results: its race's name, or the task's."""
    return config.race or task_label(config.task)


def run_path(config: RaceConfig) -> Path:
    return RESULTS / race_name(config) / f"{config.row}_seed{config.seed}.json"


def weights_dir(config: RaceConfig) -> Path:
    return WEIGHTS / race_name(config) / f"{config.row}_seed{config.seed}"


def machine() -> dict[str, Any]:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores_available": len(os.sched_getaffinity(0)), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version()}


def versions() -> dict[str, str]:
    from importlib.metadata import version

    return {name: version(name) for name in ("lit_grpo", "trl", "transformers", "lightning", "reasoning_gym")}


def train(config: RaceConfig, server_cpus: set[int] | None = None) -> Path:
    import torch

    torch.set_num_threads(config.threads)
    target = weights_dir(config)
    shutil.rmtree(target, ignore_errors=True)
    began = time.perf_counter()
    if config.side == "trl":
        from side_trl import train as train_side

        record = train_side(config, target)
    else:
        from side_ours import train as train_side

        if config.max_staleness:
            # the project's rollout server (one thread, float32, loopback), checked to hold the trainer's weights
            from miniature_server import MiniatureServer, parameter_checksums

            with MiniatureServer(config.model, target / "server", parameter_checksums(config.model)) as server:
                if server_cpus:  # the paper's layout in miniature: the server on a core of its own
                    os.sched_setaffinity(server.proc.pid, server_cpus)
                record = train_side(config, target, server=(server.url, str(server.token_file)))
        else:
            record = train_side(config, target)
    out = run_path(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"config": config.to_json(), "row": config.row, "machine": machine(), "versions": versions(),
              "process_seconds": time.perf_counter() - began,
              # Linux reports ru_maxrss in KiB: the high-water mark of the whole process, model loading included
              "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "server_cpus": sorted(server_cpus) if server_cpus else None,
              "trainer_cpus": sorted(os.sched_getaffinity(0)),
              "train_seconds": {int(k): v for k, v in record["train_seconds"].items()},
              "train_steps": record["steps"], "trl_options": record.get("trl_options"),
              "trl_effective_precision": record.get("trl_effective_precision"), "eval": {}}
    out.write_text(dumps(result))
    print(f"trained {config.row} seed {config.seed}: {result['train_seconds']}", flush=True)
    return out


def evaluate(paths: list[Path], threads: int, only: set[int] | None = None) -> None:
    """Score every run in ``paths`` whose weights are still on disk, then delete them; with ``only``, score just
    those steps (step 0 and the last are always scored) and delete the others unscored."""
    import torch
    from race_eval import Evaluator, base_accuracy

    torch.set_num_threads(threads)
    evaluators: dict[str, Evaluator] = {}
    for path in paths:
        result = json.loads(path.read_text())
        config = RaceConfig(**result["config"])
        folder = weights_dir(config)
        files = sorted(folder.glob("step_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
        if not files and result["eval"]:
            continue
        key = json.dumps({k: result["config"][k] for k in ("task", "model", "prompt")})
        evaluator = evaluators.get(key) or evaluators.setdefault(key, Evaluator(config))
        evaluator.config = config
        result["eval"]["0"] = base_accuracy(evaluator, path.parent / "base_eval.json")
        for file in files:
            step = int(file.stem.split("_")[1])
            if only is not None and step not in only and step != config.steps:
                file.unlink()
                continue
            result["eval"][str(step)] = evaluator.accuracy(file)
            print(f"{path.stem} step {step}: {result['eval'][str(step)]['accuracy']:.3f}", flush=True)
            path.write_text(dumps(result))
            file.unlink()
        path.write_text(dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train one row, then evaluate it")
    for field in dataclasses.fields(RaceConfig):
        kind = type(field.default)
        train_parser.add_argument("--" + field.name.replace("_", "-"), default=field.default,
                                  type=(lambda text: text.lower() in ("1", "true", "yes")) if kind is bool else kind)
    train_parser.add_argument("--no-eval", action="store_true", help="leave the evaluation for `evaluate`")
    train_parser.add_argument("--server-cpus", default=None,
                              help="K >= 1: the CPUs the rollout server runs on, e.g. '1' (default: the trainer's)")
    eval_parser = commands.add_parser("evaluate", help="evaluate every run whose weights are still on disk")
    eval_parser.add_argument("--threads", type=int, default=1)
    eval_parser.add_argument("--steps", default=None,
                             help="comma-separated steps to score (default: every saved one); 0 and the last always")
    eval_parser.add_argument("runs", nargs="*", type=Path)
    commands.add_parser("report", help="write the table and the figure")
    args = parser.parse_args(argv)
    if args.command == "train":
        options = {f.name: getattr(args, f.name) for f in dataclasses.fields(RaceConfig)}
        cpus = {int(c) for c in args.server_cpus.split(",")} if args.server_cpus else None
        path = train(RaceConfig(**options), server_cpus=cpus)
        if not args.no_eval:
            evaluate([path], options["threads"])
    elif args.command == "evaluate":
        only = {int(s) for s in args.steps.split(",")} if args.steps else None
        evaluate(args.runs or sorted(RESULTS.glob("*/*_seed*.json")), args.threads, only)
    else:
        from race_report import report

        report(RESULTS, REPO / "docs" / "race.md")


if __name__ == "__main__":
    main()
