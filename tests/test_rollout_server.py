"""The rollout server (``lit_grpo.serve.server``) and its client ``ServerEngine``, with real processes on 127.0.0.1:
two servers of the tiny model for the module, a sending process killed in the middle of a transfer, and the
second server stopped and killed at the end."""

from __future__ import annotations

import copy
import os
import secrets
import signal
import subprocess
import sys
import time

import pytest
import torch
from server_process import ROOT, ServerProcess

from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.remote.client import CHUNK_SEED_STRIDE, SEED_MODULUS, ServerEngine
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer
from lit_grpo.wire.protocol import ServerError
from lit_grpo.wire.weight_transfer import checksum

LIMITS = ("--max-prompts", "4", "--max-n", "8", "--max-tokens", "64", "--max-body-bytes", "100000")
SAMPLING = SamplingConfig(max_new_tokens=10, temperature=0.9)
TEXTS = ("What is 2+2?", "Name a prime.", "Hi", "12*3=")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    token = secrets.token_hex(16)  # one token for both: a two-server engine holds one
    a, b = (ServerProcess(root / name, args=LIMITS, token=token) for name in "ab")
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        a.kill()
        b.kill()


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")  # the servers build the very same weights
    prompts = [tokenizer.encode(t) for t in TEXTS]
    return model, tokenizer, prompts


def perturbed(model, seed: int):
    policy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return policy


def sums(model) -> dict[str, str]:
    return {name: checksum(p) for name, p in model.named_parameters()}


def client(server: ServerProcess, tiny, **kwargs) -> ServerEngine:
    model, tokenizer, _ = tiny
    options = dict(url=server.url, token=server.token, bucket_mb=0.05, stop_token_ids=eos_token_ids(tokenizer, model))
    return ServerEngine(**{**options, **kwargs})


def served_sums(server: ServerProcess) -> dict[str, str]:
    status, payload = server.call("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200, payload
    return payload["checksums"]


def as_tuples(groups):
    return [[(c.token_ids, c.logprobs, c.truncated) for c in g] for g in groups]


def test_push_is_exact_and_rollouts_equal_the_in_process_engine(servers, tiny, one_thread):
    a, _ = servers
    model, tokenizer, prompts = tiny
    policy = perturbed(model, 1)
    engine = client(a, tiny)
    assert served_sums(a) != sums(policy)  # the push has something to change
    with pytest.raises(ServerError, match="pushed no weights to it yet"):
        engine.generate(prompts[:2], 2, SAMPLING, seed=3)
    engine.load_weights(policy.named_parameters(), step=5)
    assert engine.synced_step == 5 and engine.weight_versions() == {a.url: "5"}
    assert served_sums(a) == sums(policy)
    got = engine.generate(prompts[:3], 3, SAMPLING, seed=11)
    local = TransformersEngine(policy, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
    assert as_tuples(got) == as_tuples(local.generate(prompts[:3], 3, SAMPLING, seed=11))
    assert as_tuples(got) != as_tuples(engine.generate(prompts[:3], 3, SAMPLING, seed=12))
    assert len({tuple(c.token_ids) for g in got for c in g}) > 1


def test_rollouts_of_another_weight_version_are_refused(servers, tiny):
    a, _ = servers
    _, _, prompts = tiny
    mine, other = client(a, tiny), client(a, tiny)
    mine.load_weights(perturbed(tiny[0], 2).named_parameters(), step=7)
    mine.generate(prompts[:1], 2, SAMPLING, seed=0)
    other.load_weights(perturbed(tiny[0], 3).named_parameters(), step=8)  # another trainer, or a restart
    with pytest.raises(ServerError, match=r"sampled with weight version \['8'\], but this trainer pushed version '7'"):
        mine.generate(prompts[:1], 2, SAMPLING, seed=0)


GUARDED = [
    ("POST", "/pause", None), ("POST", "/resume", None), ("GET", "/is_paused", None),
    ("GET", "/get_world_size", None), ("GET", "/weight_info", None),
    ("POST", "/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 1,
                                                            "rank_offset": 1, "world_size": 2}}),
    ("POST", "/shutdown_weight_transfer_engine", None), ("POST", "/start_weight_update", None),
    ("POST", "/update_weights", {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"],
                                                 "shapes": [[1, 1]]}}),
    ("POST", "/finish_weight_update", {"weight_version": "666"}),
    ("POST", "/update_weight_version", {"new_version": "666"}),
    ("POST", "/weight_checker", {"action": "checksum"}),
    ("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
]


