"""What a dead rollout server costs a step (``lit_grpo.engines.remote.fleet``), with 2 and 3 project servers.

For each fleet size: start the servers (``python -m lit_grpo serve``, the tiny model, one thread each), push the
policy, then time request rounds (one rank's ``request_rollouts`` over every server, ``--prompts`` prompts x
``--n``) in four phases: all up; the round right after one server is killed with SIGKILL (its request retried
``RETRY_DELAYS_S``, then sent to the next server up); the rounds after it (the dead one out of routing); the push
that follows (the dead one skipped) and, after the server is restarted at its URL, the push that brings it back and
a round with it. Prints a table and writes JSON (``--out``).

    taskset -c 0 python benchmarks/fleet_failover.py --servers 2 3 --out fleet_failover.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.remote.fleet import RETRY_DELAYS_S
from lit_grpo.models.loading import load_model_and_tokenizer

READY = re.compile(r"listening on (http://\S+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, token_file: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "lit_grpo", "serve", "--model", "tiny-random-llama",
                             "--port", str(port), "--token-file", str(token_file), "--threads", "1"],
                            env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)


def wait_ready(proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if READY.search(line or ""):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"a server exited with {proc.returncode}")
    raise RuntimeError("a server did not start in time")


def timed(call) -> float:  # noqa: ANN001
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(num_servers: int, prompts: int, n: int, rounds: int, workdir: Path) -> dict:
    token = secrets.token_hex(16)
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    ports = [free_port() for _ in range(num_servers)]
    procs = [start_server(p, token_file, workdir / f"server{i}.log") for i, p in enumerate(ports)]
    try:
        for proc in procs:
            wait_ready(proc)
        model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
        engine = ServerEngine(policy=model, urls=[f"http://127.0.0.1:{p}" for p in ports], token=token,
                              timeout_s=30, bucket_mb=1)
        batch = [tokenizer.encode(f"What is {i} + {i}?") for i in range(prompts)]
        sampling = SamplingConfig(max_new_tokens=16)
        step = 1

        def round_() -> None:
            result = engine.request_rollouts(batch, n, sampling, seed=step)
            if result.error is not None:
                raise result.error

        engine.load_weights(model.named_parameters(), step)
        round_()  # warm
        up = [timed(round_) for _ in range(rounds)]
        os.kill(procs[-1].pid, signal.SIGKILL)
        procs[-1].wait()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_round = timed(round_)
            after = [timed(round_) for _ in range(rounds)]
            step += 1
            push_without = timed(lambda: engine.load_weights(model.named_parameters(), step))
            procs[-1] = start_server(ports[-1], token_file, workdir / "restarted.log")
            wait_ready(procs[-1])
            step += 1
            push_rejoin = timed(lambda: engine.load_weights(model.named_parameters(), step))
            back = [timed(round_) for _ in range(rounds)]
        servers_up = engine.routing_stats()["servers_up"]
        engine.close()
        return {"servers": num_servers, "prompts": prompts, "n": n, "round_all_up_s": min(up),
                "round_of_the_loss_s": loss_round, "round_after_s": min(after),
                "push_without_it_s": push_without, "push_with_its_rejoin_s": push_rejoin,
                "round_after_rejoin_s": min(back), "servers_up_at_the_end": servers_up,
                "retry_delays_s": list(RETRY_DELAYS_S)}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--prompts", type=int, default=6, help="prompts per round (spread over the servers)")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="rounds timed per phase (the fastest is reported)")
    parser.add_argument("--out", default="fleet_failover.json")
    args = parser.parse_args()
    rows = []
    for count in args.servers:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(measure(count, args.prompts, args.n, args.rounds, Path(tmp)))
    print(f"{'servers':>7}  {'round, all up':>13}  {'round of the loss':>17}  {'round after':>11}  "
          f"{'push without it':>15}  {'push, rejoin':>12}  {'round, rejoined':>15}")
    for r in rows:
        print(f"{r['servers']:>7}  {r['round_all_up_s']:>12.2f}s  {r['round_of_the_loss_s']:>16.2f}s  "
              f"{r['round_after_s']:>10.2f}s  {r['push_without_it_s']:>14.2f}s  {r['push_with_its_rejoin_s']:>11.2f}s"
              f"  {r['round_after_rejoin_s']:>14.2f}s")
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
