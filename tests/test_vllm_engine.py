"""VLLMEngine against a fake `vllm` package shaped like vLLM 0.33's offline API (no GPU, no vLLM needed)."""

from __future__ import annotations

import random
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from lit_grpo.engines.base import Completion, SamplingConfig
from lit_grpo.engines.vllm_engine import SEED_STRIDE, VLLMEngine, prompt_seed

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# ---- fake vLLM ---------------------------------------------------------------------------------------
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


class SamplingParams:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)


def TokensPrompt(**kwargs: Any) -> dict[str, Any]:  # noqa: N802 (vLLM's TypedDict is called like a class)
    return dict(kwargs)


class FakeModel(nn.Module):
    """vLLM model stand-in: bf16 weights, an int buffer, and a `load_weights` that copies by name."""

    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4).to(torch.bfloat16)
        self.proj = nn.Linear(4, 4, bias=False).to(torch.bfloat16)
        self.register_buffer("positions", torch.zeros(3, dtype=torch.long))
        self.events = events
        self.received: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):  # noqa: ANN001
        params = dict(self.named_parameters()) | dict(self.named_buffers())
        loaded = set()
        for name, tensor in weights:
            self.events.append(f"load {name}")
            self.received.append((name, tensor))
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


def default_sampler(child_seed: int, max_tokens: int) -> tuple[list[int], list[dict[int, Logprob]], str]:
    """Tokens drawn from the child's seed; each position also lists a decoy token with a different log-prob."""
    rng = random.Random(child_seed)
    length = rng.randint(1, max_tokens)
    tokens = [rng.randrange(50) for _ in range(length)]
    positions = [{t: Logprob(-rng.random()), t + 1000: Logprob(-99.0)} for t in tokens]
    return tokens, positions, "length" if length == max_tokens else "stop"


@dataclass
class FakeLLM:
    """Records what the engine asks of `vllm.LLM`; `generate` answers from `script` or `default_sampler`."""

    kwargs: dict[str, Any]
    events: list[str] = field(default_factory=list)
    generate_calls: list[dict[str, Any]] = field(default_factory=list)
    script: Any = None
    prefix_cache_ok: bool = True

    instances = []  # noqa: RUF012 (class-level registry, reset per test)

    def __post_init__(self) -> None:
        # no llm_engine / model_executor internals: weights must go through collective_rpc("reload_weights")
        self.model = FakeModel(self.events)
        FakeLLM.instances.append(self)

    def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None):  # noqa: ANN001, ANN201
        """`LLM.collective_rpc`: with the external launcher the one worker runs `method` in this process.
        Only the worker method the engine may use exists here (`load_weights` is not a worker RPC)."""
        self.events.append(f"collective_rpc {method}")
        if method != "reload_weights":
            raise AttributeError(f"the GPU worker has no method {method!r}")
        assert set(kwargs) == {"weights_iterator", "is_checkpoint_format"} and kwargs["is_checkpoint_format"] is True
        self.model.load_weights(kwargs["weights_iterator"])
        return [None]

    @classmethod
    def build(cls, **kwargs: Any) -> FakeLLM:
        return cls(kwargs=kwargs)

    def generate(self, prompts, sampling_params, use_tqdm=True):  # noqa: ANN001
        self.events.append("generate")
        self.generate_calls.append({"prompts": prompts, "params": sampling_params, "use_tqdm": use_tqdm})
        results = []
        for i, (prompt, params) in enumerate(zip(prompts, sampling_params)):
            outputs = []
            for j in range(params.n):
                if self.script is not None:
                    tokens, positions, reason = self.script(i, j)
                else:
                    tokens, positions, reason = default_sampler(params.seed + j, params.max_tokens)
                outputs.append(CompletionOutput(j, "", tokens, None, positions, reason))
            # vLLM aggregates children by index; hand them back out of order to check the engine sorts them
            results.append(RequestOutput(str(i), prompt["prompt_token_ids"], outputs[::-1]))
        return results

    def sleep(self, level: int = 1) -> None:
        self.events.append(f"sleep {level}")

    def wake_up(self, tags=None) -> bool:  # noqa: ANN001
        self.events.append("wake_up")
        return True

    def reset_prefix_cache(self) -> bool:
        self.events.append("reset_prefix_cache")
        return self.prefix_cache_ok


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    FakeLLM.instances = []
    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    vllm.LLM = FakeLLM.build
    vllm.SamplingParams = SamplingParams
    vllm.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    for name in LAUNCHER_VARS:  # set-then-delete so that whatever the engine exports is undone afterwards
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    return vllm


