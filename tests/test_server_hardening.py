"""The rollout server under misbehaving clients and across fits: idle connections are dropped after
``--read-timeout`` and never take more than ``--max-connections`` threads (the rest answered 503 at once), while a
trainer's request is still served; a client that leaves early is one line on stderr, not a traceback; a full push
after a LoRA fit is taken (the server goes back to the plain model); and ``/pause?mode=wait`` means no generation
runs until ``/resume``, also one that was waiting out a swap (forced with events, no sleeps)."""

from __future__ import annotations

import copy
import selectors
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

import pytest
import torch
from server_process import ServerProcess
from test_lora_server import lora_policy, train_adapter
from test_rollout_server import perturbed

from lit_grpo.cli.serve import main
from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.data.rollout import pad_rollouts
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer
from lit_grpo.models.lora import LoraArgs, adapter_update, apply_lora, swap_reference_by_merge
from lit_grpo.serve.served_policy import ServedPolicy
from lit_grpo.serve.server import make_http_server
from lit_grpo.wire.protocol import HTTPFailure
from lit_grpo.wire.weight_transfer import checksum

CAP, READ_TIMEOUT_S, IDLE = 4, 3, 12  # IDLE connections against a cap of CAP
SAMPLING = SamplingConfig(max_new_tokens=10, temperature=0.9)
WAIT_S = 60.0  # the most any wait in these tests lasts: each stops by itself


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = ServerProcess(tmp_path_factory.mktemp("hardened"),
                            args=("--read-timeout", str(READ_TIMEOUT_S), "--max-connections", str(CAP)))
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


def server_threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def outcomes(socks: list[socket.socket], on_event=None) -> list[bytes | str]:  # noqa: ANN001
    """What each socket got until the server closed it: the bytes, or ``"reset"``; ``"open"`` for one still open
    after ``WAIT_S``. ``on_event`` is called after each socket ends, with the outcomes so far."""
    got: dict[int, bytearray] = {i: bytearray() for i in range(len(socks))}
    done: dict[int, bytes | str] = {}
    with selectors.DefaultSelector() as selector:
        for i, s in enumerate(socks):
            s.setblocking(False)
            selector.register(s, selectors.EVENT_READ, i)
        deadline = time.monotonic() + WAIT_S
        while len(done) < len(socks) and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
                i = key.data
                try:
                    chunk = key.fileobj.recv(4096)
                except ConnectionResetError:
                    chunk, done[i] = b"", "reset"
                if chunk:
                    got[i] += chunk
                    continue
                done.setdefault(i, bytes(got[i]))
                selector.unregister(key.fileobj)
                if on_event is not None:
                    on_event(done)
    return [done.get(i, "open") for i in range(len(socks))]


