"""`model.gradient_checkpointing: true` and `selective` compute the same update as without it, selective keeps
less than no checkpointing and more than full, and a fit runs with it."""

import pytest
import torch
from conftest import recorded_steps, tiny_data, tiny_module
from handmade import handmade_batch, loss_and_grads, perturb
from torch.utils.checkpoint import CheckpointPolicy
from transformers import AutoConfig, AutoModelForCausalLM

from lit_grpo.core.peak_memory import PeakLiveBytes
from lit_grpo.core.scoring import checkpointing_drops_cache, completion_logprobs
from lit_grpo.models.checkpointing import SAVED_OPERATORS, check_checkpointing, enable_checkpointing, keep_products


def test_checkpointing_gives_the_same_loss_and_gradients():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0]]
    results = {}
    for checkpointing in (False, True):
        module = tiny_module(gradient_checkpointing=checkpointing, beta=0.1)  # same seeded weights both times
        perturb(module.reference)  # KL > 0, so the reference's log-probs count in the loss
        # float64: the paths sum the shared prompt's gradient in different orders, which in float32 alone moves
        # gradients by ~5e-7 relative; transformers' RMSNorm still works in float32, leaving ~1e-7
        module.policy.double()
        module.reference.double()
        # the policy takes the cacheless path only when checkpointing; the frozen reference never checkpoints
        assert checkpointing_drops_cache(module.policy) == checkpointing
        assert not checkpointing_drops_cache(module.reference)
        batch = handmade_batch(rewards, len(module.tokenizer), micro_batch_size=8)  # micro-batches span groups
        results[checkpointing] = loss_and_grads(module, batch, module.loss_weights(batch))
    (loss, grads), (ckpt_loss, ckpt_grads) = results[False], results[True]
    assert loss != 0.0
    assert abs(ckpt_loss - loss) <= 1e-6 * abs(loss)
    assert any(g.abs().max() > 0 for g in grads.values())
    for name, g in grads.items():
        assert float((ckpt_grads[name] - g).abs().max()) <= 1e-6 * float(g.abs().max()) + 1e-12, name


def test_fit_with_checkpointing_matches_fit_without(tmp_path):
    steps = {checkpointing: recorded_steps(tmp_path / str(checkpointing), tiny_module(
        gradient_checkpointing=checkpointing, beta=0.1, lr=1e-2), tiny_data(), max_steps=2)
        for checkpointing in (False, True, "selective")}
    for mode in (True, "selective"):
        assert len(steps[mode]) == 2
        # same rollouts (the engine samples in eval mode either way), same loss at the first step
        first, ckpt_first = steps[False][0], steps[mode][0]
        for key in ("train/loss", "train/entropy", "rollout/reward_mean"):
            assert abs(ckpt_first[key] - first[key]) <= 1e-6 * max(1.0, abs(first[key])), (mode, key)


# ---- selective checkpointing (`model.gradient_checkpointing: selective`) ------------------------------------------


# tiny members of several families: Llama's RMSNorm and SwiGLU, Qwen3's per-head q/k norms, Gemma's scaled
# embeddings and GeGLU, Phi-3's fused projections, GPT-NeoX's parallel residual, GPT-2's Conv1D (addmm) layers, OPT's
# learned positions and ReLU
FAMILIES = {
    "llama": dict(model_type="llama", num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16),
    "gemma": dict(model_type="gemma", num_key_value_heads=2, head_dim=16),
    "phi3": dict(model_type="phi3", num_key_value_heads=2, pad_token_id=0),
    "gpt_neox": dict(model_type="gpt_neox"),
    "gpt2": dict(model_type="gpt2", n_inner=160),
    "opt": dict(model_type="opt", ffn_dim=160, word_embed_proj_dim=64),
}


def _family_model(family: str, dtype: torch.dtype, mode: object) -> torch.nn.Module:
    options = dict(FAMILIES[family])
    config = AutoConfig.for_model(options.pop("model_type"), hidden_size=64, intermediate_size=160,
                                  num_attention_heads=4, num_hidden_layers=2, vocab_size=96, **options)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    enable_checkpointing(model, mode)
    return model