def only_llm() -> FakeLLM:
    assert len(FakeLLM.instances) == 1
    return FakeLLM.instances[0]


# ---- construction ------------------------------------------------------------------------------------
def test_constructor_runs_vllm_colocated_with_processed_logprobs(fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the vLLM tier's helpers set it for their servers
    VLLMEngine("org/model", dtype="float16", gpu_memory_utilization=0.5, max_model_len=1024, seed=7,
               enforce_eager=True)
    llm = only_llm()
    assert llm.kwargs == {
        "model": "org/model",
        "dtype": "float16",
        "seed": 7,
        "gpu_memory_utilization": 0.5,
        "enable_sleep_mode": False,
        "distributed_executor_backend": "external_launcher",
        "logprobs_mode": "processed_logprobs",
        "max_model_len": 1024,
        "enforce_eager": True,
        # the CPU build's needs (lit_grpo.engines.vllm_cpu): nothing of it on a GPU
        **({} if torch.cuda.is_available() else
           {"enable_chunked_prefill": False, "max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 2 << 30}),
    }
    assert llm.events == []  # no sleep mode: never put to sleep


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU build's defaults")
def test_cpu_defaults_yield_to_the_users_options_and_the_kv_cache_variable(fake_vllm, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    VLLMEngine("org/model", max_model_len=20000, enable_chunked_prefill=True, kv_cache_memory_bytes=1 << 30)
    kwargs = FakeLLM.instances[-1].kwargs
    assert (kwargs["enable_chunked_prefill"], kwargs["kv_cache_memory_bytes"]) == (True, 1 << 30)
    assert kwargs["max_num_batched_tokens"] == 20000  # at least the longest sequence, as vLLM requires
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    VLLMEngine("org/model")
    assert "kv_cache_memory_bytes" not in FakeLLM.instances[-1].kwargs  # vLLM sizes it from the variable


def test_constructor_exports_single_process_rendezvous(fake_vllm):
    import os

    VLLMEngine("org/model")
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert 0 < int(os.environ["MASTER_PORT"]) < 65536


def test_constructor_defaults_and_tokenizer_name(fake_vllm):
    VLLMEngine("org/model", tokenizer="org/tokenizer")
    kwargs = only_llm().kwargs
    assert "max_model_len" not in kwargs  # None leaves vLLM's own choice
    assert kwargs["tokenizer"] == "org/tokenizer"
    assert (kwargs["dtype"], kwargs["gpu_memory_utilization"], kwargs["seed"]) == ("bfloat16", 0.3, 0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp8"}, "'fp8'"),
        ({"gpu_memory_utilization": 0.0}, "0.0"),
        ({"gpu_memory_utilization": 1.5}, "1.5"),
        ({"max_model_len": 0}, "max_model_len.*0"),
        ({"seed": "1"}, "seed.*'1'"),
        ({"tokenizer": 3}, "tokenizer"),
        ({"logprobs_mode": "raw_logprobs"}, "logprobs_mode"),
        ({"distributed_executor_backend": "mp"}, "distributed_executor_backend"),
    ],
)
def test_bad_arguments_are_rejected_before_vllm_starts(fake_vllm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMEngine("org/model", **kwargs)
    assert FakeLLM.instances == []


@pytest.mark.parametrize("name", ["", "tiny-random-llama"])
def test_bad_model_names_are_rejected(fake_vllm, name):
    with pytest.raises(ValueError, match=repr(name)):
        VLLMEngine(name)
    assert FakeLLM.instances == []


# ---- sampling ----------------------------------------------------------------------------------------
def test_generate_sends_token_prompts_and_sampling_params(fake_vllm):
    tokenizer = types.SimpleNamespace(eos_token_id=9)
    engine = VLLMEngine("org/model", tokenizer=tokenizer)
    sampling = SamplingConfig(max_new_tokens=5, temperature=0.7, top_p=0.9)
    engine.generate([[1, 2, 3], [4, 5]], n=3, sampling=sampling, seed=11)
    (call,) = only_llm().generate_calls
    assert call["prompts"] == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [4, 5]}]
    assert call["use_tqdm"] is False
    assert "tokenizer" not in only_llm().kwargs  # a tokenizer object is not something vLLM can load
    for p, params in enumerate(call["params"]):
        assert params.kwargs == {
            "n": 3,
            "temperature": 0.7,
            "top_p": 0.9,
            "max_tokens": 5,
            # neutral: nothing of the model's generation config can reach the sampler (engines.sampling_fields)
            "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "seed": 11 * SEED_STRIDE + p * 3,
            "logprobs": 0,
            "stop_token_ids": [9],
            "detokenize": False,
        }


def test_generate_converts_outputs_in_child_order(fake_vllm):
    engine = VLLMEngine("org/model")
    scripted = {
        (0, 0): ([5, 6, 7], [-0.5, -0.25, -1.0], "length"),
        (0, 1): ([8], [-2.0], "stop"),
        (0, 2): ([9, 9, 9], [-0.5, -0.5, -0.5], "stop"),  # a stop token on the last allowed step: not cut
        (1, 0): ([3, 2], [-0.125, -0.75], "stop"),
        (1, 1): ([4, 4, 4], [-1.5, -1.5, -0.5], "length"),
        (1, 2): ([7, 1], [-0.25, -3.0], "repetition"),
    }

    def script(i, j):  # noqa: ANN001
        tokens, logps, reason = scripted[(i, j)]
        # decoys: other ids, one more likely and one less likely than the sampled token; only its entry counts
        positions = [{t + 1: Logprob(-0.01), t: Logprob(lp), t - 1: Logprob(-60.0)} for t, lp in zip(tokens, logps)]
        return tokens, positions, reason

    only_llm().script = script
    groups = engine.generate([[1], [2, 3]], n=3, sampling=SamplingConfig(max_new_tokens=3), seed=0)
    expected = [
        [Completion([5, 6, 7], [-0.5, -0.25, -1.0], True), Completion([8], [-2.0], False),
         Completion([9, 9, 9], [-0.5, -0.5, -0.5], False)],
        [Completion([3, 2], [-0.125, -0.75], False), Completion([4, 4, 4], [-1.5, -1.5, -0.5], True),
         Completion([7, 1], [-0.25, -3.0], False)],
    ]
    assert groups == expected
    assert all(isinstance(x, float) for g in groups for c in g for x in c.logprobs)


def test_generate_is_reproducible_and_children_get_distinct_seeds(fake_vllm):
    engine = VLLMEngine("org/model")
    sampling = SamplingConfig(max_new_tokens=6)
    prompts = [[1], [2], [3]]
    first = engine.generate(prompts, n=4, sampling=sampling, seed=3)
    again = engine.generate(prompts, n=4, sampling=sampling, seed=3)
    other = engine.generate(prompts, n=4, sampling=sampling, seed=4)
    assert first == again
    assert first != other
    calls = only_llm().generate_calls
    child_seeds = [params.seed + j for call in calls[:1] for params in call["params"] for j in range(params.n)]
    assert len(set(child_seeds)) == len(prompts) * 4
    next_call = {params.seed + j for params in calls[2]["params"] for j in range(params.n)}
    assert not next_call & set(child_seeds)  # consecutive call seeds do not reuse each other's streams


def test_prompt_seed_fits_vllms_int64_seed_buffer():
    assert prompt_seed(2**70, 5, 8) < 2**63
    assert prompt_seed(-1, 0, 8) >= 0


@pytest.mark.parametrize("reason", ["abort", "error", None])
def test_failed_requests_raise(fake_vllm, reason):
    engine = VLLMEngine("org/model")
    only_llm().script = lambda i, j: ([1], [{1: Logprob(-0.1)}], reason)
    with pytest.raises(RuntimeError, match=repr(reason)):
        engine.generate([[1]], n=1, sampling=SamplingConfig(), seed=0)


def test_missing_logprobs_raise(fake_vllm):
    engine = VLLMEngine("org/model")
    only_llm().script = lambda i, j: ([1, 2], None, "stop")
    with pytest.raises(RuntimeError, match="log-prob"):
        engine.generate([[1]], n=1, sampling=SamplingConfig(), seed=0)


def test_generate_validates_its_arguments(fake_vllm):
    engine = VLLMEngine("org/model")
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        engine.generate([[1]], n=0, sampling=SamplingConfig(), seed=0)
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[1], []], n=2, sampling=SamplingConfig(), seed=0)
    assert engine.generate([], n=2, sampling=SamplingConfig(), seed=0) == []
    assert only_llm().generate_calls == []