def test_idle_connections_are_capped_then_dropped_and_a_trainer_is_still_served(server):
    """IDLE connections that send nothing: CAP of them hold a thread until the read deadline drops them, the others
    are answered 503 at once without a thread; then /health and a real generation are served. (Runs first: the
    server's thread count is read before any generation starts torch's pools.)"""
    host, port = urlsplit(server.url).hostname, urlsplit(server.url).port
    assert host == "127.0.0.1"
    before = server_threads(server.proc.pid)
    peak = {}

    def count_threads(done: dict) -> None:
        if len(done) == IDLE - CAP and "threads" not in peak:  # every refusal is in, the held ones are still open
            peak["threads"] = server_threads(server.proc.pid)

    socks = [socket.create_connection((host, port), timeout=WAIT_S) for _ in range(IDLE)]
    try:
        got = outcomes(socks, count_threads)
    finally:
        for s in socks:
            s.close()
    refused = [g for g in got if isinstance(g, bytes) and g.startswith(b"HTTP/1.1 503")]
    dropped = [g for g in got if g == b""]
    assert "open" not in got, got  # the server closed every one of them (before: held forever)
    assert len(refused) >= IDLE - CAP and len(refused) + len(dropped) == IDLE, got
    assert b"--max-connections" in refused[0]
    assert 1 <= len(dropped) <= CAP  # the held ones, dropped at the read deadline without an answer
    assert peak["threads"] <= before + CAP, (before, peak)  # one thread per held connection at most
    assert server.call("GET", "/health", token=None)[0] == 200
    status, body = server.call("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "n": 2})
    assert status == 200 and len(body["choices"]) == 2
    log = server.log_path.read_text()
    assert "Traceback" not in log, log
    assert f"sent no complete request within {READ_TIMEOUT_S} s (--read-timeout)" in log
    assert f"{CAP} connections open (--max-connections): refusing new ones" in log


class BlockingRoutes:
    """A stand-in for ``RolloutServer`` (``make_http_server`` calls only its ``handle``): each request waits for
    ``release`` once it has been read, so a test decides when the answer is written."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def handle(self, method, target, headers, read_body):  # noqa: ANN001, ANN201
        self.entered.set()
        self.release.wait(WAIT_S)
        return 200, {"ok": True}


def test_a_client_that_leaves_before_its_answer_is_one_line_not_a_traceback(capsys):
    """The trainer's side of a ``generate_timeout_s`` that expired: the request was read, the client resets the
    connection, then the answer is written (into a reset socket)."""
    routes = BlockingRoutes()
    httpd = make_http_server(routes, "127.0.0.1", 0, read_timeout_s=WAIT_S, max_connections=2)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        client = socket.create_connection(httpd.server_address[:2], timeout=WAIT_S)
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert routes.entered.wait(WAIT_S)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset, not a polite close: the server's write fails
        routes.release.set()
        deadline = time.monotonic() + WAIT_S
        while httpd._slots._value < 2:  # the connection's thread has ended (its slot is back)
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        httpd.shutdown()
        httpd.server_close()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "left before its answer was written" in line]
    assert len(lines) == 1 and ("ConnectionResetError" in lines[0] or "BrokenPipeError" in lines[0]), err
    assert "Traceback" not in err, err


def test_connection_options_are_checked_before_any_model_loads(monkeypatch):
    monkeypatch.setenv("LIT_GRPO_SERVER_TOKEN", "t" * 32)
    monkeypatch.delenv("LIT_GRPO_SERVER_TOKEN_FILE", raising=False)
    base = ["--model", "no-such-model-anywhere", "--port", "0"]
    with pytest.raises(ValueError, match=r"^--read-timeout must be a number of seconds > 0, got 0\.0$"):
        main([*base, "--read-timeout", "0"])
    with pytest.raises(ValueError, match=r"^--max-connections must be an integer >= 1, got 0$"):
        main([*base, "--max-connections", "0"])


def sums(model) -> dict[str, str]:  # noqa: ANN001
    return {name: checksum(p) for name, p in model.named_parameters()}


def test_a_full_fit_after_a_lora_fit_pushes_to_the_same_server(server, one_thread):
    """A LoRA fit (adapter pushes, one merge), then a full fit on the same server: its pi_ref and policy pushes are
    taken under the plain names (before: "unknown parameter" until a restart), the server samples from exactly the
    pushed weights and reports no adapter; a LoRA fit after that wraps the model again, and its pi_ref is the
    server's base with the adapter off, not the full fit's leftover copy of pi_ref."""
    lora, tokenizer = lora_policy()
    engine = ServerEngine(policy=lora, url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)
    train_adapter(lora, 1)
    engine.load_adapter(adapter_update(lora, engine.merges_applied, with_hash=True, step=1), step=1)
    swap_reference_by_merge(lora, [])
    train_adapter(lora, 2)
    engine.load_adapter(adapter_update(lora, engine.merges_applied, with_hash=False, step=2), step=2)
    assert server.call("GET", "/weight_info")[1]["lora"]["merges_applied"] == 1
    engine.close()

    model, _ = load_model_and_tokenizer("tiny-random-llama")
    full = perturbed(model, 3)
    eos = eos_token_ids(tokenizer, model)
    engine = ServerEngine(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05, stop_token_ids=eos,
                          serves_reference=True)
    engine.load_reference(model.named_parameters(), "0")  # WeightSync pushes pi_ref first, then the policy
    engine.load_weights(full.named_parameters(), step=3)
    info = server.call("GET", "/weight_info")[1]
    assert info["weight_version"] == "3" and info["lora"] is None and info["reference_version"] == "0"
    status, body = server.call("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200 and body["checksums"] == sums(full)  # every weight, by its plain name, bitwise
    prompts = [tokenizer.encode(t) for t in ("What is 2+2?", "Hi")]
    local = TransformersEngine(full, eos, tokenizer.pad_token_id)
    got, expected = engine.generate(prompts, 3, SAMPLING, seed=4), local.generate(prompts, 3, SAMPLING, seed=4)
    assert [[(c.token_ids, c.logprobs) for c in g] for g in got] == \
        [[(c.token_ids, c.logprobs) for c in g] for g in expected]
    engine.close()

    torch.manual_seed(5)
    again = apply_lora(copy.deepcopy(full), LoraArgs(r=1, alpha=2.0))  # a LoRA fit from the full fit's weights
    train_adapter(again, 6)
    engine = ServerEngine(policy=again, url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)
    assert engine.merges_applied == 0
    engine.load_adapter(adapter_update(again, 0, with_hash=True, step=7), step=7)  # the base hash matches
    info = server.call("GET", "/weight_info")[1]
    assert info["weight_version"] == "7" and info["lora"]["merges_applied"] == 0
    status, body = server.call("POST", "/weight_checker", {"action": "checksum"})
    assert body["checksums"] == sums(again)
    # its pi_ref is the server's base with the adapter off (the full fit's weights), not the copy of pi_ref the full
    # fit pushed, though that copy's label ("0") is the one this fit asks for
    engine.serves_reference = True
    engine.load_adapter(adapter_update(again, 0, with_hash=False, step=8), step=8)
    assert engine.reference_version == "0"
    groups = engine.generate(prompts, 3, SAMPLING, seed=9)
    padded = pad_rollouts(prompts, groups, tokenizer.pad_token_id, 4)
    served, version = engine.score_reference(list(padded.micro_batches()), *padded.completion_ids.shape, 1.0)
    assert version == "0"
    with torch.no_grad():
        for mb in padded.micro_batches():
            logp, _ = completion_logprobs(full, mb, 1.0)
            torch.testing.assert_close(served[mb.rows, : logp.shape[1]], logp, rtol=0, atol=1e-6)
    engine.close()


class CountingCondition(threading.Condition):
    """A condition that counts the waits begun on it, so a test can wait until the n-th thread waits."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.changed = threading.Condition()

    def wait(self, timeout: float | None = None) -> bool:
        with self.changed:
            self.waits += 1
            self.changed.notify_all()
        return super().wait(timeout)

    def until_waits(self, n: int) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.waits >= n, WAIT_S)


