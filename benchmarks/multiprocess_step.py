"""Step time and peak memory per process of GRPO training in 1 process, 2 DDP processes, 2 FSDP2 processes, 2 FSDP2
processes with the project's rollout server (the paper's layout on CPU), and 1 trainer process with the server.

The job is the demo shape of ``step_time.py``: SmolLM2-135M-Instruct in float32, a frozen reference (beta 0.1),
2 GSM8K prompts x G = 8 completions per step, 64 new tokens, temperature 1.0, one AdamW step per rollout batch,
weights synced to the in-process rollout engine every step (v = 1), no Theorem-1 after-update pass (``--tv-monitor``
adds it: one more no-grad forward, on by default in training). The global batch is the same in every layout:
1 process draws both prompts; 2 processes draw one each. In the ``server`` layout a third process
(``python -m lit_grpo serve``, one thread) samples the rollouts and rank 0 pushes the weights to it every step;
``server1`` is one trainer process and the server; ``server2`` is two FSDP2 ranks and two servers, each rank's
prompts starting at a server of its own.

``--max-staleness 0 1`` runs the server layouts synchronously (K = 0: the server idles while the trainer updates and
the other way round) and asynchronously (K = 1: the server generates batch k + 1 while the trainer updates on batch
k, ``data.max_staleness``), and prints each K's step time as a fraction of K = 0's.

On a machine with few cores the processes share them (``--threads`` per process, default: cores / processes),
so this measures the overhead of the layouts, not a speed-up: gradient all-reduce (DDP), parameter all-gathers
and gradient reduce-scatters (FSDP2, in every forward and backward), the per-parameter gathers of the weight
sync, and the metric reductions.

Per layout and step it records the wall time of the whole step (sampling, rewards, reference and policy passes,
optimizer step, weight sync), its parts (``rollout``, ``update``, ``sync``), and each process's peak resident
memory (``ru_maxrss``).

    python benchmarks/multiprocess_step.py                       # 1 warm-up + 3 measured steps per layout
    python benchmarks/multiprocess_step.py --layouts fsdp2 --steps 5
    python benchmarks/multiprocess_step.py --model tiny-random-llama --steps 2   # quick smoke test
    python benchmarks/multiprocess_step.py --layouts server1 server --max-staleness 0 1 --threads 1 --steps 6
    python benchmarks/multiprocess_step.py --layouts single server1 --lora-r 0 8 16   # LoRA against full fine-tuning

``--lora-r`` runs each layout once per rank given (0: full fine-tuning; r >= 1: ``model.lora`` with that rank, its
other settings the defaults of ``lit_grpo.models.lora.LoraArgs``, and pi_ref = the policy with its adapter off), and
records
the bytes of each weight push (``sync/bytes``): with LoRA only the adapter travels.

Writes ``benchmarks/results/multiprocess_step.json`` and prints a table of medians.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
OUTPUT = REPO_ROOT / "benchmarks" / "results" / "multiprocess_step.json"
LAYOUTS = {"single": 1, "ddp": 2, "fsdp2": 2, "server": 2, "server1": 1, "server2": 2}
SERVED = ("server", "server1", "server2")
#: rollout servers of a served layout (``server2``: two, ``data.engine_options.urls``; each rank starts at its own)
SERVERS = {"server": 1, "server1": 1, "server2": 2}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=2, help="global prompts per step (split over processes)")
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: cores/procs)")
    parser.add_argument("--max-staleness", type=int, nargs="+", default=[0],
                        help="data.max_staleness values to run the server layouts with (K >= 1: asynchronous)")
    # off by default, as in step_time.py (the demo-shape job)
    parser.add_argument("--tv-monitor", action="store_true", help="model.monitor_tv_after_update: one more forward")
    parser.add_argument("--reference-on-server", action="store_true",
                        help="server layouts: the server also computes pi_ref's log-probs (data.reference_on_server), "
                             "so the trainer skips its reference pass")
    parser.add_argument("--lora-r", type=int, nargs="+", default=[0],
                        help="LoRA ranks to run each layout with (0: full fine-tuning, the default)")
    parser.add_argument("--lr", type=float, default=None,
                        help="learning rate (default: 1e-6 for full fine-tuning, 1e-5 with LoRA)")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    """One process of one layout: fit, time every step, print a JSON line."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lit_grpo.callbacks import WeightSync

    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.models.lora import LoraArgs
    from lit_grpo.training.module import GRPOModule
    from lit_grpo.training.optim import OptimizerArgs

    layout, world = args.worker, LAYOUTS[args.worker]
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))

    class Timer(Callback):
        def __init__(self) -> None:
            self.last = time.perf_counter()
            self.steps: list[dict] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
            now = time.perf_counter()
            m = trainer.callback_metrics
            self.steps.append({"total": now - self.last, "rollout": float(m["rollout/rollout_seconds"]),
                               "update": float(m["train/update_seconds"]), "sync": float(m.get("sync/seconds", 0)),
                               "reward": float(m["rollout/reward_mean"]), "bytes": float(m.get("sync/bytes", 0)),
                               "reference_served": float(m.get("train/reference_served", 0.0)),
                               # several servers: the sequences each got this step (the mean over ranks)
                               "server_sequences": [float(m[f"rollout/server_{i}_sequences"]) for i in range(8)
                                                    if f"rollout/server_{i}_sequences" in m]})
            self.last = time.perf_counter()

    timeout = timedelta(seconds=600)
    fsdp2 = ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1, timeout=timeout)
    strategy = {"single": "auto", "ddp": DDPStrategy(process_group_backend="gloo", timeout=timeout),
                "fsdp2": fsdp2, "server": fsdp2, "server1": "auto", "server2": fsdp2}[layout]
    # the server layouts: the ranks send their prompts to the project's rollout server, rank 0 pushes the weights
    engine = {"engine": "server", "max_staleness": args.max_staleness[0],
              "reference_on_server": args.reference_on_server,
              "engine_options": {"urls": os.environ["LIT_GRPO_BENCH_URL"].split(","), "timeout_s": 120,
                                 "generate_timeout_s": 900}} if layout in SERVED else {}
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy,
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[WeightSync(), timer],
                        default_root_dir=str(REPO_ROOT / "benchmarks" / "results" / "lightning_logs"))
    lora_r = args.lora_r[0]
    lr = args.lr if args.lr is not None else (1e-5 if lora_r else 1e-6)
    module = GRPOModule(model_name=args.model, beta=0.1, optimizer=OptimizerArgs(lr=lr),
                        lora=LoraArgs(r=lora_r) if lora_r else None,
                        max_completion_length=args.max_new_tokens, monitor_tv_after_update=args.tv_monitor,
                        log_completions_every_n_steps=None)
    data = RolloutDataModule(prompts_per_step=args.prompts // world, num_generations=args.generations,
                             micro_batch_size=args.prompts // world * args.generations,
                             max_new_tokens=args.max_new_tokens, rewards=["correctness"], seed=0, **engine)
    trainer.fit(module, datamodule=data)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps({"rank": trainer.global_rank, "steps": timer.steps[args.warmup:],
                                  "peak_rss_mib": peak_mib, "threads": torch.get_num_threads()}), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: str, args: argparse.Namespace) -> list[dict]:
    if layout not in SERVED:
        return run_ranks(layout, args, {})
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from server_process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        token = "b" * 32
        # one thread each: a server generates while the ranks wait
        servers = [ServerProcess(Path(tmp) / f"server{i}", model=args.model, token=token)
                   for i in range(SERVERS[layout])]
        try:
            urls = ",".join(server.wait_ready() for server in servers)
            return run_ranks(layout, args, {"LIT_GRPO_BENCH_URL": urls, "LIT_GRPO_SERVER_TOKEN": token})
        finally:
            for server in servers:
                server.kill()