# ---- weights -----------------------------------------------------------------------------------------
def test_load_weights_streams_converted_tensors_then_resets_prefix_cache(fake_vllm):
    engine = VLLMEngine("org/model")
    llm = only_llm()
    embed = torch.randn(6, 4, dtype=torch.float32)
    proj = torch.randn(4, 4, dtype=torch.float32)
    positions = torch.arange(3)

    def source():
        for name, tensor in (("embed.weight", embed), ("proj.weight", proj), ("positions", positions)):
            llm.events.append(f"yield {name}")
            yield name, tensor

    engine.load_weights(source(), step=5)
    assert llm.events == [
        "collective_rpc reload_weights",
        "yield embed.weight", "load embed.weight",  # one tensor at a time: nothing is gathered up front
        "yield proj.weight", "load proj.weight",
        "yield positions", "load positions",
        "reset_prefix_cache",
    ]
    assert [name for name, _ in llm.model.received] == ["embed.weight", "proj.weight", "positions"]
    assert [t.dtype for _, t in llm.model.received] == [torch.bfloat16, torch.bfloat16, torch.long]
    assert torch.equal(llm.model.embed.weight, embed.to(torch.bfloat16))
    assert torch.equal(llm.model.proj.weight, proj.to(torch.bfloat16))
    assert engine.synced_step == 5


