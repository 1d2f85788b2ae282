"""LoRA adapters (``model.lora``) in vLLM: the colocated engine takes each push as a new adapter version by
``LoRARequest``, keeps the newest ones only, and follows a merge (stage swap) by a reload of the trainer's merged
base; ``vllm serve`` loads versions by path (``/v1/load_lora_adapter``) and follows a merge by a base push.

The bug peers' users hit is an adapter that never reaches the sampler; so every check here is on the distribution:
the sampled tokens' log-probs are the trainer's teacher-forced log-probs under the new adapter (fp32, the vLLM tier's
bar), and far from those under the previous adapter or the stale base. The helpers without vLLM run in the main
suite; the rest is the vLLM tier (``python -m pytest -m vllm``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import get_args

import pytest
import test_vllm_engine
import torch
from test_vllm_engine import FakeLLM, only_llm
from vllm_helpers import ENGINE_OPTIONS, mean_gap, requires_vllm, save_model, tiny_vllm_llama

from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.vllm_lora import VLLM_LORA_RANKS, AdapterVersions, lora_llm_kwargs, vllm_max_lora_rank
from lit_grpo.models.lora import (
    LoraArgs,
    adapter_state,
    adapter_update,
    apply_lora,
    load_adapter_state,
    swap_reference_by_merge,
)
from lit_grpo.wire.protocol import ServerError

PROMPTS = [[1, 40, 41, 42, 43], [1, 60, 61], [1, 70, 71, 72]]
SAMPLING = SamplingConfig(max_new_tokens=16, temperature=1.0)
#: the vLLM tier's bar for fp32 (tests/test_vllm_colocated.py): the sampler's log-probs are the trainer's
MAX_MEAN_GAP = 1e-4
#: a gap this large means another distribution (the adapters below move log-probs by ~0.1 or more per token)
MIN_OTHER_GAP = 0.02
LORA = LoraArgs(r=4, alpha=8.0)
fake_vllm = test_vllm_engine.fake_vllm  # the stand-in vllm package (a fixture) of the engine's unit tests


def randomise_adapter(policy: torch.nn.Module, seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Give the adapter a random B (and A), as training would, and return its tensors."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if ".lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=generator))
    return adapter_state(policy)


def lora_policy() -> torch.nn.Module:
    """The suite's vLLM model (the base ``save_model`` writes) with a LoRA adapter."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return apply_lora(tiny_vllm_llama()[0], LORA)


def with_adapter(tensors: dict[str, torch.Tensor], base: torch.nn.Module | None = None) -> torch.nn.Module:
    """A LoRA model of ``base`` (default: the starting base) carrying the adapter ``tensors``."""
    model = copy.deepcopy(base) if base is not None else lora_policy()
    load_adapter_state(model, tensors)
    return model


# ---- without vLLM ---------------------------------------------------------------------------------------
def test_vllm_max_lora_rank_is_the_smallest_accepted_rank_that_holds_r():
    # vLLM accepts 1, 8, 16, 32, ...: r = 4 needs 8, r = 8 fits 8, r = 9 needs 16
    assert [vllm_max_lora_rank(r) for r in (1, 2, 4, 8, 9, 16, 17, 512)] == [1, 8, 8, 8, 16, 16, 32, 512]
    for bad in (0, -1, 2.0, True, 513):
        with pytest.raises(ValueError, match="rank"):
            vllm_max_lora_rank(bad)


def test_lora_llm_kwargs_enable_lora_with_the_versions_kept():
    kwargs = lora_llm_kwargs({"r": 16, "alpha": 32.0, "target_modules": ["q_proj"]}, keep=2)
    assert kwargs == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2, "max_cpu_loras": 2}
    with pytest.raises(ValueError, match="kept"):
        lora_llm_kwargs({"r": 4}, keep=0)


