"""Unit tests of lit_grpo.models.lora: the adapter's options, its tensors under peft's names, the merge (hand-computed),
the fresh adapter, the base hash, the merged view, the stage swap by merge, the push and the stacked export."""

import hashlib

import pytest
import torch

from lit_grpo.models import lora
from lit_grpo.models.loading import load_model_and_tokenizer

TOKENS = torch.tensor([[3, 5, 7, 9, 11, 2], [4, 6, 8, 10, 12, 14]])


def tiny_model() -> torch.nn.Module:
    return load_model_and_tokenizer("tiny-random-llama")[0]


def lora_model(seed: int = 0, r: int = 4, **kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    return lora.apply_lora(tiny_model(), lora.LoraArgs(r=r, **kwargs))


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=TOKENS).logits


def randomise_b(model: torch.nn.Module, seed: int = 1) -> None:
    """A trained-looking adapter: B != 0 (a fresh one has B = 0 and leaves the model unchanged)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"r": 0}, "lora.r must be an integer >= 1, got 0"),
    ({"r": 2.5}, "lora.r must be an integer >= 1"),
    ({"alpha": 0}, "lora.alpha must be a finite number > 0, got 0"),
    ({"alpha": float("inf")}, "lora.alpha must be a finite number > 0"),
    ({"dropout": 1.0}, r"lora.dropout must be a number in \[0, 1\), got 1.0"),
    ({"target_modules": "q_proj"}, "lora.target_modules must be a non-empty list"),
    ({"target_modules": []}, "lora.target_modules must be a non-empty list"),
])
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        lora.LoraArgs(**kwargs)


def test_default_targets_are_attention_and_mlp_projections_and_unknown_targets_fail():
    model = tiny_model()
    assert lora.resolve_target_modules(model, None) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"]
    assert "lm_head" not in lora.linear_module_names(model)
    with pytest.raises(ValueError, match=r"lora.target_modules \['qkv'\] match no linear layer of LlamaForCausalLM; "
                                         r"expected among \['q_proj'"):
        lora.apply_lora(model, lora.LoraArgs(target_modules=["q_proj", "qkv"]))


def test_apply_lora_freezes_the_base_starts_as_the_model_and_is_seeded():
    plain = tiny_model()
    reference = logits(plain)
    model = lora_model(seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    torch.testing.assert_close(logits(model), reference, rtol=0, atol=0)  # B = 0
    again = lora_model(seed=0)
    for (_, a), (_, b) in zip(lora.adapter_state(model).items(), lora.adapter_state(again).items()):
        assert torch.equal(a, b)
    assert lora.is_lora(model) and not lora.is_lora(plain)
    assert lora.lora_spec(model) == {"r": 4, "alpha": 32.0, "dropout": 0.0, "target_modules": sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])}
    assert lora.LoraArgs(**lora.lora_spec(model)) == lora.LoraArgs(r=4, target_modules=lora.lora_spec(model)[
        "target_modules"])


def test_adapter_state_is_peft_saved_format_and_loads_back_exactly():
    from peft.utils import get_peft_model_state_dict

    model = lora_model()
    randomise_b(model)
    state = lora.adapter_state(model)
    expected = get_peft_model_state_dict(model)
    assert list(state) == list(expected)
    for key in state:
        assert torch.equal(state[key], expected[key])
    other = lora_model(seed=5)
    lora.load_adapter_state(other, state)
    torch.testing.assert_close(logits(other), logits(model), rtol=0, atol=0)
    first = next(iter(state))
    with pytest.raises(ValueError, match=f"adapter does not fit the model's adapter: missing '{first}'"):
        lora.load_adapter_state(other, {k: v for k, v in state.items() if k != first})
    bad = dict(state, **{first: torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"has shape \[3, 3\], the model's adapter \[4, "):
        lora.load_adapter_state(other, bad)


def test_lora_delta_by_hand():
    a = torch.tensor([[1.0, 2.0, 0.0]])  # r = 1, in = 3
    b = torch.tensor([[1.0], [-1.0]])  # out = 2
    # scale * B @ A, entry (i, j) = scale * b[i] * a[j]
    expected = torch.tensor([[0.5, 1.0, 0.0], [-0.5, -1.0, 0.0]])
    assert torch.equal(lora.lora_delta(a, b, 0.5, False, torch.float32), expected)
    assert torch.equal(lora.lora_delta(a, b, 0.5, True, torch.float32), expected.T)  # Conv1D's [in, out] layout


def test_merge_adds_scaled_b_a_to_each_base_weight_and_keeps_the_function():
    model = lora_model(alpha=8.0)  # scale = 8 / 4 = 2
    randomise_b(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with_adapter = logits(model)
    merged = lora.merge_adapter_into_base(model)
    name = "base_model.model.model.layers.1.mlp.up_proj"
    a, b = before[f"{name}.lora_A.default.weight"], before[f"{name}.lora_B.default.weight"]
    by_hand = before[f"{name}.base_layer.weight"] + 2.0 * torch.einsum("or,ri->oi", b, a)
    torch.testing.assert_close(model.get_parameter(f"{name}.base_layer.weight"), by_hand, rtol=0, atol=1e-6)
    assert torch.equal(merged[f"{name}.lora_B.weight"], b)
    # the adapter is left in place: with it the policy now counts it twice; without it, the merged base is the policy
    with model.disable_adapter():
        torch.testing.assert_close(logits(model), with_adapter, rtol=0, atol=1e-5)


def test_merging_equal_adapters_into_equal_bases_gives_bitwise_equal_bases():
    trainer = lora_model(seed=0)
    randomise_b(trainer)
    sampler = lora_model(seed=3)  # another adapter: the merge must use the one it is given
    assert lora.base_hash(trainer) == lora.base_hash(sampler)
    merged = lora.merge_adapter_into_base(trainer)
    lora.merge_adapter_into_base(sampler, merged)
    assert lora.base_hash(trainer) == lora.base_hash(sampler)
    with pytest.raises(ValueError, match="merged adapter does not fit the model's adapter: missing"):
        lora.merge_adapter_into_base(sampler, {})


def test_base_hash_is_sha256_of_the_plain_models_parameters():
    plain = tiny_model()
    digest = hashlib.sha256()
    for name, param in sorted(plain.named_parameters(), key=lambda item: item[0]):
        digest.update(f"{name}|{param.dtype}|{list(param.shape)}|".encode())
        digest.update(param.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    model = lora_model()
    assert lora.base_hash(model) == digest.hexdigest()
    randomise_b(model)  # the adapter is not part of the base
    assert lora.base_hash(model) == digest.hexdigest()
    lora.merge_adapter_into_base(model)
    assert lora.base_hash(model) != digest.hexdigest()


def test_reset_adapter_zeroes_b_redraws_a_keeps_the_function_and_is_seeded():
    model = lora_model()
    randomise_b(model)
    lora.merge_adapter_into_base(model)
    with model.disable_adapter():
        merged_base = logits(model)
    old = lora.adapter_state(model)
    torch.manual_seed(11)
    lora.reset_adapter(model)
    fresh = lora.adapter_state(model)
    assert all(torch.all(t == 0) for k, t in fresh.items() if ".lora_B." in k)
    assert all(not torch.equal(t, old[k]) for k, t in fresh.items() if ".lora_A." in k)
    torch.testing.assert_close(logits(model), merged_base, rtol=0, atol=0)
    torch.manual_seed(11)
    torch.rand(7)  # other draws from the global RNG (a resumed run's setup) leave the fresh adapter as it was
    lora.reset_adapter(model)
    assert all(torch.equal(t, fresh[k]) for k, t in lora.adapter_state(model).items())
    lora.merge_log(model).append(old)  # the next stage's fresh adapter is another one
    lora.reset_adapter(model)
    assert all(not torch.equal(t, fresh[k]) for k, t in lora.adapter_state(model).items() if ".lora_A." in k)


def test_merged_named_tensors_are_a_plain_model_computing_the_policy():
    model = lora_model()
    randomise_b(model)
    plain = tiny_model()
    tensors = dict(lora.merged_named_tensors(model))
    assert set(tensors) == set(dict(plain.named_parameters()))
    plain.load_state_dict(tensors, strict=False)
    torch.testing.assert_close(logits(plain), logits(model), rtol=0, atol=1e-5)


def test_swap_by_merge_makes_pi_ref_the_policy_logs_the_merge_and_clears_adapter_moments():
    model = lora_model()
    randomise_b(model)
    params = lora.adapter_parameters(model)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model(input_ids=TOKENS).logits.sum().backward()
    optimizer.step()
    assert optimizer.state
    policy = logits(model)
    lora.swap_reference_by_merge(model, [optimizer])
    assert not optimizer.state
    assert len(lora.merge_log(model)) == 1
    with model.disable_adapter():
        torch.testing.assert_close(logits(model), policy, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits(model), policy, rtol=0, atol=1e-5)
    state = lora.merge_log(model).state_dict()
    restored = lora.MergeLog()
    restored.load_state_dict(state)
    assert len(restored) == 1 and all(torch.equal(t, state["entries"][0][k]) for k, t in restored.entries[0].items())
    with pytest.raises(ValueError, match="a LoRA merge log's state must be"):
        restored.load_state_dict({"entries": "x"})


def test_adapter_update_sends_the_missing_merges_and_the_hash_after_them():
    model = lora_model()
    first = lora.adapter_update(model, merges_applied=0, with_hash=True, step=3)
    assert first.merges == () and first.base_hash == lora.base_hash(model) and first.step == 3
    assert first.nbytes == sum(t.numel() * 4 for t in lora.adapter_state(model).values())
    assert lora.adapter_update(model, 0, with_hash=False).base_hash is None
    randomise_b(model)
    lora.swap_reference_by_merge(model, [])
    update = lora.adapter_update(model, merges_applied=0, with_hash=False)
    assert len(update.merges) == 1 and update.base_hash == lora.base_hash(model)
    # a sampler following the pushes ends with the trainer's base, bitwise
    sampler = lora_model(seed=9)
    for entry in update.merges:
        lora.merge_adapter_into_base(sampler, entry)
    lora.load_adapter_state(sampler, update.adapter)
    assert lora.base_hash(sampler) == update.base_hash
    torch.testing.assert_close(logits(sampler), logits(model), rtol=0, atol=0)
    assert lora.adapter_update(model, merges_applied=1, with_hash=False).merges == ()
    with pytest.raises(ValueError, match="the engine says it applied 2 merges; the policy has made 1"):
        lora.adapter_update(model, merges_applied=2, with_hash=False)


def test_stacked_adapter_on_the_starting_base_gives_the_policy_after_merges(tmp_path):
    from peft import PeftModel

    model = lora_model()
    for seed in (1, 2):  # two stage swaps, then a third adapter in training
        randomise_b(model, seed)
        lora.swap_reference_by_merge(model, [])
    randomise_b(model, 3)
    spec, tensors = lora.cumulative_adapter(model)
    assert spec["r"] == 12 and spec["alpha"] == 96.0  # rank 3 r, same scale alpha / r
    out = lora.write_adapter(spec, tensors, tmp_path / "adapter", base_model="tiny-random-llama")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(tiny_model(), str(out))
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=1e-5)
