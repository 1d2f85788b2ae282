"""LoRA (``model.lora``) against a real rollout server process (``python -m lit_grpo serve``): an adapter push carries
the adapter only (its bytes a small fraction of a full push's), the server samples with base plus adapter as the
trainer computes them (equal tokens and log-probs), follows the trainer's merges (base hash and per-parameter
checksums equal the trainer's, log-probs too), refuses at the first push a server started from another base, keeps
serving after a refused push, and scores pi_ref as its own base with the adapter off."""

from __future__ import annotations

import pytest
import torch
from server_process import ServerProcess, running_server

from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer, tiny_llama
from lit_grpo.models.lora import (
    LoraArgs,
    adapter_parameters,
    adapter_update,
    apply_lora,
    base_hash,
    merged_named_tensors,
    swap_reference_by_merge,
)
from lit_grpo.wire.protocol import ServerError
from lit_grpo.wire.weight_transfer import checksum

SAMPLING = SamplingConfig(max_new_tokens=10, temperature=0.9)
TEXTS = ("What is 2+2?", "Name a prime.", "Hi")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("lora_server")) as process:
        yield process


def lora_policy(seed: int = 0, base_seed: int | None = None):
    """The server's base (tiny-random-llama) or another one (``base_seed``), with an adapter of r = 1."""
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    if base_seed is not None:
        model = tiny_llama(model.config.vocab_size, seed=base_seed)
    torch.manual_seed(seed)
    return apply_lora(model, LoraArgs(r=1, alpha=2.0)), tokenizer


def train_adapter(policy, seed: int) -> None:
    """Stand-in for optimizer steps: move every adapter tensor (B too, so that the adapter changes the outputs)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_parameters(policy):
            p.add_(0.3 * torch.randn(p.shape, generator=generator))


def engine_for(server: ServerProcess, policy) -> ServerEngine:
    return ServerEngine(policy=policy, url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)


def trainers_rollouts(policy, tokenizer, prompts, seed):
    """What the trainer's own function of the same weights samples (the in-process engine on the policy itself)."""
    local = TransformersEngine(policy, eos_token_ids(tokenizer, policy), tokenizer.pad_token_id, copy_weights=False,
                               decode="dynamic")
    return local.generate(prompts, 3, SAMPLING, seed)


def assert_same(got, expected):
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
    for g, e in zip(got, expected):
        for a, b in zip(g, e):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-6)


def server_sums(server: ServerProcess) -> dict[str, str]:
    status, body = server.call("POST", "/weight_checker", {"action": "checksum"})
    assert status == 200
    return body["checksums"]


def test_adapter_push_is_small_and_the_server_samples_as_the_trainer_also_across_merges(server, one_thread):
    policy, tokenizer = lora_policy()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    engine = engine_for(server, policy)
    assert engine.merges_applied == 0  # asked of the server: it has had no adapter yet
    # a full push of the merged policy first (plain names, as to an engine without adapters): its bytes
    engine.load_weights(merged_named_tensors(policy), step=0)
    full_bytes = engine.pusher.last_push["bytes"]
    train_adapter(policy, 1)
    update = adapter_update(policy, engine.merges_applied, with_hash=True, step=1)
    engine.load_adapter(update, step=1)
    adapter_bytes = engine.pusher.last_push["bytes"]
    assert adapter_bytes == update.nbytes == sum(t.numel() * 4 for t in update.adapter.values())
    assert adapter_bytes < 0.05 * full_bytes  # the adapter only (r = 1: about 2.4 % of the tiny model here)
    before_merge = server.call("GET", "/weight_info")[1]
    assert before_merge["weight_version"] == "1" and before_merge["lora"]["merges_applied"] == 0
    assert_same(engine.generate(prompts, 3, SAMPLING, seed=5), trainers_rollouts(policy, tokenizer, prompts, 5))

    # two stage swaps while the server lags (v > 1): both merges travel with the next push, oldest first
    swap_reference_by_merge(policy, [])
    train_adapter(policy, 2)
    swap_reference_by_merge(policy, [])
    train_adapter(policy, 3)
    update = adapter_update(policy, engine.merges_applied, with_hash=False, step=4)
    assert len(update.merges) == 2 and update.base_hash == base_hash(policy)
    engine.load_adapter(update, step=4)
    assert engine.merges_applied == 2
    assert server.call("GET", "/weight_info")[1]["lora"]["merges_applied"] == 2
    # every parameter, base and adapter, bitwise the trainer's (peft names on both sides)
    assert server_sums(server) == {name: checksum(p) for name, p in policy.named_parameters()}
    assert_same(engine.generate(prompts, 3, SAMPLING, seed=6), trainers_rollouts(policy, tokenizer, prompts, 6))

    # pi_ref with LoRA: the server's base with the adapter off, labelled with the merges it holds
    engine.serves_reference = True
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=5), step=5)
    assert engine.reference_version == "2"
    from lit_grpo.core.scoring import completion_logprobs
    from lit_grpo.data.rollout import pad_rollouts

    groups = engine.generate(prompts, 3, SAMPLING, seed=7)
    padded = pad_rollouts(prompts, groups, tokenizer.pad_token_id, 4)
    served, version = engine.score_reference(list(padded.micro_batches()), *padded.completion_ids.shape, 1.0)
    assert version == "2"
    with torch.no_grad(), policy.disable_adapter():
        for mb in padded.micro_batches():
            logp, _ = completion_logprobs(policy, mb, 1.0)
            torch.testing.assert_close(served[mb.rows, : logp.shape[1]], logp, rtol=0, atol=1e-6)
    engine.close()


