"""Seconds per weight sync to the project's rollout server, in GB/s, next to the in-process copy.

The job: SmolLM2-135M-Instruct in float32 (0.54 GB of parameters) sharded with FSDP2 (``fully_shard`` per decoder
layer, as the trainer does) over 2 CPU processes on gloo; rank 0 pushes it to ``python -m lit_grpo serve`` on
127.0.0.1 with ``ServerEngine.load_weights`` given ``full_named_parameters(model)``, as ``WeightSync`` does (a
whole sync: the gather to rank 0, ``rank0_buckets``, where rank 1 sends its shards point to point one 64 MB bucket
at a time, the cast, each bucket broadcast over the server's own gloo group, the server's staging and swap, the
version round trip). The reference is ``TransformersEngine.load_weights`` in one process (a ``copy_`` of every
parameter into the engine's private copy), the in-process engine's sync.

Rank 0 reports where a sync's time goes (``ServerEngine.pusher.last_push``): ``begin`` (weight_info, pause, start),
``gather`` (the gather to rank 0 and the casts), ``send`` (packing a bucket, a view when it already lies back to
back, announcing it, broadcasting it and waiting for the server to take it) and ``finish`` (the server's swap, the
version, resume). Separate passes time the gathers alone (no server): the gather to rank 0, and the
per-parameter ``full_tensor()`` all-gathers of every rank that the push used before (what ``WeightSync`` still
runs for an in-process engine). The server's weights are checked against the gathered policy (SHA-256 of every
parameter) after the last sync.

    python benchmarks/sync_speed.py                      # 1 warm-up + 5 measured syncs
    python benchmarks/sync_speed.py --model tiny-random-llama --syncs 2     # smoke test

Writes ``benchmarks/results/sync_speed.json`` and prints a table. Wall-clock numbers: run it on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))
OUTPUT = REPO_ROOT / "benchmarks" / "results" / "sync_speed.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--url", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def in_process(args: argparse.Namespace) -> dict:
    import torch

    from lit_grpo.engines.transformers_engine import TransformersEngine
    from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    engine = TransformersEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    times = []
    for step in range(args.warmup + args.syncs):
        start = time.perf_counter()
        engine.load_weights(model.named_parameters(), step)
        times.append(time.perf_counter() - start)
    return {"bytes": nbytes, "seconds": times[args.warmup:]}


def rank_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lit_grpo.core.distributed import full_named_parameters, fully_shard_model
    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.engines.remote.weight_gather import GatherBuffer, rank0_buckets
    from lit_grpo.models.loading import load_model_and_tokenizer
    from lit_grpo.wire.weight_transfer import checksum

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, _ = load_model_and_tokenizer(args.model)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    fully_shard_model(model, init_device_mesh("cpu", (dist.get_world_size(),)))
    engine = ServerEngine(url=args.url, bucket_mb=args.bucket_mb, timeout_s=300)
    syncs, gathers, rank0_gathers = [], [], []
    buffer = GatherBuffer()
    bucket_bytes = int(args.bucket_mb * 2**20)
    for step in range(args.warmup + args.syncs):
        dist.barrier()
        start = time.perf_counter()
        engine.load_weights(full_named_parameters(model), step)
        syncs.append({"seconds": time.perf_counter() - start, **engine.pusher.last_push})
        dist.barrier()
        start = time.perf_counter()
        for _ in rank0_buckets(model, bucket_bytes, buffer):
            pass
        rank0_gathers.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        for _ in full_named_parameters(model):
            pass
        gathers.append(time.perf_counter() - start)
    full = {name: checksum(t) for name, t in full_named_parameters(model)}
    if rank == 0:
        exact = all(s == full for s in engine.weight_checksums().values())
        Path(args.result).write_text(json.dumps({
            "bytes": nbytes, "syncs": syncs[args.warmup:], "gather_only_seconds": gathers[args.warmup:],
            "rank0_gather_only_seconds": rank0_gathers[args.warmup:],
            "server_equals_policy": exact, "server_version": engine.weight_versions(),
        }))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: argparse.Namespace, url: str, token: str, result: Path) -> None:
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank),
                   LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(args.threads), LIT_GRPO_SERVER_TOKEN=token,
                   HF_HUB_OFFLINE="1")
        cmd = [sys.executable, __file__, "--worker", "rank", "--url", url, "--result", str(result), "--model",
               args.model, "--syncs", str(args.syncs), "--warmup", str(args.warmup), "--bucket-mb",
               str(args.bucket_mb), "--threads", str(args.threads)]
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def main() -> None:
    args = parse_args()
    if args.worker == "rank":
        rank_worker(args)
        return
    if args.worker == "inprocess":
        Path(args.result).write_text(json.dumps(in_process(args)))
        return
    from server_process import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("in-process copy ...", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, __file__, "--worker", "inprocess", "--result", str(tmp / "inprocess.json"),
                        "--model", args.model, "--syncs", str(args.syncs), "--warmup", str(args.warmup),
                        "--threads", str(args.threads)], check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        inproc = json.loads((tmp / "inprocess.json").read_text())
        print("starting the server ...", file=sys.stderr, flush=True)
        server = ServerProcess(tmp / "server", model=args.model, args=("--threads", str(args.threads)),
                               token=secrets.token_hex(16))
        try:
            url = server.wait_ready()
            print("2 FSDP2 ranks pushing ...", file=sys.stderr, flush=True)
            run_ranks(args, url, server.token, tmp / "ranks.json")
        finally:
            server.kill()
        ranks = json.loads((tmp / "ranks.json").read_text())
    gb = ranks["bytes"] / 1e9
    med = statistics.median
    sync_s = med(s["seconds"] for s in ranks["syncs"])
    copy_s = med(inproc["seconds"])
    parts = {k: med(s[k] for s in ranks["syncs"]) for k in ("begin_s", "gather_s", "send_s", "finish_s")}
    gather_only = med(ranks["gather_only_seconds"])
    rank0_only = med(ranks["rank0_gather_only_seconds"])
    spread = [s["seconds"] for s in ranks["syncs"]]
    report = {
        "model": args.model, "gigabytes": gb, "bucket_mb": args.bucket_mb, "threads_per_process": args.threads,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "in_process_copy": {"seconds": copy_s, "gb_per_s": gb / copy_s, "all": inproc["seconds"]},
        "server_sync": {"seconds": sync_s, "gb_per_s": gb / sync_s, "parts_s": parts,
                        "min_max_s": [min(spread), max(spread)], "rank0_gather_only_s": rank0_only,
                        "full_tensor_gather_only_s": gather_only, "all": ranks["syncs"],
                        "rank0_gather_only_all": ranks["rank0_gather_only_seconds"],
                        "full_tensor_gather_only_all": ranks["gather_only_seconds"]},
        "server_equals_policy": ranks["server_equals_policy"], "server_version": ranks["server_version"],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"{args.model}: {gb:.3f} GB of parameters, median of {args.syncs} syncs after {args.warmup} warm-up, "
          f"{args.threads} torch thread(s) per process, {os.cpu_count()} CPUs")
    print("| sync | seconds | GB/s |\n|---|---|---|")
    print(f"| in-process copy (TransformersEngine.load_weights) | {copy_s:.3f} | {gb / copy_s:.2f} |")
    print(f"| 2 FSDP2 ranks -> rollout server, whole sync | {sync_s:.3f} | {gb / sync_s:.2f} |")
    print(f"|   fastest / slowest sync | {min(spread):.3f} / {max(spread):.3f} | "
          f"{gb / min(spread):.2f} / {gb / max(spread):.2f} |")
    for key, value in parts.items():
        print(f"|   rank 0: {key[:-2]} | {value:.3f} | |")
    print(f"| gather to rank 0 alone (rank0_buckets, no server) | {rank0_only:.3f} | {gb / rank0_only:.2f} |")
    print(f"| full_tensor() gathers alone on every rank (no server) | {gather_only:.3f} | {gb / gather_only:.2f} |")
    print(f"server weights equal the gathered policy: {ranks['server_equals_policy']}")


if __name__ == "__main__":
    main()