def test_missing_or_wrong_token_gets_401_and_changes_nothing(servers, tiny):
    a, _ = servers
    engine = client(a, tiny)
    engine.load_weights(perturbed(tiny[0], 4).named_parameters(), step=9)
    before = (a.call("GET", "/weight_info")[1], served_sums(a))
    assert before[0]["weight_version"] == "9" and before[0]["transfer_group"] and not before[0]["paused"]
    for token in (None, "", "not-the-token-0123456789", a.token + "x", a.token[:-1]):
        for method, path, body in GUARDED:
            status, payload = a.call(method, path, body, token=token)
            assert status == 401, (token, method, path, payload)
            assert "token" in payload["error"]["message"]
    assert (a.call("GET", "/weight_info")[1], served_sums(a)) == before  # not paused, same version and weights
    assert a.call("GET", "/health", token=None)[0] == 200
    with pytest.raises(ServerError, match=f"{a.url}: GET /weight_info returned 401"):
        ServerEngine(url=a.url, token="not-the-token-0123456789")


def test_body_size_and_request_limits(servers, tiny):
    a, _ = servers
    _, _, prompts = tiny
    before = a.call("GET", "/weight_info")[1]
    status, payload = a.call("POST", "/v1/completions", {"prompt": [[5] * 60_000], "max_tokens": 1})
    assert status == 413 and "--max-body-bytes" in payload["error"]["message"]
    cases = [({"prompt": [[5, 6]] * 5}, "--max-prompts"), ({"prompt": [5, 6], "n": 9}, "--max-n"),
             ({"prompt": [5, 6], "max_tokens": 65}, "--max-tokens"), ({"prompt": [5, 6], "top_k": 3}, "unsupported"),
             ({"prompt": [5, 100_000]}, "not a token id"), ({"prompt": [5, 6], "temperature": 0}, "temperature"),
             ({"prompt": "text"}, "list of token ids"), ({"prompt": [[]]}, "empty")]
    for body, message in cases:
        status, payload = a.call("POST", "/v1/completions", body)
        assert status == 400 and message in payload["error"]["message"], (body, payload)
    assert a.call("POST", "/pause?mode=freeze")[0] == 400
    assert a.call("GET", "/weight_info")[1] == before
    engine = client(a, tiny, generate_timeout_s=1.0)
    with pytest.raises(ServerError, match="--max-prompts"):
        engine.generate([prompts[0]] * 5, 2, SAMPLING, seed=0)
    assert a.call("POST", "/pause?mode=wait")[0] == 200  # a paused server answers 503; the client waits, then stops
    try:
        with pytest.raises(ServerError, match="returned 503: generation is paused"):
            engine.generate(prompts[:1], 2, SAMPLING, seed=0)
    finally:
        assert a.call("POST", "/resume")[0] == 200


def test_transfer_cut_off_mid_bucket_leaves_the_previous_weights_and_version(servers, tiny, tmp_path):
    a, _ = servers
    model, _, prompts = tiny
    first, second = perturbed(model, 5), perturbed(model, 6)
    client(a, tiny).load_weights(first.named_parameters(), step=21)
    torch.save({name: p.detach().clone() for name, p in second.named_parameters()}, tmp_path / "second.pt")
    env = dict(os.environ, LIT_GRPO_SERVER_TOKEN=a.token, OMP_NUM_THREADS="1")
    log = open(tmp_path / "sender.log", "w")
    command = [sys.executable, str(ROOT / "tests" / "server_sender.py"), a.url, str(tmp_path / "second.pt"), "22", "3"]
    sender = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT / "tests")
    try:
        deadline = time.monotonic() + 120
        while not (info := a.call("GET", "/weight_info")[1])["receiving"]:
            assert sender.poll() is None, (tmp_path / "sender.log").read_text()
            assert time.monotonic() < deadline, "the sender never reached its third bucket"
            time.sleep(0.2)
        assert info["updating"] and 0 < info["staged_parameters"] < info["num_parameters"]  # two buckets are in
    finally:
        sender.kill()  # in the middle of the third bucket
        sender.wait()
        log.close()
    deadline = time.monotonic() + 60
    while (info := a.call("GET", "/weight_info")[1])["transfer_group"] or info["receiving"]:
        assert time.monotonic() < deadline, info
        time.sleep(0.2)
    assert info["weight_version"] == "21" and not info["updating"] and info["staged_parameters"] == 0
    assert served_sums(a) == sums(first)
    assert info["paused"]  # the dead trainer had paused it; the next push resumes it
    engine = client(a, tiny)
    engine.load_weights(second.named_parameters(), step=22)  # a fresh group, a full push
    assert engine.weight_versions() == {a.url: "22"} and served_sums(a) == sums(second)
    assert len(engine.generate(prompts[:1], 2, SAMPLING, seed=0)[0]) == 2