def run_ranks(layout: str, args: argparse.Namespace, extra_env: dict[str, str]) -> list[dict]:
    world, port = LAYOUTS[layout], free_port()
    argv = [sys.executable, __file__, "--worker", layout, "--model", args.model, "--prompts", str(args.prompts),
            "--generations", str(args.generations), "--max-new-tokens", str(args.max_new_tokens),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--max-staleness", str(args.max_staleness[0]),
            "--lora-r", str(args.lora_r[0])]
    if args.lr is not None:
        argv += ["--lr", str(args.lr)]
    if args.threads:
        argv += ["--threads", str(args.threads)]
    if args.tv_monitor:
        argv.append("--tv-monitor")
    if args.reference_on_server:
        argv.append("--reference-on-server")
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                   NODE_RANK="0", LOCAL_RANK=str(rank), **extra_env)
        if world == 1:
            for key in ("MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK"):
                env.pop(key)
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{layout}: a process exited with {proc.returncode}")
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:]))
    return sorted(results, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.prompts % 2:
        raise SystemExit(f"--prompts must be even so that 2 processes share it, got {args.prompts}")
    if args.worker:
        worker(args)
        return
    report = {"machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()}, "args": vars(args) | {
        "output": str(args.output)}, "layouts": {}}
    print(f"{'layout':16} {'procs':>5} {'step s':>8} {'rollout s':>10} {'update s':>9} {'sync s':>7} "
          f"{'MB / push':>10} {'peak RSS MiB / process':>24}")
    for layout in args.layouts:
        for r in args.lora_r:
            for k in args.max_staleness if layout in SERVED else [0]:
                name = f"{layout}-K{k}" if layout in SERVED and args.max_staleness != [0] else layout
                name += f"-lora{r}" if r else ("-full" if args.lora_r != [0] else "")
                ranks = run_layout(layout, argparse.Namespace(**{**vars(args), "max_staleness": [k], "lora_r": [r]}))
                med = {key: statistics.median(s[key] for s in ranks[0]["steps"])
                       for key in ("total", "rollout", "update", "sync", "bytes")}
                report["layouts"][name] = {"ranks": ranks, "median": med}
                rss = " / ".join(f"{rank['peak_rss_mib']:,.0f}" for rank in ranks)
                base = name.replace(f"-K{k}", "-K0") if k else None
                synchronous = report["layouts"].get(base, {}).get("median", {}).get("total") if base else None
                ratio = f"  {med['total'] / synchronous:.2f}x K=0" if synchronous else ""
                full = report["layouts"].get(name.replace(f"-lora{r}", "-full"), {}).get("median", {}).get("bytes")
                share = f"  push {med['bytes'] / full:.2%} of full" if r and full else ""
                sent = [sum(col) for col in zip(*(s["server_sequences"] for s in ranks[0]["steps"]))]
                share += f"  sequences per server {sent}" if sent else ""
                print(f"{name:16} {len(ranks):>5} {med['total']:>8.2f} {med['rollout']:>10.2f} {med['update']:>9.2f} "
                      f"{med['sync']:>7.3f} {med['bytes'] / 1e6:>10.2f} {rss:>24}{ratio}{share}", flush=True)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
