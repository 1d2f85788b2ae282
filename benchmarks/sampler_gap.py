r"""The sampler-to-trainer log-prob gap of every engine, measured the same way: what the first-push check
(``lit_grpo.data.sampler_check``) compares, over every sampled token.

The job: a model directory (default: SmolLM2-135M-Instruct, exported by ``python -m lit_grpo export --model
smollm2-135m-instruct DIR``), 4 GSM8K train prompts (chat-formatted) x 4 completions of up to 48 tokens at
temperature ``--temperature``, the same seeds for every engine. Each engine gets the weights of the directory (the
servers by a push, as in training) and samples; the trainer's side teacher-forces the completions in float32 with one
plain forward each; the gap is mean |sampler log-prob - teacher-forced log-prob| per token.

Engines: ``transformers`` (the in-process engine), ``server`` (``python -m lit_grpo serve``, one thread),
``vllm`` (colocated) and ``vllm-serve`` (``vllm serve`` with the flags docs/rollout-server.md prints, the gloo push).
``--sampler-dtype bfloat16`` samples in bfloat16 (the in-process engine under bf16 autocast, the servers and vLLM
with bfloat16 weights) against the float32 trainer: the gap the first-push check's default must let through.
``--polluted`` writes a ``generation_config.json`` that sets every sampling field into a copy of the directory first
(``tests/polluted_config.py``'s values): the gap must not change. vLLM needs the vLLM tier's environment.

    python benchmarks/sampler_gap.py --model ~/models/smollm2 --engines transformers server vllm vllm-serve
    python benchmarks/sampler_gap.py --model ~/models/smollm2 --sampler-dtype bfloat16 --polluted

Each engine runs in a subprocess of its own (``--worker``). Results go to ``benchmarks/results/sampler_gap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from worker_runs import report, run_worker

ENGINES = ("transformers", "server", "vllm", "vllm-serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    parser.add_argument("--model", default=str(Path("~/models/smollm2").expanduser()), help="a model directory")
    parser.add_argument("--sampler-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--polluted", action="store_true", help="a generation config that sets every sampling field")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", default="benchmarks/results/sampler_gap.json")
    parser.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def prompts_of(tokenizer: Any) -> list[list[int]]:
    from lit_grpo.data.gsm8k import load_gsm8k
    from lit_grpo.data.prompts import prompt_ids

    return [prompt_ids(tokenizer, row["question"]) for row in load_gsm8k("bundled", split="train")[:4]]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(name: str, args: argparse.Namespace, token: str, log: Any) -> tuple[subprocess.Popen, str]:
    """The project's server or ``vllm serve`` on 127.0.0.1, started from the model directory; ``(process, url)``."""
    env = dict(os.environ, LIT_GRPO_SERVER_TOKEN=token, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1")
    port = free_port()
    if name == "server":
        cmd = [sys.executable, "-m", "lit_grpo", "serve", "--model", args.model, "--port", str(port),
               "--threads", "1", "--dtype", args.sampler_dtype]
    else:
        from lit_grpo.engines.vllm_cpu import SERVE_CPU_FLAGS

        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model,
               "--dtype", args.sampler_dtype, "--host", "127.0.0.1", "--port", str(port), "--api-key", token,
               "--max-model-len", "1024", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
               "--weight-transfer-config", json.dumps({"backend": "gloo"}), *SERVE_CPU_FLAGS]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with {proc.returncode}; see its log")
        try:
            request = urllib.request.Request(url + ("/health"), headers={"Authorization": f"Bearer {token}"})
            urllib.request.urlopen(request, timeout=5)
            return proc, url
        except OSError:
            time.sleep(2)
    proc.kill()
    raise SystemExit(f"{name} did not answer within 900 s")


def worker(args: argparse.Namespace) -> None:
    import torch

    from lit_grpo.data.sampler_check import sampler_gap
    from lit_grpo.engines.base import SamplingConfig
    from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, "float32")
    model.eval()
    prompts = prompts_of(tokenizer)
    sampling = SamplingConfig(max_new_tokens=48, temperature=args.temperature)
    eos = eos_token_ids(tokenizer, model)
    bf16 = args.sampler_dtype == "bfloat16"
    start = time.perf_counter()
    if args.worker == "transformers":
        from lit_grpo.engines.transformers_engine import TransformersEngine

        engine = TransformersEngine(model, eos, tokenizer.pad_token_id, compile=False, rescore=False)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            groups = engine.generate(prompts, 4, sampling, seed=0)
    elif args.worker == "vllm":
        from lit_grpo.engines.vllm_engine import VLLMEngine

        engine = VLLMEngine(args.model, tokenizer=tokenizer, dtype=args.sampler_dtype, max_model_len=1024,
                            enforce_eager=True)
        groups = engine.generate(prompts, 4, sampling, seed=0)
    else:
        from lit_grpo.engines.remote.client import ServerEngine

        token = secrets.token_hex(16)
        log_path = Path(tempfile.mkdtemp()) / f"{args.worker}.log"
        with open(log_path, "w") as log:
            proc, url = start_server(args.worker, args, token, log)
            try:
                kind = "lit_grpo" if args.worker == "server" else "vllm"
                engine = ServerEngine(url=url, token=token, kind=kind, backend="gloo", dtype=args.sampler_dtype,
                                      policy=model, stop_token_ids=eos, timeout_s=300)
                engine.load_weights(model.named_parameters(), step=1)  # the trainer's weights, cast on the wire
                groups = engine.generate(prompts, 4, sampling, seed=0)
                engine.close()
            finally:
                proc.terminate()
                proc.wait(60)
    seconds = time.perf_counter() - start
    total, count = sampler_gap(model, prompts, groups, args.temperature, sequences=10**9, device=torch.device("cpu"))
    report({"engine": args.worker, "sampler_dtype": args.sampler_dtype, "polluted": args.polluted,
            "temperature": args.temperature, "tokens": count, "mean_gap": total / max(count, 1),
            "seconds": seconds})


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    model = Path(args.model).expanduser()
    if args.polluted:  # a copy, so the directory others use keeps its own generation config
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from polluted_config import write_polluted_generation_config

        copy = Path(tempfile.mkdtemp()) / model.name
        shutil.copytree(model, copy)
        write_polluted_generation_config(copy)
        model = copy
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    results = []
    for name in args.engines:
        cmd = [__file__, "--worker", name, "--model", str(model), "--sampler-dtype",
               args.sampler_dtype, "--temperature", str(args.temperature), "--threads", str(args.threads)]
        cmd += ["--polluted"] if args.polluted else []
        results.append(run_worker(name, cmd, env))
        r = results[-1]
        print(f"{r['engine']:<14}{r['sampler_dtype']:>10} polluted={r['polluted']!s:<6}T={r['temperature']:<5}"
              f"tokens {r['tokens']:>5}  mean gap {r['mean_gap']:.2e}  ({r['seconds']:.0f} s)", flush=True)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(output.read_text())["results"] if output.exists() else []
    output.write_text(json.dumps({"results": previous + results}, indent=2))


if __name__ == "__main__":
    main()