def test_pause_wait_holds_back_a_generation_that_was_waiting_out_a_swap():
    """The interleaving, forced with events: generation H runs; a swap starts and waits for H; generation G arrives
    (not paused yet) and waits for the swap; ``/pause?mode=wait`` comes and waits for H; H ends, so the swap runs
    and ends and the pause answers. G must not start between the pause and ``/resume`` (before: it did, with the
    server paused): it is refused with the 503 the client retries after ``/resume``."""
    policy = ServedPolicy(torch.nn.Linear(2, 2))
    policy.cond = CountingCondition()
    release_h, h_running, g_started = threading.Event(), threading.Event(), threading.Event()
    result: dict[str, object] = {}

    def generation_h() -> None:
        with policy.generating():
            h_running.set()
            release_h.wait(WAIT_S)

    def swap() -> None:
        with policy.swapped():
            result["swapped"] = True

    def generation_g() -> None:
        try:
            with policy.generating():
                g_started.set()
        except HTTPFailure as err:
            result["g_refused"] = err.status

    def pause() -> None:
        policy.pause(abort=False)
        result["paused"] = True

    threads = [threading.Thread(target=generation_h, daemon=True)]
    threads[0].start()
    assert h_running.wait(WAIT_S)
    for n, target in enumerate((swap, generation_g, pause), start=1):
        threads.append(threading.Thread(target=target, daemon=True))
        threads[-1].start()
        assert policy.cond.until_waits(n)  # the swap waits for H, G for the swap, the pause for H
    assert policy.swapping and policy.paused and policy.in_flight == 1 and "paused" not in result
    release_h.set()
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    assert not g_started.is_set(), result
    assert result == {"swapped": True, "g_refused": 503, "paused": True} and policy.in_flight == 0
    policy.resume()
    with policy.generating() as (_, version):  # after /resume a generation runs again
        assert policy.in_flight == 1 and version is None