def test_a_server_started_from_another_base_is_refused_at_the_first_push_in_one_line(tmp_path):
    server = ServerProcess(tmp_path / "fresh")
    try:
        server.wait_ready()
        refused_at_first_push(server)
    finally:
        server.kill()


def refused_at_first_push(server: ServerProcess) -> None:
    policy, _ = lora_policy(base_seed=1)  # another base than the server's tiny-random-llama
    engine = engine_for(server, policy)
    version = server.call("GET", "/weight_info")[1]["weight_version"]
    update = adapter_update(policy, engine.merges_applied, with_hash=True, step=9)
    with pytest.raises(ServerError, match="started from another model") as caught:
        engine.load_adapter(update, step=9)
    assert "\n" not in str(caught.value)
    info = server.call("GET", "/weight_info")[1]
    assert info["weight_version"] == version and not info["paused"]  # nothing changed, generation goes on
    engine.close()



LORA_MODULE = dict(beta=0.1, lr=1e-2, lora=dict(r=2, alpha=4.0))


@pytest.mark.slow
def test_lora_fits_against_the_server_synchronously_and_asynchronously(tmp_path):
    """Real fits (``dist_worker``): at K = 0 the server's rollouts give every number of the in-process engine's
    fit; at K = 1 (``data.max_staleness``) with two stage swaps (merges) the staleness bound holds and the server ends
    holding bitwise the trained policy (base with both merges, and adapter)."""
    from distributed_launch import free_port, launch

    server = ServerProcess(tmp_path / "server", port=free_port())
    try:
        server.wait_ready()
        options = dict(url=server.url, token=server.token, timeout_s=60, bucket_mb=0.05)
        data = dict(prompts_per_step=1)
        weights = tmp_path / "k1.pt"
        jobs = [dict(v=1, max_steps=4, module=LORA_MODULE, data=data, seed=0),
                dict(v=1, max_steps=4, module=LORA_MODULE, data=dict(data, max_staleness=0), server=options, seed=0),
                dict(v=1, max_steps=5, module=LORA_MODULE, data=dict(data, max_staleness=1), server=options,
                     swap_every=2, weights_out=str(weights), seed=0)]
        in_process, k0, k1 = launch(jobs, world=1, workdir=tmp_path / "fits", timeout_s=600)[0]
        for expected, got in zip(in_process["steps"], k0["steps"], strict=True):
            for key in ("train/loss", "train/kl", "rollout/reward_mean"):
                assert got[key] == pytest.approx(expected[key], abs=1e-6), key
        assert max(s["rollout/staleness_max"] for s in k1["steps"]) == 1
        assert all(s["train/loss"] == s["train/loss"] for s in k1["steps"])  # finite, no NaN
        info = server.call("GET", "/weight_info")[1]
        assert info["lora"]["merges_applied"] == 2 and info["weight_version"] == "5"
        trained = torch.load(weights)
        assert server_sums(server) == {name: checksum(t) for name, t in trained.items()}
    finally:
        server.kill()


@pytest.mark.slow
def test_lora_pi_ref_scored_on_the_server_is_the_trainers_adapter_off(tmp_path):
    """``data.reference_on_server`` with LoRA: the server scores pi_ref on its own base with the adapter off, labelled
    with the merges it holds; the trainer uses those log-probs while the labels agree (every step but the one right
    after a swap, whose merge reaches the server at the next push) and every number equals the fit that scores pi_ref
    itself."""
    from distributed_launch import free_port, launch

    # one server per fit: a server keeps the merges of the fit it served, and a fresh fit is refused there
    servers = [ServerProcess(tmp_path / f"server{i}", port=free_port()) for i in range(2)]
    try:
        options = [dict(url=s.wait_ready(), token=s.token, timeout_s=60, bucket_mb=0.05) for s in servers]
        data = dict(prompts_per_step=1, max_staleness=0)
        jobs = [dict(v=1, max_steps=5, module=LORA_MODULE, data=data, server=options[0], swap_every=2, seed=0),
                dict(v=1, max_steps=5, module=LORA_MODULE, data=dict(data, reference_on_server=True),
                     server=options[1], swap_every=2, seed=0)]
        own, served = launch(jobs, world=1, workdir=tmp_path / "fits", timeout_s=600)[0]
        served_steps = [s["train/reference_served"] for s in served["steps"]]
        assert served_steps == [1.0, 1.0, 0.0, 1.0, 0.0], served_steps  # swaps after steps 2 and 4
        assert all(s["train/reference_served"] == 0.0 for s in own["steps"])
        for expected, got in zip(own["steps"], served["steps"], strict=True):
            for key in ("train/loss", "train/kl", "rollout/reward_mean"):
                assert got[key] == pytest.approx(expected[key], abs=1e-6), key
        assert any(s["train/kl"] > 0 for s in served["steps"])
    finally:
        for s in servers:
            s.kill()
