"""Before the first step, a micro-batch the machine cannot hold is refused in one line naming the options that bring it
down (``lit_grpo.training.memory_check``), rather than the fit being killed for memory after its first rollout."""

from __future__ import annotations

import pytest
import torch
from cli_runner import refusal_line
from conftest import tiny_data, tiny_module, tiny_trainer

import lit_grpo.training.memory_check as memory_check
from lit_grpo.core.peak_memory import PeakLiveBytes
from lit_grpo.core.scoring import policy_logprobs
from lit_grpo.training.memory_check import (
    UpdateMemory,
    UpdateMemoryError,
    micro_batch_bound,
    probe_micro_batch,
    probe_update_memory,
    update_too_large,
)

MIB = 2**20


def score(packed: bool):  # noqa: ANN201
    return lambda model, mb, head_chunk_mb: policy_logprobs(model, mb, 1.0, with_entropy=True, packed=packed,
                                                            head_chunk_mb=head_chunk_mb)[0]


@pytest.mark.parametrize("packed", [False, True])
def test_the_probes_bound_holds_at_a_larger_micro_batch(packed: bool) -> None:
    """Extended from 64 and 192 tokens to 1,600, the lower bound is below the peak measured there, and not far
    below (at least half of it: the activations are most of it)."""
    module = tiny_module()
    model = module.policy.train()
    memory = probe_update_memory(model, score(packed), 256.0, [])
    mb = probe_micro_batch(model.config.vocab_size, 1600, torch.device("cpu"))
    with PeakLiveBytes() as meter:
        logp = score(packed)(model, mb, 256.0)
        (logp * mb.completion_mask).sum().backward()
    tokens = int(mb.completion_mask.numel()) + 16
    assert memory.slope > 0
    assert 0.5 * meter.peak < memory.need(tokens) <= meter.peak, (memory.need(tokens), meter.peak)


def test_the_optimizers_state_to_come_is_counted_once() -> None:
    module = tiny_module()
    params = [p for p in module.policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    expected = 2 * sum(p.numel() * p.element_size() for p in params)
    assert memory_check.optimizer_state_bytes([optimizer]) == expected
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # the state exists now: a resumed fit holds it already
    assert memory_check.optimizer_state_bytes([optimizer]) == 0


def test_the_refusal_names_the_bound_the_need_and_the_options() -> None:
    memory = UpdateMemory(slope=0.5 * MIB, head_bytes_per_token=0.1 * MIB, head_chunk_tokens=100,
                          optimizer_bytes=30 * MIB)
    tokens, where = micro_batch_bound(None, 16, 1024)
    assert tokens == 16 * 1024 and "data.micro_batch_size=16 x data.max_new_tokens=1024" in where
    assert update_too_large(memory, 100, 2**30, where) is None
    line = update_too_large(memory, tokens, 2**30, where)
    assert "\n" not in line and "16384 tokens" in line and "at least 8.0 GiB" in line
    assert "1.0 GiB are available" in line
    fits = memory.tokens_within(0.6 * 2**30)
    assert f"data.micro_batch_tokens to at most about {fits}" in line and "model.gradient_checkpointing: true" in line
    assert memory.need(fits) <= 0.6 * 2**30 < memory.need(fits + 1)
    assert micro_batch_bound(4096, 16, 1024) == (4096, "data.micro_batch_tokens=4096")
    # a step of 4 completions cannot form a micro-batch past 4 x 512 tokens, whatever the budget or micro-batch size
    assert micro_batch_bound(4096, 16, 512, rows_per_step=4) == (2048, "a step's completions=4 x "
                                                                       "data.max_new_tokens=512, prompts not counted")
    assert micro_batch_bound(None, 16, 512, rows_per_step=4)[0] == 2048
    assert micro_batch_bound(1024, 16, 512, rows_per_step=4) == (1024, "data.micro_batch_tokens=1024")


def test_a_fit_that_cannot_hold_its_micro_batch_stops_before_any_rollout(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    rollouts = []
    data = tiny_data(max_new_tokens=4000, micro_batch_size=64)
    monkeypatch.setattr(data, "rollout_batch", lambda batch: rollouts.append(batch))
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 64 * MIB)
    with pytest.raises(UpdateMemoryError, match=r"micro-batch of \d+ tokens .* 64 MiB are available"):
        tiny_trainer(tmp_path, max_steps=1).fit(tiny_module(), datamodule=data)
    assert rollouts == []


@pytest.mark.parametrize("rough_bound_fits", [True, False])
def test_a_fit_within_the_memory_runs(rough_bound_fits: bool, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Within the config's generous bound no probe runs; past it the probes measure, and a fit that fits goes on."""
    probes = []
    original = memory_check.probe_update_memory
    monkeypatch.setattr(memory_check, "probe_update_memory", lambda *a, **k: probes.append(original(*a, **k))
                        or probes[-1])
    if not rough_bound_fits:
        monkeypatch.setattr(memory_check, "rough_upper_bound", lambda *args: float("inf"))
    trainer = tiny_trainer(tmp_path, max_steps=1)
    trainer.fit(tiny_module(), datamodule=tiny_data())
    assert trainer.global_step == 1 and len(probes) == (0 if rough_bound_fits else 1)


def test_the_command_line_says_it_in_one_line(tmp_path, monkeypatch, capsys) -> None:  # noqa: ANN001
    from test_cli_errors import TINY_RUN

    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 64 * MIB)
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", *TINY_RUN, "--data.max_new_tokens", "4000",
                         "--data.micro_batch_size", "64", f"--trainer.default_root_dir={tmp_path}"],
                        tmp_path, monkeypatch, capsys, may_load=True)
    assert "data.micro_batch_tokens to at most" in line and "model.gradient_checkpointing: true" in line