@pytest.mark.parametrize("temperature", [0.005, 2.5])
def test_temperatures_vllm_would_change_are_rejected(fake_vllm, temperature):
    engine = VLLMEngine("org/model")
    with pytest.raises(ValueError, match=rf"temperature {temperature} is outside \[0.01, 2.0\]"):
        engine.generate([[1, 2]], n=2, sampling=SamplingConfig(max_new_tokens=4, temperature=temperature), seed=0)
    assert only_llm().generate_calls == []
    # the data module refuses them before any model or engine is built
    from lit_grpo.data.datamodule import RolloutDataModule

    with pytest.raises(ValueError, match="outside"):
        RolloutDataModule(engine="vllm", temperature=temperature)
    with pytest.raises(ValueError, match="outside"):
        RolloutDataModule(engine="server", engine_options={"kind": "vllm"}, temperature=temperature)
    # the project's server samples at any T > 0: what stops this data module is only the missing server URL
    with pytest.raises(ValueError, match="exactly one of url") as refused:
        RolloutDataModule(engine="server", temperature=temperature)
    assert "temperature" not in str(refused.value)


def test_local_rank_must_match_the_trainers_cuda_device(monkeypatch):
    from lit_grpo.engines import vllm_engine

    monkeypatch.setattr(vllm_engine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(vllm_engine.torch.cuda, "current_device", lambda: 3)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert vllm_engine.trainer_device_index() == 3  # not 0: the device the trainer selected
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert vllm_engine.trainer_device_index() == 3
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match="LOCAL_RANK=0 but this process trains on cuda:3"):
        vllm_engine.trainer_device_index()