def test_two_servers_share_the_prompts_and_both_get_the_weights(servers, tiny, one_thread):
    a, b = servers
    model, tokenizer, prompts = tiny
    policy = perturbed(model, 7)
    engine = client(a, tiny, url=None, urls=[a.url, b.url])
    engine.load_weights(policy.named_parameters(), step=31)
    assert engine.weight_versions() == {a.url: "31", b.url: "31"} and engine.synced_step == 31
    assert served_sums(a) == served_sums(b) == sums(policy)
    got = engine.generate(prompts[:3], 2, SAMPLING, seed=4)  # server a: prompt 0; server b: prompts 1 and 2
    local = TransformersEngine(policy, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
    second_seed = (4 * CHUNK_SEED_STRIDE + 1) % SEED_MODULUS
    expected = local.generate(prompts[:1], 2, SAMPLING, seed=4) + local.generate(prompts[1:3], 2, SAMPLING,
                                                                                 seed=second_seed)
    assert as_tuples(got) == as_tuples(expected)


def test_server_refuses_to_start_without_a_token(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LIT_GRPO_SERVER_TOKEN"}
    command = [sys.executable, "-m", "lit_grpo", "serve", "--model", "tiny-random-llama", "--port", "0"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no token" in done.stderr and "listening" not in done.stdout
    (tmp_path / "short").write_text("abc\n")
    done = subprocess.run(command + ["--token-file", str(tmp_path / "short")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "at least 16" in done.stderr
    # the module's former entry points to the command in one line
    done = subprocess.run([sys.executable, "-m", "lit_grpo.serve.server"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: start the rollout server with `python -m lit_grpo serve --model M --port P` (see --help)"]


def test_hung_or_dead_server_stops_the_client_within_its_timeout(servers, tiny):
    """Runs last: it stops, then kills, server b."""
    _, b = servers
    _, _, prompts = tiny
    engine = client(b, tiny, timeout_s=2.0, generate_timeout_s=2.0)
    policy = perturbed(tiny[0], 8)
    engine.load_weights(policy.named_parameters(), step=41)
    os.kill(b.proc.pid, signal.SIGSTOP)  # hung: accepts connections, never answers
    try:
        start = time.monotonic()
        with pytest.raises(ServerError, match=f"rollout server {b.url}: POST /v1/completions failed: .*timed out"):
            engine.generate(prompts[:1], 2, SAMPLING, seed=0)
        assert time.monotonic() - start < 2.0 + 3.0
        start = time.monotonic()
        with pytest.raises(ServerError, match=f"weight push of step 42 failed: rollout server {b.url}"):
            engine.load_weights(policy.named_parameters(), step=42)
        assert time.monotonic() - start < 2.0 + 3.0
    finally:
        b.proc.kill()  # a stopped process dies of SIGKILL too
        b.proc.wait()
    # dead: a request is retried (lit_grpo.engines.remote.fleet.RETRY_DELAYS_S, 3.5 s), then waits for a server for
    # the engine's timeout; a push waits the timeout for one to answer; each then names every server (here one)
    for call, bound in ((lambda: engine.generate(prompts[:1], 2, SAMPLING, seed=0), 3.5 + 2.0 + 2.0),
                        (lambda: engine.load_weights(policy.named_parameters(), step=43), 2.0 + 2.0)):
        start = time.monotonic()
        with pytest.raises(ServerError, match=rf"every rollout server is down \({b.url}\)"):
            call()
        assert time.monotonic() - start < bound
