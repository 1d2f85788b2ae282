"""Two real ``vllm serve`` processes (the CPU build, pushes over the gloo plugin) behind one ``ServerEngine``: one
killed with SIGKILL between two pushes is found dead by the next push's first call, left out of it and out of
routing, and the push goes on to the other; no group is lost or sampled twice, and every token carries the version
that sampled it. Restarted at its URL, it takes the next push with a new trainer side, is back in routing, and is
named as rejoined (the sampler check takes its first batch again).

The vLLM tier: ``python -m pytest -m vllm`` in the CPU-with-vLLM environment (README, Install)."""

from __future__ import annotations

import copy
import secrets

import pytest
from vllm_helpers import VLLMServe, mean_gap, perturbed, requires_vllm, save_model, tiny_vllm_llama

from lit_grpo.engines.base import SamplingConfig

pytestmark = [pytest.mark.vllm, requires_vllm]

PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 50, 51, 52], [1, 70]]
SAMPLING = SamplingConfig(max_new_tokens=8, temperature=1.0)
N = 3


def rollouts(engine, version: str) -> list:  # noqa: ANN001
    """A call's groups, each checked whole: ``N`` completions per prompt, every token sampled by ``version``."""
    groups = engine.generate(PROMPTS, N, SAMPLING, seed=7)
    assert len(groups) == len(PROMPTS) and all(len(g) == N for g in groups)
    assert all(c.versions == (version,) and c.token_ids for g in groups for c in g), [
        (c.versions, len(c.token_ids)) for g in groups for c in g]
    return groups


def test_a_killed_vllm_serve_is_left_out_of_the_push_and_rejoins_when_restarted(tmp_path):
    from lit_grpo.engines.remote.client import ServerEngine

    model_dir = save_model(tmp_path / "tiny")
    token = secrets.token_hex(16)  # one token for the fleet: the trainer sends one
    servers = [VLLMServe(model_dir, tmp_path / f"serve{i}.log", token=token) for i in range(2)]
    restarted = None
    try:
        for server in servers:
            server.wait_ready()
        base, _ = tiny_vllm_llama()
        # each push sends other weights than the served model's, so a server that missed one samples off them
        policies = {step: perturbed(copy.deepcopy(base), 0.3, seed=step) for step in (1, 2, 3)}
        current = {"step": 1}  # the policy a push sends: a push to the second server gathers ``policy()`` again
        engine = ServerEngine(urls=[s.url for s in servers], kind="vllm", backend="gloo", dtype="float32",
                              policy=lambda: policies[current["step"]], timeout_s=120, token=token)
        model = policies[1]
        engine.load_weights(model.named_parameters(), step=1)
        groups = rollouts(engine, "1")
        assert {c.server for g in groups for c in g} == {s.url for s in servers}  # both serve
        assert mean_gap(model, PROMPTS, groups) < 1e-3

        servers[1].kill()
        model, current["step"] = policies[2], 2
        with pytest.warns(UserWarning, match=rf"rollout server {servers[1].url} is down"):
            engine.load_weights(model.named_parameters(), step=2)
        assert engine.synced_step == 2 and engine.routing_stats()["servers_up"] == 1.0
        groups = rollouts(engine, "2")  # the dead one's prompts go, as they were, to the other
        assert {c.server for g in groups for c in g} == {servers[0].url}
        assert mean_gap(model, PROMPTS, groups) < 1e-3  # sampled by the pushed weights

        port = int(servers[1].url.rsplit(":", 1)[1])
        restarted = VLLMServe(model_dir, tmp_path / "restarted.log", port=port, token=token)
        restarted.wait_ready()
        model, current["step"] = policies[3], 3
        engine.load_weights(model.named_parameters(), step=3)
        assert engine.routing_stats()["servers_up"] == 2.0 and engine.take_rejoined() == [restarted.url]
        assert restarted.get("/weight_info")["weight_version"] == "3"
        groups = rollouts(engine, "3")
        assert {c.server for g in groups for c in g} == {s.url for s in servers}
        assert mean_gap(model, PROMPTS, groups) < 1e-3  # the rejoined server samples the pushed weights too
        engine.close()
    finally:
        for server in [*servers, restarted]:
            if server is not None:
                server.stop()


def test_a_lora_fleet_leaves_a_killed_server_out_and_gives_it_the_merged_base_when_it_returns(tmp_path):
    """``model.lora`` over two ``vllm serve``: adapters go by path, the base by push. A killed server is left out of
    the adapter push; restarted, it holds its own start-up base, so the next push gives every server the trainer's
    merged base first, then the adapter, and it samples the policy again."""
    from test_vllm_lora import LORA, MAX_MEAN_GAP, randomise_adapter, with_adapter

    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.models.lora import adapter_state, adapter_update, apply_lora, swap_reference_by_merge

    model_dir = save_model(tmp_path / "tiny")
    token = secrets.token_hex(16)
    lora = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    servers = [VLLMServe(model_dir, tmp_path / f"serve{i}.log", extra=lora, token=token, env=env) for i in range(2)]
    restarted = None
    try:
        for server in servers:
            server.wait_ready()
        policy = apply_lora(tiny_vllm_llama()[0], LORA)
        engine = ServerEngine(urls=[s.url for s in servers], kind="vllm", backend="gloo", dtype="float32",
                              policy=policy, timeout_s=120, lora_dir=str(tmp_path / "shared"), lora_keep=2,
                              token=token)

        def push(step: int) -> None:
            randomise_adapter(policy, seed=step)
            engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=step), step=step)

        push(1)
        assert {c.server for g in rollouts(engine, "1") for c in g} == {s.url for s in servers}
        swap_reference_by_merge(policy, [])  # the base moves: a server with its start-up base samples off it now
        push(2)
        assert engine.merges_applied == 1

        servers[1].kill()
        with pytest.warns(UserWarning, match=rf"rollout server {servers[1].url} is down"):
            push(3)
        assert engine.routing_stats()["servers_up"] == 1.0
        groups = rollouts(engine, "3")
        assert {c.server for g in groups for c in g} == {servers[0].url}
        assert mean_gap(policy, PROMPTS, groups) <= MAX_MEAN_GAP

        port = int(servers[1].url.rsplit(":", 1)[1])
        restarted = VLLMServe(model_dir, tmp_path / "restarted.log", port=port, extra=lora, token=token, env=env)
        restarted.wait_ready()
        push(4)
        assert engine.routing_stats()["servers_up"] == 2.0 and restarted.url in engine.take_rejoined()
        assert restarted.get("/weight_info")["weight_version"] == "4"  # the base pushed to it with this push
        groups = rollouts(engine, "4")
        assert {c.server for g in groups for c in g} == {s.url for s in servers}
        on_restarted = [[c for c in g if c.server == restarted.url] for g in groups]
        prompts = [p for p, g in zip(PROMPTS, on_restarted) if g]
        on_restarted = [g for g in on_restarted if g]
        stale_base = with_adapter(adapter_state(policy))  # the adapter on the base the server started with
        gap, stale_gap = mean_gap(policy, prompts, on_restarted), mean_gap(stale_base, prompts, on_restarted)
        print(f"the restarted server: gap to the policy {gap:.2e}, to its start-up base with the adapter "
              f"{stale_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and stale_gap > 0.02
        engine.close()
    finally:
        for server in [*servers, restarted]:
            if server is not None:
                server.stop()