def test_load_weights_without_tensors_raises_and_keeps_step(fake_vllm):
    engine = VLLMEngine("org/model")
    engine.synced_step = 2
    with pytest.raises(ValueError, match="no tensors"):
        engine.load_weights(iter(()), step=3)
    assert engine.synced_step == 2
    assert "reset_prefix_cache" not in only_llm().events


def test_failed_prefix_cache_reset_raises(fake_vllm):
    engine = VLLMEngine("org/model")
    only_llm().prefix_cache_ok = False
    with pytest.raises(RuntimeError, match="prefix cache"):
        engine.load_weights([("proj.weight", torch.zeros(4, 4))], step=1)
    assert engine.synced_step == 0


def test_load_state_dict_goes_through_load_weights(fake_vllm):
    engine = VLLMEngine("org/model")
    engine.load_state_dict({"proj.weight": torch.ones(4, 4)}, step=8)
    assert torch.equal(only_llm().model.proj.weight, torch.ones(4, 4, dtype=torch.bfloat16))
    assert engine.synced_step == 8


def test_score_and_state_dict_are_unavailable(fake_vllm):
    engine = VLLMEngine("org/model")
    assert engine.score(object(), temperature=1.0) is None
    assert engine.state_dict() is None
    assert engine.to("cpu") is engine


# ---- sleep mode --------------------------------------------------------------------------------------
def test_sleep_mode_frees_memory_outside_rollouts(fake_vllm):
    engine = VLLMEngine("org/model", enable_sleep_mode=True)
    llm = only_llm()
    assert llm.kwargs["enable_sleep_mode"] is True
    assert llm.events == ["sleep 1"]  # asleep until the first rollout
    engine.generate([[1]], n=2, sampling=SamplingConfig(max_new_tokens=2), seed=0)
    assert llm.events[1:] == ["wake_up", "generate", "sleep 1"]
    del llm.events[:]
    engine.load_weights([("proj.weight", torch.zeros(4, 4))], step=1)
    assert llm.events == ["wake_up", "collective_rpc reload_weights", "load proj.weight", "reset_prefix_cache"]
    del llm.events[:]
    engine.generate([[1]], n=2, sampling=SamplingConfig(max_new_tokens=2), seed=0)
    assert llm.events == ["generate", "sleep 1"]  # already awake after the sync


def test_sleep_mode_sleeps_again_when_generation_fails(fake_vllm):
    engine = VLLMEngine("org/model", enable_sleep_mode=True)
    llm = only_llm()

    def boom(*args, **kwargs):
        raise MemoryError("out of KV cache")

    llm.generate = boom
    with pytest.raises(MemoryError):
        engine.generate([[1]], n=2, sampling=SamplingConfig(), seed=0)
    assert llm.events == ["sleep 1", "wake_up", "sleep 1"]


# ---- optional dependency -----------------------------------------------------------------------------
def test_missing_vllm_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'.*CUDA"):
        VLLMEngine("org/model")


def test_module_and_package_import_without_vllm(monkeypatch):
    import importlib

    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.delitem(sys.modules, "lit_grpo.engines.vllm_engine", raising=False)
    module = importlib.import_module("lit_grpo.engines.vllm_engine")
    import lit_grpo.engines as engines

    assert engines.VLLMEngine is module.VLLMEngine
