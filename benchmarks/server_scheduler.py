"""Several trainer ranks against one rollout server: the server's one decode loop (this tree) against one batch per
request (the tree before it, ``--ref``), side by side in one run.

Each side starts ``python -m lit_grpo serve`` from its own tree with the same model, threads and cap, then
``--ranks`` client threads (a rank each: one request of ``--prompts`` x ``--generations`` completions, the rank's
own seed) send their requests at the same moment, ``--warmup`` rounds then ``--rounds`` measured. A round's time is
from the first request sent to the last answer. The sides get the same seeds, so they sample the same completions
up to the floating-point differences of kernels run on another batch size (a request alone in the decode loop gets
exactly the old completions; ``identical_completions`` in the JSON: the share that came out token for token the
same); the time per round and the completion tokens per second are compared.

    python benchmarks/server_scheduler.py                               # SmolLM2-135M, 2 ranks x 2 prompts x 8
    python benchmarks/server_scheduler.py --model tiny-random-llama --rounds 2   # a smoke run
    python benchmarks/server_scheduler.py --max-num-seqs 8              # the cap on both sides

The sides run one after the other, each its own server process; pin them with ``taskset`` for a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: the commit before the decode loop was shared: each request decoded on its own thread
DEFAULT_REF = "8100ea9"


def start_server(tree: Path, model: str, threads: int, max_num_seqs: int | None, workdir: Path,
                 token: str) -> tuple[subprocess.Popen, str]:
    """``lit_grpo serve`` run from ``tree`` (its package first on the path) on a free loopback port."""
    token_file = workdir / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    command = [sys.executable, "-m", "lit_grpo", "serve", "--model", model, "--port", "0", "--token-file",
               str(token_file), "--threads", str(threads), "--device", "cpu", "--max-n", "64"]
    if max_num_seqs is not None:
        command += ["--max-num-seqs", str(max_num_seqs)]
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads))
    log = open(workdir / "server.log", "w")
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if "listening on " in line:
            return proc, line.split("listening on ")[1].split()[0]
        if proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"the server of {tree} did not start; see {workdir / 'server.log'}")


def post(url: str, token: str, body: dict) -> dict:
    """One completion request, with the trainer's own HTTP client."""
    from lit_grpo.wire.protocol import HTTPClient

    return HTTPClient(url, token, 3600).post("/v1/completions", body)


def prompts(model: str, count: int, ranks: int) -> list[list[list[int]]]:
    """Each rank's prompts: chat-formatted word problems, token ids of ``model``'s tokenizer."""
    from lit_grpo.models.loading import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer(model)
    questions = [f"Tom has {7 + i} apples and buys {3 * i + 2} more. He gives away {i + 1}. How many apples does "
                 f"he have now? Think step by step." for i in range(count * ranks)]
    if tokenizer.chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in questions]
    else:  # the tiny test tokenizer has no template
        texts = questions
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [ids[r * count:(r + 1) * count] for r in range(ranks)]


def run_side(name: str, tree: Path, args: argparse.Namespace, rank_prompts: list[list[list[int]]]) -> dict:
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(tree, args.model, args.threads, args.max_num_seqs, Path(tmp), token)
        try:
            times, tokens, answers = [], [], []
            for round_ in range(args.warmup + args.rounds):
                out: list[dict | None] = [None] * len(rank_prompts)

                def send(rank: int, round_: int = round_, out: list = out) -> None:
                    out[rank] = post(url, token, {"prompt": rank_prompts[rank], "n": args.generations,
                                                  "max_tokens": args.max_new_tokens, "temperature": 1.0,
                                                  "top_p": 1.0, "seed": 1000 * round_ + rank, "logprobs": 0,
                                                  "return_token_ids": True})
                threads = [threading.Thread(target=send, args=(r,)) for r in range(len(rank_prompts))]
                start = time.perf_counter()
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                seconds = time.perf_counter() - start
                if round_ >= args.warmup:
                    times.append(seconds)
                    tokens.append(sum(o["usage"]["completion_tokens"] for o in out))
                    answers.append([[c["token_ids"] for c in o["choices"]] for o in out])
                print(f"{name}: round {round_}{' (warm-up)' if round_ < args.warmup else ''}: {seconds:.2f} s, "
                      f"{sum(o['usage']['completion_tokens'] for o in out)} completion tokens", flush=True)
        finally:
            proc.kill()
            proc.wait()
    return {"seconds": times, "completion_tokens": tokens, "tokens_per_s": sum(tokens) / sum(times),
            "seconds_per_round": sum(times) / len(times), "answers": answers}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank's request")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ref", default=DEFAULT_REF, help="the tree whose server decodes each request alone")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "server_scheduler.json")
    args = parser.parse_args(argv)
    rank_prompts = prompts(args.model, args.prompts, args.ranks)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(before), args.ref],
                       check=True, capture_output=True)
        try:
            results["one batch per request"] = run_side("one batch per request", before, args, rank_prompts)
            results["one decode loop"] = run_side("one decode loop", REPO_ROOT, args, rank_prompts)
        finally:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(before)], check=False,
                           capture_output=True)
    old, new = results["one batch per request"], results["one decode loop"]
    pairs = [(a, b) for r_old, r_new in zip(old["answers"], new["answers"]) for o, n in zip(r_old, r_new)
             for a, b in zip(o, n)]
    same = sum(a == b for a, b in pairs) / len(pairs)
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "identical_completions": same,
              "sides": {k: {f: v for f, v in r.items() if f != "answers"} for k, r in results.items()},
              "speedup": old["seconds_per_round"] / new["seconds_per_round"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{args.ranks} ranks x {args.prompts} prompts x {args.generations} completions, {args.max_new_tokens} new "
          f"tokens, {args.model}, server threads {args.threads}, max_num_seqs {args.max_num_seqs}")
    for name, r in report["sides"].items():
        print(f"  {name:>22}: {r['seconds_per_round']:.2f} s per round, {r['tokens_per_s']:.1f} completion tok/s")
    print(f"  speed-up {report['speedup']:.2f}x; completions token for token the same on both sides: {same:.0%}")


if __name__ == "__main__":
    main()
