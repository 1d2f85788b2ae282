"""``ServerEngine(kind="vllm")`` against a real ``vllm serve`` process on the CPU build of vLLM, with the weight push
over this package's gloo backend (a vLLM plugin, ``lit_grpo.wire.vllm_gloo``): generation, pause and resume,
the weight versions, pushes checked by vLLM's own ``/weight_checker`` digests and by the sampled distribution, a
malformed push round refused by the worker with every weight kept, and an asynchronous K = 1 fit. The tests share
one server: each pushes its own versions and compares with what it pushed.

The vLLM tier: ``python -m pytest -m vllm`` in the CPU-with-vLLM environment (README, Install)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from vllm_helpers import (
    VLLMServe,
    free_port,
    mean_gap,
    perturbed,
    requires_vllm,
    save_model,
    tiny_vllm_llama,
    weight_digest,
)

from lit_grpo.cli.plots import read_scalars
from lit_grpo.engines.base import SamplingConfig

pytestmark = [pytest.mark.vllm, requires_vllm]

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61]]
SAMPLING = SamplingConfig(max_new_tokens=12, temperature=1.0)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_serve")
    model_dir = save_model(root / "tiny")
    server = VLLMServe(model_dir, root / "serve.log")
    try:
        seconds = server.wait_ready()
        print(f"vllm serve answered after {seconds:.1f} s")
        yield server, model_dir
    finally:
        server.stop()


def client(server: VLLMServe, model, token: str | None = None):  # noqa: ANN001, ANN201
    from lit_grpo.engines.remote.client import ServerEngine

    return ServerEngine(url=server.url, kind="vllm", backend="gloo", dtype="float32", policy=model, timeout_s=120,
                        token=token or server.token)


def pushed_client(server: VLLMServe, step: int):  # noqa: ANN201
    """The tiny model, and a client that has pushed its weights to ``server`` as version ``step``."""
    model, _ = tiny_vllm_llama()
    engine = client(server, model)
    engine.load_weights(model.named_parameters(), step=step)
    return model, engine


def unfused_digests(model) -> dict[str, str]:  # noqa: ANN001
    """The trainer's digests of the parameters vLLM keeps under the same name and layout. Its attention and MLP
    input projections are fused, on a CPU its linear layers (lm_head included) are repacked for its kernels, and
    its embedding is padded to a multiple of 64 rows, so only the norms can be compared byte for byte; the sampled
    distribution checks the rest."""
    keep = ("norm",)
    return {name: weight_digest(p) for name, p in model.named_parameters() if any(k in name for k in keep)}


def test_generation_pushes_versions_and_weight_checker(served):
    server, _ = served
    model, _ = tiny_vllm_llama()
    engine = client(server, perturbed(model, scale=0.3, seed=1))
    assert engine.weight_versions() == {server.url: "default"}  # what vllm serve reports before any push
    start = time.monotonic()
    engine.load_weights(model.named_parameters(), step=1)
    print(f"first gloo push (group formed): {time.monotonic() - start:.2f} s")
    assert engine.weight_versions() == {server.url: "1"}
    # the server holds exactly the pushed bytes: vLLM's digests of its (unfused) parameters equal the trainer's
    checksums = engine.weight_checksums()[server.url]
    served_digests = {key.split(":")[-1]: digest for key, digest in checksums.items()}
    expected = unfused_digests(model)
    assert len(expected) == 5 and {name: served_digests[name] for name in expected} == expected
    # and it samples from them
    groups = engine.generate(PROMPTS, 4, SAMPLING, seed=3)
    assert all(c.versions == ("1",) for g in groups for c in g)
    gap = mean_gap(model, PROMPTS, groups)
    print(f"fp32 mean |vllm serve - teacher-forced| log-prob gap: {gap:.2e}")
    assert gap <= 1e-4
    # its prefix cache, read from /metrics. vLLM caches whole blocks only (128 tokens on a CPU), so the short
    # prompts above were looked up (a rate is logged) but could not hit; a prompt over one block, sampled twice,
    # finds its first block cached the second time
    stats = engine.routing_stats()
    print(f"prefix cache since the client started: {stats}")
    assert 0.0 <= stats["prefix_cache_hit_rate"] <= 1.0
    long_prompt = [1] + [40 + i % 20 for i in range(150)]
    engine.generate([long_prompt], 1, SAMPLING, seed=5)
    engine.generate([long_prompt], 1, SAMPLING, seed=6)
    stats = engine.routing_stats()
    print(f"prefix cache over the long prompt: {stats}")
    assert 0.0 < stats["prefix_cache_hit_rate"] <= 1.0
    assert stats["server_0_prefix_cache_hit_rate"] == stats["prefix_cache_hit_rate"]

    # a second push of other weights: the version, the digests and the sampled distribution all follow
    new = perturbed(tiny_vllm_llama()[0], scale=0.5, seed=2)
    start = time.monotonic()
    engine.load_weights(new.named_parameters(), step=2)
    print(f"second gloo push: {time.monotonic() - start:.2f} s")
    assert engine.weight_versions() == {server.url: "2"}
    digests = {k.split(":")[-1]: d for k, d in engine.weight_checksums()[server.url].items()}
    assert {name: digests[name] for name in expected} == unfused_digests(new)
    groups = engine.generate(PROMPTS, 4, SAMPLING, seed=3)
    assert mean_gap(new, PROMPTS, groups) <= 1e-4 and mean_gap(model, PROMPTS, groups) > 0.1
    engine.close()


def test_pushes_without_the_token_are_refused_and_change_no_weight(served):
    from lit_grpo.wire.protocol import ServerError

    server, _ = served
    model, engine = pushed_client(server, step=65)
    # no push group from here on, as on a fresh server: the refused requests below find none to use
    assert server.post_status("/shutdown_weight_transfer_engine")[0] == 200
    before = engine.weight_checksums()[server.url]
    sampled = engine.generate(PROMPTS, 2, SAMPLING, seed=5)
    attacker = perturbed(tiny_vllm_llama()[0], scale=0.5, seed=9)

    # a trainer with the wrong token: refused at the init, at once (not after the transfer timeout)
    wrong = client(server, attacker, token="not-" + server.token)
    start = time.monotonic()
    with pytest.raises(ServerError, match="refused: missing or wrong token") as refused:
        wrong.load_weights(attacker.named_parameters(), step=66)
    print(f"refused in {time.monotonic() - start:.1f} s: {refused.value}")
    assert time.monotonic() - start < 60 and "\n" not in str(refused.value)
    wrong.close()
    # an init with no token at all, the way anyone reaching the port can send it (no trainer needed)
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    status, text = server.post_status("/init_weight_transfer_engine", {"init_info": init_info})
    assert status >= 400 and "missing or wrong token" in text
    # and with no group, the update routes load nothing
    for route, body in (("/start_weight_update", {}),
                        ("/update_weights", {"update_info": {"names": ["model.norm.weight"],
                                                             "dtype_names": ["float32"], "shapes": [[64]]}}),
                        ("/finish_weight_update", {"weight_version": "66"})):
        status, text = server.post_status(route, body)
        assert status >= 400, (route, text)
    assert server.get("/is_paused") == {"is_paused": False}  # the refused push resumed the server
    assert engine.weight_checksums()[server.url] == before  # every parameter, byte for byte
    assert engine.weight_versions() == {server.url: "65"}
    again = engine.generate(PROMPTS, 2, SAMPLING, seed=5)
    assert [[(c.token_ids, c.logprobs) for c in g] for g in again] == [
        [(c.token_ids, c.logprobs) for c in g] for g in sampled]
    engine.close()

    # the right token still pushes (a fresh trainer side: the group of the first push was shut down above)
    right = client(server, attacker)
    right.load_weights(attacker.named_parameters(), step=67)
    assert right.weight_versions() == {server.url: "67"}
    assert right.weight_checksums()[server.url] != before
    assert mean_gap(attacker, PROMPTS, right.generate(PROMPTS, 2, SAMPLING, seed=5)) <= 1e-4
    right.close()


def test_a_malformed_round_is_refused_by_the_worker_and_keeps_every_weight(served):
    """A weight-push round that does not fit the served model is checked against the vLLM model's own parameters
    before its layerwise reload sets any layer aside: refused with the bad entries named, every weight and the
    version kept; a well-formed round then loads (the checks resolve the checkpoint's names through vLLM's packed
    layers)."""
    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.wire.protocol import ServerError

    server, _ = served
    _, first = pushed_client(server, step=201)
    before = first.weight_checksums()[server.url]
    first.close()
    # the server holds float32: a round of bfloat16 tensors is refused before anything loads
    other = perturbed(tiny_vllm_llama()[0], scale=0.5, seed=3)
    wrong = ServerEngine(url=server.url, kind="vllm", backend="gloo", dtype="bfloat16", policy=other, timeout_s=120,
                         token=server.token)
    with pytest.raises(ServerError) as refused:
        wrong.load_weights(other.named_parameters(), step=202)
    message = str(refused.value)
    assert "malformed weight-push round refused by the vLLM worker, nothing loaded" in message, message
    assert "dtype bfloat16, expected float32" in message and "\n" not in message
    wrong.close()
    # the server is untouched, and a well-formed round still goes through (a fresh group)
    right = client(server, other)
    assert right.weight_checksums()[server.url] == before
    assert right.weight_versions() == {server.url: "201"}
    right.load_weights(other.named_parameters(), step=203)
    assert right.weight_versions() == {server.url: "203"}
    assert right.weight_checksums()[server.url] != before
    right.close()

def test_pause_holds_requests_until_resume(served):
    server, _ = served
    model, engine = pushed_client(server, step=3)
    assert server.post("/pause?mode=wait") == {"status": "paused"}
    assert server.get("/is_paused") == {"is_paused": True}
    done: list[float] = []
    request = threading.Thread(target=lambda: done.append(len(engine.generate(PROMPTS, 2, SAMPLING, seed=0))))
    request.start()
    time.sleep(2.0)
    assert not done  # held while paused
    server.post("/resume")
    request.join(60)
    assert done == [2] and server.get("/is_paused") == {"is_paused": False}
    engine.close()


def test_asynchronous_fit_against_vllm_serve(served, tmp_path):
    server, model_dir = served
    options = dict(url=server.url, kind="vllm", backend="gloo", dtype="float32", timeout_s=120)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", LIT_GRPO_SERVER_TOKEN=server.token)
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(ROOT / "configs" / "demo_cpu.yaml"),
         "--model.model_name", str(model_dir), "--trainer.max_steps", "3", "--data.prompts_per_step", "4",
         "--data.engine", "server", "--data.engine_options", json.dumps(options), "--data.max_staleness", "1",
         "--eval.at_start", "false", "--eval.at_end", "false", "--eval.every_n_optimizer_steps", "null"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "at exit failed" not in proc.stderr, proc.stderr[-4000:]  # each transfer engine is released once, quietly
    scalars = read_scalars(tmp_path / "runs" / "demo_cpu")
    assert len(scalars["train/loss"]) == 3
    # K = 1: the batch of step 1 was generated while step 0 trained, from the weights pushed before step 0
    assert [value for _, value in scalars["train/staleness"]] == [0.0, 1.0, 1.0]
    assert server.get("/weight_info")["weight_version"] == "3"  # pushed before each step's generation, last one 3


def test_a_prompt_cached_before_a_keep_push_is_scored_under_the_new_weights(served, monkeypatch):
    """vLLM 0.32's ``/pause?mode=keep`` ignores ``clear_cache``: without a salt a prompt whose first block was cached
    under the old weights could reuse that block's KV after a push. Every request carries its weight version as
    ``cache_salt``: after the push nothing cached under the old weights is served, and the prompt is scored under
    the new weights. The same push without salts is printed beside it (on the CPU build the push itself resets the
    cache, so there the salt is the defence for the builds and paths where it survives)."""
    server, _ = served
    long_prompt = [1] + [40 + i % 20 for i in range(150)]  # over one 128-token block (vLLM's on a CPU)
    gaps, hits = {}, {}
    for salted, (first, second) in ((True, (21, 22)), (False, (23, 24))):
        model, _ = tiny_vllm_llama()
        engine = client(server, perturbed(model, scale=0.3, seed=first))
        if not salted:
            monkeypatch.setattr(engine, "_cache_salts", lambda count, sessions: None)
        engine.keep_generating_through_pushes()
        old = perturbed(model, scale=0.3, seed=first)
        engine.load_weights(old.named_parameters(), step=first)
        engine.generate([long_prompt], 1, SAMPLING, seed=5)  # its first block is cached under `old`
        engine.generate([long_prompt], 1, SAMPLING, seed=5)  # served from the cache: the same weights, same salt
        cached = engine.routing_stats()["prefix_cache_hit_rate"]
        new = perturbed(model, scale=0.5, seed=second)
        engine.load_weights(new.named_parameters(), step=second)
        groups = engine.generate([long_prompt], 1, SAMPLING, seed=6)  # one sample: no sibling to share its blocks
        hits[salted] = (cached, engine.routing_stats()["prefix_cache_hit_rate"])
        groups += engine.generate([long_prompt], 4, SAMPLING, seed=7)
        gaps[salted] = mean_gap(new, [long_prompt] * 2, groups)
        engine.close()
    print(f"after a keep push: mean |sampler - new weights| log-prob gap salted {gaps[True]:.2e}, unsalted "
          f"{gaps[False]:.2e}; prefix-cache hit rate before / after the push, salted {hits[True]}, unsalted "
          f"{hits[False]}")
    assert hits[True][0] > 0  # the cache works under one version
    assert hits[True][1] == 0.0  # and after the push nothing cached under the old weights is served
    assert gaps[True] <= 1e-4