def test_adapter_versions_number_from_one_keep_the_newest_and_remove_older_directories(tmp_path):
    policy = lora_policy()
    versions = AdapterVersions(tmp_path, keep=2)
    spec = {"r": LORA.r, "alpha": LORA.alpha, "target_modules": ["q_proj", "v_proj"]}
    written = [versions.add(spec, randomise_adapter(policy, seed)) for seed in range(3)]
    assert [(v.name, v.id) for v in written] == [("v1", 1), ("v2", 2), ("v3", 3)]
    assert versions.current == written[-1]
    assert all((v.path / "adapter_config.json").is_file() and (v.path / "adapter_model.safetensors").is_file()
               for v in written)
    assert versions.stale() == [written[0]]
    versions.drop(written[0])
    assert not written[0].path.exists() and versions.stale() == []
    versions.clear()
    assert not any(tmp_path.iterdir())


# ---- colocated vLLM -----------------------------------------------------------------------------------------
@pytest.mark.vllm
@requires_vllm
def test_colocated_vllm_samples_from_each_pushed_adapter_and_follows_a_merge(tmp_path):
    import vllm.config.lora

    from lit_grpo.engines.vllm_engine import VLLMEngine

    assert VLLM_LORA_RANKS == get_args(vllm.config.lora.MaxLoRARanks)
    model_dir = save_model(tmp_path / "tiny")
    _, tokenizer = tiny_vllm_llama()
    policy = lora_policy()
    lora_root = tmp_path / "adapters"
    engine = VLLMEngine(str(model_dir), tokenizer=tokenizer, seed=0, policy=lambda: policy, lora_dir=str(lora_root),
                        **ENGINE_OPTIONS)
    try:
        # before any push vLLM samples the base, which is the policy while B = 0
        assert engine.lora_request() is None
        assert mean_gap(policy, PROMPTS, engine.generate(PROMPTS, n=4, sampling=SAMPLING, seed=1)) <= MAX_MEAN_GAP

        first = randomise_adapter(policy, seed=1)
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=True, step=1), step=1)
        groups = engine.generate(PROMPTS, n=8, sampling=SAMPLING, seed=7)
        gap, base_gap = mean_gap(policy, PROMPTS, groups), mean_gap(lora_policy(), PROMPTS, groups)
        print(f"push 1: gap to the adapter {gap:.2e}, to the base {base_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and base_gap > MIN_OTHER_GAP
        assert engine.synced_step == 1 and engine.loaded_adapter_ids() == {1}

        # a second push: the distribution is the new adapter's, not the old one's; the old version is unloaded
        randomise_adapter(policy, seed=2)
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=2), step=2)
        groups = engine.generate(PROMPTS, n=8, sampling=SAMPLING, seed=7)
        gap, old_gap = mean_gap(policy, PROMPTS, groups), mean_gap(with_adapter(first), PROMPTS, groups)
        print(f"push 2: gap to the new adapter {gap:.2e}, to the previous one {old_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and old_gap > MIN_OTHER_GAP
        assert engine.loaded_adapter_ids() == {2}
        assert [p.name for p in engine.adapters.versions.root.iterdir()] == ["v2"]

        # a stage swap merges the adapter into the trainer's base; the next push carries the merge, vLLM's base
        # follows it (a stale base with the new adapter would be another distribution)
        swap_reference_by_merge(policy, [])
        third = randomise_adapter(policy, seed=3)
        update = adapter_update(policy, engine.merges_applied, with_hash=False, step=3)
        assert len(update.merges) == 1
        engine.load_adapter(update, step=3)
        assert engine.merges_applied == 1
        groups = engine.generate(PROMPTS, n=8, sampling=SAMPLING, seed=7)
        gap, stale_gap = mean_gap(policy, PROMPTS, groups), mean_gap(with_adapter(third), PROMPTS, groups)
        print(f"after a merge: gap to the policy {gap:.2e}, to the stale base with the new adapter {stale_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and stale_gap > MIN_OTHER_GAP
        assert engine.loaded_adapter_ids() == {3}
        assert [p.name for p in engine.adapters.versions.root.iterdir()] == ["v3"]
    finally:
        engine.close()
    assert lora_root.is_dir() and not any(lora_root.iterdir())  # the versions' directory went with the engine


@pytest.mark.usefixtures("fake_vllm")
def test_a_lora_policy_starts_vllm_with_lora_enabled_and_a_directory_it_removes(tmp_path):
    from lit_grpo.engines.vllm_engine import VLLMEngine

    policy = lora_policy()
    engine = VLLMEngine("org/model", policy=lambda: policy, lora_dir=str(tmp_path / "adapters"))
    kwargs = only_llm().kwargs
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 8, 1)  # r = 4 -> 8
    assert engine.adapters.versions.root.parent == tmp_path / "adapters" and engine.lora_request() is None
    engine.close()
    assert not any((tmp_path / "adapters").iterdir())
    with pytest.raises(ValueError, match="set by VLLMEngine"):
        VLLMEngine("org/model", policy=lambda: policy, max_loras=3)
    with pytest.raises(ValueError, match="below model.lora.r"):
        VLLMEngine("org/model", policy=lambda: apply_lora(tiny_vllm_llama()[0], LoraArgs(r=16)), max_lora_rank=8)
    plain = VLLMEngine("org/model", policy=lambda: tiny_vllm_llama()[0])  # full fine-tuning: no LoRA in vLLM
    assert "enable_lora" not in FakeLLM.instances[-1].kwargs and plain.adapters is None


class FakeLoraLLM(FakeLLM):
    """The stand-in ``vllm.LLM`` with vLLM's adapter calls: ``llm_engine.add_lora / remove_lora / list_loras``,
    ``generate(lora_request=...)``, and a base reload that drops every adapter (vLLM's ``reset_lora_state``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.reloads: list[list[str]] = []
        self.llm_engine = self
        self.adapter_ids: set[int] = set()

    def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):  # noqa: ANN001, ANN201
        self.reloads.append([name for name, _ in kwargs["weights_iterator"]])
        self.events.append("reload base")
        self.adapter_ids.clear()
        return [None]

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):  # noqa: ANN001, ANN201
        self.events.append(f"generate with {None if lora_request is None else lora_request.lora_name}")
        return super().generate(prompts, sampling_params, use_tqdm)

    def add_lora(self, request) -> bool:  # noqa: ANN001
        assert (Path(request.lora_path) / "adapter_model.safetensors").is_file()
        self.events.append(f"add {request.lora_name} id {request.lora_int_id}")
        self.adapter_ids.add(request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.events.append(f"remove id {lora_id}")
        present = lora_id in self.adapter_ids
        self.adapter_ids.discard(lora_id)
        return present

    def list_loras(self) -> set[int]:
        return set(self.adapter_ids)


def test_colocated_pushes_load_a_new_version_unload_the_old_and_reload_the_base_at_a_merge(fake_vllm, tmp_path,
                                                                                           monkeypatch):
    import dataclasses
    import sys
    import types

    from lit_grpo.engines.vllm_engine import VLLMEngine

    request_module = types.ModuleType("vllm.lora.request")

    @dataclasses.dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    request_module.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm.lora.request", request_module)
    fake_vllm.LLM = FakeLoraLLM.build
    policy = lora_policy()
    engine = VLLMEngine("org/model", policy=lambda: policy, lora_dir=str(tmp_path))
    llm = FakeLLM.instances[-1]
    engine.generate([[1, 2]], 1, SAMPLING, seed=0)
    for step in (1, 2):
        randomise_adapter(policy, seed=step)
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=step), step=step)
        engine.generate([[1, 2]], 1, SAMPLING, seed=0)
    swap_reference_by_merge(policy, [])
    engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=3), step=3)
    engine.generate([[1, 2]], 1, SAMPLING, seed=0)
    assert [e for e in llm.events if e != "generate" and not e.startswith(("sleep", "wake", "reset"))] == [
        "generate with None",  # before any push: the base, which is the policy while B = 0
        "add v1 id 1", "generate with v1",
        "add v2 id 2", "remove id 1", "generate with v2",
        "reload base", "add v3 id 3", "remove id 2", "generate with v3",  # the merge: base first, then the adapter
    ]
    base = {name for name, p in tiny_vllm_llama()[0].named_parameters()}
    assert len(llm.reloads) == 1 and set(llm.reloads[0]) == base  # the plain model's names, no adapter tensors
    assert engine.merges_applied == 1 and engine.synced_step == 3 and engine.loaded_adapter_ids() == {3}
    assert [p.name for p in engine.adapters.versions.root.iterdir()] == ["v3"]


def test_a_push_to_a_vllm_engine_without_lora_is_refused():
    from lit_grpo.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)  # the check comes before vLLM is touched
    engine.adapters, engine.lora_spec = None, None
    policy = lora_policy()
    with pytest.raises(ValueError, match="built without LoRA"):
        engine.load_adapter(adapter_update(policy, 0, with_hash=False, step=1), step=1)



# ---- vllm serve ------------------------------------------------------------------------------------------------
@pytest.mark.vllm
@requires_vllm
def test_vllm_serve_loads_each_adapter_by_path_keeps_k_plus_1_and_follows_a_merge(tmp_path, monkeypatch):
    from vllm_helpers import VLLMServe

    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.engines.remote.vllm_client import ADAPTER_PREFIX, load_lora

    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # the server's runtime /v1/load_lora_adapter
    model_dir = save_model(tmp_path / "tiny")
    server = VLLMServe(model_dir, tmp_path / "serve.log",
                       extra=("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"))
    try:
        print(f"vllm serve with LoRA answered after {server.wait_ready():.1f} s")
        policy = lora_policy()
        engine = ServerEngine(url=server.url, kind="vllm", backend="gloo", dtype="float32", policy=policy,
                              timeout_s=120, lora_dir=str(tmp_path / "shared"), lora_keep=2, token=server.token)

        def adapters_loaded() -> set[str]:
            return {m["id"] for m in server.get("/v1/models")["data"] if m["id"].startswith(ADAPTER_PREFIX)}

        def sample() -> list:
            groups = engine.generate(PROMPTS, 8, SAMPLING, seed=7)
            assert {c.versions for g in groups for c in g} == {(str(engine.synced_step),)}
            return groups

        first = randomise_adapter(policy, seed=1)
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=True, step=1), step=1)
        groups = sample()
        gap, base_gap = mean_gap(policy, PROMPTS, groups), mean_gap(lora_policy(), PROMPTS, groups)
        print(f"serve push 1: gap to the adapter {gap:.2e}, to the base {base_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and base_gap > MIN_OTHER_GAP

        randomise_adapter(policy, seed=2)
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=2), step=2)
        groups = sample()
        gap, old_gap = mean_gap(policy, PROMPTS, groups), mean_gap(with_adapter(first), PROMPTS, groups)
        print(f"serve push 2: gap to the new adapter {gap:.2e}, to the previous one {old_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and old_gap > MIN_OTHER_GAP
        assert adapters_loaded() == {f"{ADAPTER_PREFIX}1", f"{ADAPTER_PREFIX}2"}  # K + 1 = 2 kept

        swap_reference_by_merge(policy, [])
        third = randomise_adapter(policy, seed=3)
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=3), step=3)
        assert engine.merges_applied == 1
        groups = sample()
        gap, stale_gap = mean_gap(policy, PROMPTS, groups), mean_gap(with_adapter(third), PROMPTS, groups)
        print(f"serve after a merge: gap to the policy {gap:.2e}, to the stale base {stale_gap:.2e}")
        assert gap <= MAX_MEAN_GAP and stale_gap > MIN_OTHER_GAP
        assert adapters_loaded() == {f"{ADAPTER_PREFIX}2", f"{ADAPTER_PREFIX}3"}  # the oldest was unloaded
        assert sorted(p.name for p in engine.vllm_adapters.versions.root.iterdir()) == [
            f"{ADAPTER_PREFIX}2", f"{ADAPTER_PREFIX}3"]
        # a path the server cannot read: one line with vLLM's reason and how to start the server
        with pytest.raises(ServerError, match="refused the adapter lit_grpo-bad .*--enable-lora") as refused:
            load_lora(engine.servers[0], "lit_grpo-bad", str(tmp_path / "not-shared"))
        print(f"refusal: {str(refused.value)[:300]}")
        assert "\n" not in str(refused.value)
        # --api-key guards the adapter routes: without the token, no path is read
        valid = str(engine.vllm_adapters.versions.root / f"{ADAPTER_PREFIX}3")
        status, _ = server.post_status("/v1/load_lora_adapter", {"lora_name": "lit_grpo-x", "lora_path": valid})
        assert status == 401 and adapters_loaded() == {f"{ADAPTER_PREFIX}2", f"{ADAPTER_PREFIX}3"}
        root = engine.vllm_adapters.versions.root
        engine.close()
        assert not root.exists() and (tmp_path / "shared").is_dir()  # this fit's directory went at close
    finally:
        server.stop()


class FakeLoraRoutes:
    """vllm serve's runtime LoRA routes (plain-text answers, as vLLM gives them) on 127.0.0.1, recording the adapters
    it holds; ``refuse`` makes the load route answer 400 like a server started without ``--enable-lora``."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        routes = self
        self.loaded: dict[str, str] = {"leftover": "", "lit_grpo-v7": ""}  # an earlier fit's adapter, and another
        self.refuse = False

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

            def answer(self, status: int, text: str, kind: str = "text/plain") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.end_headers()
                self.wfile.write(text.encode())

            def do_GET(self) -> None:  # noqa: N802
                self.answer(200, json.dumps({"data": [{"id": name} for name in routes.loaded]}), "application/json")

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter" and routes.refuse:
                    self.answer(400, json.dumps({"error": {"message": "LoRA is not enabled"}}), "application/json")
                elif self.path == "/v1/load_lora_adapter":
                    routes.loaded[body["lora_name"]] = body["lora_path"]
                    self.answer(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
                else:
                    routes.loaded.pop(body["lora_name"])
                    self.answer(200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_serve_adapters_load_by_path_keep_the_newest_and_say_how_to_start_a_refusing_server(tmp_path):
    from lit_grpo.engines.remote.connection import ServerConnection
    from lit_grpo.engines.remote.vllm_client import ServeAdapters, with_adapter_versions

    routes = FakeLoraRoutes()
    try:
        server = ServerConnection(routes.url, None, 10.0)
        reloads = []
        adapters = ServeAdapters(str(tmp_path / "shared"), keep=2, rank=0, reload_base=reloads.append)
        policy = lora_policy()
        for step in (3, 4, 5):
            update = adapter_update(policy, 0, with_hash=False, step=step)
            adapters.push([server], update, step)
        assert reloads == [3]  # the server's own checkpoint is replaced by the trainer's base at the first push only
        # the earlier fit's adapter went at the first push; the newest two stay, each loaded from its own directory
        assert sorted(routes.loaded) == ["leftover", "lit_grpo-v2", "lit_grpo-v3"]
        assert all((Path(routes.loaded[f"lit_grpo-v{k}"]) / "adapter_model.safetensors").is_file() for k in (2, 3))
        assert not (adapters.versions.root / "lit_grpo-v1").exists()
        assert adapters.current() == ("lit_grpo-v3", "5")  # requests name it; completions are labelled step 5
        response = with_adapter_versions({"choices": [{"index": 0}], "weight_version": "0"}, "5")
        assert response == {"choices": [{"index": 0, "weight_versions": [{"version": "5"}]}]}

        routes.refuse = True
        with pytest.raises(ServerError) as refused:
            adapters.push([server], adapter_update(policy, 0, with_hash=False, step=6), 6)
        error = str(refused.value)
        assert "refused the adapter lit_grpo-v4" in error and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in error
        assert "LoRA is not enabled" in error
        assert adapters.current() == ("lit_grpo-v3", "5")  # a refused version is not named by requests
        # another rank names the same versions without writing them
        other = ServeAdapters(str(tmp_path / "shared"), keep=2, rank=1, reload_base=reloads.append)
        other.push([server], adapter_update(policy, 0, with_hash=False, step=3), 3)
        assert other.current() == ("lit_grpo-v1", "3") and not other.versions.current.path.exists()
        # at close rank 0 removes the directory it made; the other rank's root is lora_dir itself, which stays
        root = adapters.versions.root
        other.close()
        assert root.is_dir()
        adapters.close()
        adapters.close()
        assert not root.exists() and list((tmp_path / "shared").iterdir()) == []
    finally:
        routes.server.shutdown()


def test_vllm_serve_with_lora_needs_a_shared_lora_dir():
    from lit_grpo.engines.remote.vllm_client import ServeAdapters

    with pytest.raises(ValueError, match="lora_dir"):
        ServeAdapters(None, keep=2, rank=0, reload_base=lambda step: None)


@pytest.mark.vllm
@requires_vllm
def test_lora_fit_with_the_colocated_vllm_engine_through_a_merge(tmp_path):
    """The data module builds the engine for the LoRA policy, WeightSync pushes adapters to it, and a stage swap's
    merge reaches it: at every synced step vLLM's log-probs are the trainer's (a lost adapter or a stale base after
    the swap would put the gap at the size of the update; lr is raised so that the update is large)."""
    import json
    import os
    import subprocess
    import sys

    from lit_grpo.cli.plots import read_scalars

    root = Path(__file__).resolve().parents[1]
    model_dir = save_model(tmp_path / "tiny")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    # the benchmark's coin reward: a random model solves nothing, so the correctness reward would give zero
    # advantages and an unchanged policy, which a lost adapter could not be told from
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")])))
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(root / "configs" / "demo_cpu.yaml"),
         "--model.model_name", str(model_dir), "--trainer.max_steps", "4", "--data.prompts_per_step", "4",
         "--data.rewards", json.dumps(["benchmarks.coin_reward:coin"]),
         "--model.lora", json.dumps({"r": 4}), "--model.optimizer.lr", "0.01", "--model.optimizer.warmup_steps", "0",
         "--model.beta", "0.1", "--ref_swap.max_swaps", "1", "--ref_swap.every_n_batches", "2",
         "--data.engine", "vllm", "--data.engine_options", json.dumps(ENGINE_OPTIONS),
         "--eval.at_start", "false", "--eval.at_end", "false", "--eval.every_n_optimizer_steps", "null"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    scalars = read_scalars(tmp_path / "runs" / "demo_cpu")
    gaps = [value for _, value in scalars["train/logp_gap_synced"]]
    pushed = [value for _, value in scalars["sync/bytes"]]
    print(f"LoRA fit: train/logp_gap_synced {[f'{g:.2e}' for g in gaps]}, sync/bytes {pushed}, "
          f"ref/swaps {[v for _, v in scalars['ref/swaps']]}")
    assert [v for _, v in scalars["ref/swaps"]][-1] == 1.0
    assert len(gaps) == 4 and max(gaps) <= MAX_MEAN_GAP


def test_lora_keep_below_k_plus_one_is_refused_before_anything_is_built():
    from lit_grpo.data.datamodule import RolloutDataModule

    options = dict(url="http://127.0.0.1:1", kind="vllm", lora_dir="adapters", lora_keep=1)
    with pytest.raises(ValueError, match=r"lora_keep=1 is below max_staleness \+ 1 = 2"):
        RolloutDataModule(engine="server", engine_options=options, max_staleness=1, temperature=1.0)
    for keep in (2, None):  # enough (None: K + 1): past this check, to the server, which is not there
        with pytest.raises(ValueError, match="does not answer"):
            RolloutDataModule(engine="server", engine_options=dict(options, lora_keep=keep), max_staleness=1)