def _forward_backward(model: torch.nn.Module, tokens: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """Logits, gradients, and the bytes the forward left alive for the backward."""
    ids = torch.randint(0, 96, (2, tokens), generator=torch.Generator().manual_seed(1))
    with PeakLiveBytes() as meter:
        hidden = model.base_model(input_ids=ids).last_hidden_state
        kept = meter.live
        logits = model.get_output_embeddings()(hidden)
        torch.log_softmax(logits.float(), -1)[..., :7].sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, kept


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_checkpointing_computes_the_same_numbers_and_keeps_less(family, dtype):
    results = {mode: _forward_backward(_family_model(family, dtype, mode), tokens=96)
               for mode in (False, True, "selective")}
    logits, grads, kept = results[False]
    assert len(grads) == len(list(_family_model(family, dtype, False).parameters()))
    for mode in (True, "selective"):
        # the recomputed operations are the same kernels on the same inputs: the same bits, in every precision
        assert torch.equal(results[mode][0], logits), mode
        for name, grad in grads.items():
            assert torch.equal(results[mode][1][name], grad), (mode, name)
    # selective keeps the products' outputs (more than the layers' inputs alone) and drops the elementwise ones
    assert results[True][2] < results["selective"][2] < 0.8 * kept, {m: r[2] for m, r in results.items()}


def test_the_policy_keeps_products_and_attention_and_recomputes_the_rest():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert op in SAVED_OPERATORS and keep_products(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (aten.silu.default, aten.mul.Tensor, aten.rsqrt.default, aten.add.Tensor, aten._to_copy.default):
        assert keep_products(None, op) == CheckpointPolicy.PREFER_RECOMPUTE
    # flash-attn's kernels (a GPU's flash_attention_2) by their namespace, as torch.library registers them
    library = torch.library.Library("flash_attn", "FRAGMENT")  # noqa: F841 (kept alive: it owns the definition)
    library.define("probe_forward(Tensor q) -> Tensor")
    assert torch.ops.flash_attn.probe_forward.default.namespace == "flash_attn"
    assert keep_products(None, torch.ops.flash_attn.probe_forward.default) == CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize("value", ["sometimes", 1, 0.5, None])
def test_a_bad_checkpointing_value_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=r"model.gradient_checkpointing=.*expected false, true .* or 'selective'"):
        check_checkpointing(value)


@pytest.mark.parametrize("packed", [False, True])
def test_selective_checkpointing_scores_every_layout_as_without_it(packed):
    """The module's own scoring: padded (the prompt's KV cache shared without checkpointing) and the prefix tree."""
    results = {}
    for mode in (False, "selective"):
        module = tiny_module(gradient_checkpointing=mode, packing=packed)
        module.policy.double()  # float64: see the first test
        assert checkpointing_drops_cache(module.policy) == bool(mode)
        batch = handmade_batch([[1.0, 0.0, 0.0, 1.0], [0.0, 0.5, 1.0, 0.0]], len(module.tokenizer),
                               micro_batch_size=8)
        module.policy.zero_grad(set_to_none=True)
        for mb in batch.micro_batches():
            logp, _ = completion_logprobs(module.policy, mb, 0.7, packed=packed)
            (logp * mb.completion_mask).sum().backward()
        results[mode] = {n: p.grad.clone() for n, p in module.policy.named_parameters() if p.grad is not None}
    grads, sac_grads = results[False], results["selective"]
    assert grads.keys() == sac_grads.keys() and len(grads) > 0
    # padded: the prompt computed once (a shared cache) against once per row, which transformers' float32 RMSNorm
    # leaves ~1e-7 apart (as in the first test); the tree has no cache either way: the same bits
    tolerance = 0.0 if packed else 1e-6
    for name, g in grads.items():
        assert float((sac_grads[name] - g).abs().max()) <= tolerance * float(g.abs().max()), name


def test_the_command_line_takes_selective_and_refuses_other_words(tmp_path, monkeypatch, capsys):
    import sys

    import yaml
    from cli_runner import refusal_line

    from lit_grpo.cli.commands import main

    monkeypatch.setattr(sys, "argv", ["lit_grpo"])  # LightningCLI reads sys.argv too
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model.model_name", "tiny-random-llama", "--model.gradient_checkpointing", "selective",
              "--print_config"])
    assert exit_.value.code == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["gradient_checkpointing"] == "selective"
    line = refusal_line(["fit", "--model.model_name", "tiny-random-llama", "--model.gradient_checkpointing",
                         "sometimes"], tmp_path, monkeypatch, capsys)
    assert "model.gradient_checkpointing" in line and "sometimes" in line, line


def test_selective_checkpointing_under_bf16_autocast_gives_the_same_gradients():
    """bf16-mixed (float32 weights, autocast): the recompute runs under the forward's autocast state, so the casts
    and the elementwise operations give the same values again."""
    results = {}
    for mode in (False, "selective"):
        model = _family_model("llama", torch.float32, mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[mode] = _forward_backward(model, tokens=96)
    (logits, grads, kept), (sac_logits, sac_grads, sac_kept) = results[False], results["selective"]
    assert logits.dtype == torch.bfloat16 and torch.equal(sac_logits, logits)
    for name, grad in grads.items():
        assert torch.equal(sac_grads[name], grad), name
    assert sac_kept < 0.8 * kept
