"""The KV cache written in place while decoding: each layer returns exactly what transformers' growing cache
returns, and decoding with it gives the same tokens and log-probs, bit for bit."""

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

import lit_grpo.engines.transformers_engine as engine_module
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.kv_cache import PreallocatedLayer, preallocate
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer


def test_layer_returns_what_the_growing_layer_returns_past_its_capacity_and_after_selection():
    torch.manual_seed(0)
    prompt_k, prompt_v = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4)
    growing = DynamicLayer()
    growing.update(prompt_k, prompt_v)
    mine = PreallocatedLayer(prompt_k, prompt_v, capacity=7)  # room for 2 tokens: the third step must grow
    for step in range(4):
        k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
        want = growing.update(k, v)
        got = mine.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), step
        assert mine.get_seq_length() == growing.get_seq_length() == 6 + step
    rows = torch.tensor([1, 1, 0])
    growing.batch_select_indices(rows)
    mine.batch_select_indices(rows)
    k, v = torch.randn(3, 3, 1, 4), torch.randn(3, 3, 1, 4)
    assert all(torch.equal(a, b) for a, b in zip(growing.update(k, v), mine.update(k, v)))
    mine.crop(-2)
    assert mine.get_seq_length() == 8 and torch.equal(mine.keys, growing.keys[..., :8, :])
    with pytest.raises(ValueError, match="negative"):
        mine.crop(3)


def test_preallocate_converts_filled_dynamic_layers_only():
    cache = DynamicCache()
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer_idx=0)
    cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer_idx=1)
    preallocate(cache, 8)
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 3
    with pytest.raises(ValueError, match="extra_tokens"):
        preallocate(cache, -1)


@pytest.mark.parametrize("temperature, top_p, autocast", [(1.0, 1.0, False), (0.7, 0.9, False), (1.0, 1.0, True)])
def test_decoding_with_it_is_bit_for_bit_the_growing_cache(monkeypatch, temperature, top_p, autocast):
    """Also under bf16 autocast, where Llama-family keys come out of RoPE in float32 and values in bfloat16: each
    buffer keeps its own dtype."""
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    prompts = [tokenizer.encode(t) for t in ("What is 2+2?", "Name a prime number.", "12*3=")]
    sampling = SamplingConfig(max_new_tokens=20, temperature=temperature, top_p=top_p)
    converted = []

    def spy(cache, extra):  # the engine really decodes through the preallocated layers
        preallocate(cache, extra)
        converted.extend(type(layer) for layer in cache.layers)
        return cache

    def run() -> list:
        engine = TransformersEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, decode="dynamic")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            groups = engine.generate(prompts, 4, sampling, 7)
        return [[(c.token_ids, c.logprobs, c.truncated) for c in g] for g in groups]

    monkeypatch.setattr(engine_module, "preallocate", spy)
    in_place = run()
    assert converted and all(kind is PreallocatedLayer for kind in converted)
    monkeypatch.setattr(engine_module, "preallocate", lambda cache, extra: cache)
    assert run() == in_place