def cache_bytes_after_decoding(config, rows: int, prompt: int, steps: int) -> int:  # noqa: ANN001
    """The bytes transformers' own cache holds after a prefill of ``prompt`` tokens and ``steps`` decode steps."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(0, config.vocab_size, (rows, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        for _ in range(steps):
            cache = model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True).past_key_values
    return sum((layer.keys.numel() + layer.values.numel()) * layer.keys.element_size() for layer in cache.layers)


def small(cls, **sizes):  # noqa: ANN001, ANN201
    return cls(vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
               **sizes)


@pytest.mark.parametrize("positions", [6, 23])
@pytest.mark.parametrize("family", ["llama", "qwen2-sliding-layers", "mistral-window", "gemma2"])
def test_the_kv_cache_formula_is_the_bytes_transformers_cache_holds(family: str, positions: int) -> None:
    """eq. rows x positions x layers x 2 x kv heads x head dim x bytes, a sliding layer capped at its window - 1:
    against the keys and values of transformers' own cache after decoding, below and past the window of 8."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    config = {"llama": lambda: small(LlamaConfig, num_hidden_layers=3),
              "qwen2-sliding-layers": lambda: small(Qwen2Config, num_hidden_layers=4, use_sliding_window=True,
                                                    sliding_window=8, max_window_layers=2),
              "mistral-window": lambda: small(MistralConfig, num_hidden_layers=2, sliding_window=8),
              "gemma2": lambda: small(Gemma2Config, num_hidden_layers=4, sliding_window=8, head_dim=16)}[family]()
    prompt = positions - 3
    assert memory_check.kv_cache_bytes(config, 3, positions, 4) == cache_bytes_after_decoding(config, 3, prompt, 3)


def test_a_config_without_attention_sizes_has_no_kv_bound() -> None:
    assert memory_check.kv_cache_bytes(object(), 4, 100, 4) is None
    assert memory_check.generation_too_large(object(), 4, 100, 4, 1, "x") is None


def test_the_generation_refusal_names_the_need_and_the_sequences_that_fit() -> None:
    from transformers import LlamaConfig

    config = small(LlamaConfig, num_hidden_layers=3)
    per_row = 3 * 1000 * 2 * 2 * 8 * 4  # 3 layers x 1,000 positions x keys and values x 2 kv heads x 8 x float32
    assert memory_check.kv_cache_bytes(config, 1, 1000, 4) == per_row
    where = "data.prompts_per_step=2 x data.num_generations=8"
    assert memory_check.generation_too_large(config, 16, 1000, 4, 16 * per_row, where) is None
    line = memory_check.generation_too_large(config, 16, 1000, 4, 10 * per_row, where)
    assert "\n" not in line and line.startswith(f"generating 16 sequences of 1000 new tokens at once ({where})")
    assert "data.engine_options.max_num_seqs to at most about 6 " in line  # 60 % of 10 rows' worth
    line = memory_check.generation_too_large(config, 16, 1000, 4, per_row, where)
    assert line.endswith("lower data.max_new_tokens")


@pytest.mark.parametrize("cap", [None, 4])
def test_a_fit_whose_kv_cache_cannot_fit_stops_before_any_rollout(cap: int | None, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The update's micro-batch is bounded to 64 tokens and fits; the engine's cache for 8 sequences (or the 4 that
    ``max_num_seqs`` lets decode at once) of 4,000 new tokens does not."""
    from lit_grpo.engines.options import TransformersOptions

    module = tiny_module()
    per_row = memory_check.kv_cache_bytes(module.policy.config, 1, 4000, 4)
    rollouts = []
    data = tiny_data(max_new_tokens=4000, micro_batch_tokens=64,
                     engine_options=TransformersOptions(max_num_seqs=cap))
    monkeypatch.setattr(data, "rollout_batch", lambda batch: rollouts.append(batch))
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 3 * per_row)
    rows = 8 if cap is None else cap
    where = "data.prompts_per_step=2 x data.num_generations=4" if cap is None else "data.engine_options.max_num_seqs=4"
    with pytest.raises(UpdateMemoryError, match=rf"generating {rows} sequences .*\({where}\).* about 1 \(sequences"):
        tiny_trainer(tmp_path, max_steps=1).fit(module, datamodule=data)
    assert rollouts == []


@pytest.mark.parametrize(("precision", "autocast", "element"), [("32-true", None, 4), ("bf16-mixed", None, 2),
                                                                   ("32-true", "bf16", 2)])
def test_a_half_precision_sampler_is_checked_at_two_bytes_a_value(precision, autocast, element, monkeypatch) -> None:  # noqa: ANN001
    """Under bf16 autocast (the trainer's ``bf16-mixed``, or the engine's ``sampler_autocast``) the projections
    write half-precision keys and values: the bound counts 2 bytes a value, not the float32 weights' 4."""
    from types import SimpleNamespace

    from lit_grpo.engines.options import TransformersOptions

    module = tiny_module()
    per_row = memory_check.kv_cache_bytes(module.policy.config, 1, 1000, element)
    data = SimpleNamespace(sampling=SimpleNamespace(max_new_tokens=1000), engine_kind="transformers",
                           prompts_per_step=2, num_generations=4,
                           engine_options=TransformersOptions(sampler_autocast=autocast))
    trainer = SimpleNamespace(datamodule=data, world_size=1, precision=precision)
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 8 * per_row)
    memory_check.check_generation_memory(module, trainer)  # 8 sequences at this element size fit exactly
    monkeypatch.setattr(memory_check, "available_bytes", lambda device: 8 * per_row - 1)
    with pytest.raises(UpdateMemoryError, match="generating 8 sequences of 1000 new tokens"):
        memory_check.check_generation_memory(module, trainer)
