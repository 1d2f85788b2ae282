"""The chunked head (``lit_grpo.core.chunked_head``, ``lit_grpo.math.chunked_logprobs``): log-probs, entropies and
gradients from the final hidden states a chunk of tokens at a time equal the full logits' path (``head_chunk_mb``
None, the reference) in every layout, with temperature, the entropy bonus, tied embeddings, LoRA and 16-bit
precisions; the families that post-process their logits; the module's option. Its memory bound is in
tests/test_chunked_head_memory.py."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_data, tiny_module, tiny_trainer
from test_packing import TOL, VOCAB, llama, uneven_micro_batch

from lit_grpo.core.batch import MicroBatch
from lit_grpo.core.chunked_head import (
    DEFAULT_HEAD_CHUNK_MB,
    chunked_head_unsupported,
    final_hidden,
    head_chunk_tokens,
    hidden_only,
    logit_transform,
)
from lit_grpo.core.packing import packed_completion_logprobs
from lit_grpo.core.scoring import completion_logprobs, policy_logprobs
from lit_grpo.math.chunked_logprobs import chunk_tokens_for, chunked_logprobs
from lit_grpo.math.logprobs import logprobs_and_entropy
from lit_grpo.models import tiny_llama
from lit_grpo.models.loading import checkpointing_call

LAYOUTS = ("padded", "checkpointing", "packed", "packed_tree")
#: bfloat16's rounding: 8 bits of mantissa, 2^-8 = 0.4 % relative
BF16 = dict(atol=2e-2, rtol=1.6e-2)


def budget_for(tokens: int, vocab: int = VOCAB) -> float:
    """The ``head_chunk_mb`` whose chunks hold ``tokens`` tokens of ``vocab`` float32 logits."""
    return (tokens + 0.5) * 4 * vocab / (1 << 20)


def score(model: torch.nn.Module, mb: MicroBatch, layout: str, head_chunk_mb: float | None, temperature: float = 0.7,
          entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if layout in ("packed", "packed_tree"):
        return packed_completion_logprobs(model, mb, temperature, True, entropy_grad, layout,
                                          head_chunk_mb=head_chunk_mb)
    return completion_logprobs(model, mb, temperature, True, entropy_grad, head_chunk_mb=head_chunk_mb)


def test_chunk_tokens_follow_the_budget() -> None:
    # 256 MiB of float32 logits: 268,435,456 / (4 x 151,936) = 441.7 tokens at Qwen2.5's vocabulary
    assert chunk_tokens_for(151_936, 256) == 441
    assert chunk_tokens_for(49_152, 256) == 1365
    assert chunk_tokens_for(151_936, 0.01) == 1  # never less than one token
    assert chunk_tokens_for(VOCAB, budget_for(7)) == 7
    assert head_chunk_tokens(llama("sdpa"), budget_for(7)) == 7
    assert head_chunk_tokens(llama("sdpa"), None) is None
    for bad in (0, -1.0):
        with pytest.raises(ValueError, match="> 0 MiB"):
            chunk_tokens_for(VOCAB, bad)


@pytest.mark.parametrize("chunk", [1, 7, 500])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunks_equal_the_full_logits(chunk: int, entropy_grad: bool) -> None:
    """Against the full logits' functions: values, and gradients to the hidden states and the head's weight,
    with a soft cap after the head and T = 0.7."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=gen, requires_grad=True)
    head = torch.nn.Linear(16, VOCAB, bias=False)
    tokens = torch.randint(0, VOCAB, (3, 11), generator=gen)
    weights = torch.randn(3, 11, generator=gen)
    cap = lambda logits: torch.tanh(logits / 0.3) * 0.3  # noqa: E731 (non-linear at these logits)
    results = []
    for chunked in (False, True):
        if chunked:
            logp, entropy = chunked_logprobs(hidden, tokens, head, 0.7, chunk, True, entropy_grad, transform=cap)
        else:
            logp, entropy = logprobs_and_entropy(cap(head(hidden)), tokens, 0.7, True, entropy_grad)
        loss = (weights * logp).sum() + (weights * entropy).sum()
        loss.backward()
        results.append((logp.detach(), entropy.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad, head.weight.grad = None, None
    assert results[1][0].dtype == torch.float32 and results[1][0].shape == tokens.shape
    for full, chunked in zip(*results, strict=True):
        torch.testing.assert_close(chunked, full, atol=TOL, rtol=0)
    assert results[1][3].abs().sum() > 0  # the head's weight got a gradient through the recomputed chunks


def test_an_empty_input_gives_empty_outputs() -> None:
    logp, entropy = chunked_logprobs(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long), torch.nn.Linear(8, 5),
                                     1.0, 4, with_entropy=True)
    assert logp.shape == entropy.shape == (0,) and logp.dtype == torch.float32


def layout_model(layout: str) -> torch.nn.Module:
    model = llama("sdpa").train()
    if layout == "checkpointing":  # the cacheless path: each row one forward over prompt + completion
        checkpointing_call(model, "enable")()
    return model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_no_grad_scoring_equals_the_full_logits_in_every_layout(layout: str) -> None:
    model = layout_model(layout)
    mb = uneven_micro_batch(seed=1)
    real = mb.completion_mask.bool()
    with torch.no_grad():
        full, full_entropy = score(model, mb, layout, None)
        chunked, chunked_entropy = score(model, mb, layout, budget_for(7))
    assert int(real.sum()) > 7  # several chunks
    torch.testing.assert_close(chunked[real], full[real], atol=TOL, rtol=0)
    torch.testing.assert_close(chunked_entropy[real], full_entropy[real], atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_gradients_equal_the_full_logits_in_every_layout(layout: str, entropy_grad: bool) -> None:
    """The loss of an update with an entropy bonus (``entropy_grad``: its gradient flows through the chunks'
    recomputed logits), at T = 0.7: the same value and parameter gradients (1e-5, float32)."""
    mb = uneven_micro_batch(seed=2, multi_turn=True)
    weights = torch.randn(mb.completion_ids.shape, generator=torch.Generator().manual_seed(3))
    mask = mb.loss_mask.float()
    values, grads = [], []
    for budget in (None, budget_for(7)):
        model = layout_model(layout)
        logp, entropy = score(model, mb, layout, budget, entropy_grad=entropy_grad)
        assert entropy.requires_grad == entropy_grad
        bonus = (entropy * mask).sum() / mask.sum()
        loss = (weights * logp * mask).sum() / mask.sum() - 0.1 * bonus
        loss.backward()
        values.append(torch.stack([loss.detach(), bonus.detach()]))
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    torch.testing.assert_close(values[1], values[0], atol=TOL, rtol=0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=TOL, rtol=0, msg=name)
    assert grads[1]["lm_head.weight"].abs().sum() > 0


def test_the_entropy_bonus_gradient_is_the_entropy_s_own() -> None:
    """The bonus alone (no log-prob term): its gradient through the chunks is the full logits' one, and not 0."""
    mb = uneven_micro_batch(seed=3)
    mask = mb.completion_mask.float()
    grads = []
    for budget in (None, budget_for(5)):
        model = layout_model("padded")
        _, entropy = score(model, mb, "padded", budget, temperature=1.3, entropy_grad=True)
        ((entropy * mask).sum() / mask.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[1].abs().max() > 1e-4
    torch.testing.assert_close(grads[1], grads[0], atol=TOL, rtol=0)


def tied_llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    config = tiny_llama(VOCAB).config
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().train()


def test_tied_embeddings_get_both_gradients() -> None:
    """With tied embeddings the head's weight is the input embedding: its gradient sums the head's chunks and the
    embedding lookup, as with the full logits."""
    mb = uneven_micro_batch(seed=4)
    grads = []
    for budget in (None, budget_for(6)):
        model = tied_llama()
        assert model.lm_head.weight is model.model.embed_tokens.weight
        logp, _ = completion_logprobs(model, mb, 0.9, head_chunk_mb=budget)
        (logp * mb.completion_mask).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_adapters_get_the_same_gradient(dropout: float) -> None:
    """A LoRA policy (the head not adapted: its base's output embeddings), through ``policy_logprobs``: with
    adapter dropout the values come from a dropout-free pass and the gradient from the pass with dropout, both
    chunked."""
    from lit_grpo.models.lora import LoraArgs, apply_lora

    mb = uneven_micro_batch(seed=5)
    results = []
    for budget in (None, budget_for(6)):
        torch.manual_seed(0)
        model = apply_lora(tiny_llama(VOCAB).float(), LoraArgs(r=4, alpha=8, dropout=dropout)).train()
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init would leave A without a gradient
                torch.nn.init.normal_(p, std=0.1)
        torch.manual_seed(1)  # the same dropout masks in both passes
        logp, _ = policy_logprobs(model, mb, 1.0, head_chunk_mb=budget)
        (logp * mb.completion_mask).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    real = mb.completion_mask.bool()
    torch.testing.assert_close(results[1][0][real], results[0][0][real], atol=TOL, rtol=0)
    assert results[0][1] and all("lora" in name for name in results[0][1])
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("layout", ["padded", "packed_tree"])
def test_bfloat16_weights_score_within_bfloat16_rounding(layout: str) -> None:
    """bfloat16 weights (a server's or an engine's copy scoring alpha or pi_ref; training refuses them,
    ``lit_grpo.training.precision``): the head's matmul in bfloat16, every normaliser in float32."""
    model = llama("sdpa").to(torch.bfloat16).eval()
    mb = uneven_micro_batch(seed=6)
    real = mb.completion_mask.bool()
    with torch.no_grad():
        full, full_entropy = score(model, mb, layout, None, temperature=0.8)
        chunked, chunked_entropy = score(model, mb, layout, budget_for(7), temperature=0.8)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked[real], full[real], **BF16)
    torch.testing.assert_close(chunked_entropy[real], full_entropy[real], **BF16)


@pytest.mark.parametrize("layout", ["padded", "packed_tree"])
def test_bf16_mixed_agrees_within_bfloat16_rounding(layout: str) -> None:
    """float32 weights under bfloat16 autocast (Lightning's ``bf16-mixed`` on a CPU): values within bfloat16's
    rounding of the full logits', and every weight's gradient (float32, the chunks' shares summed in float32)
    within 4 roundings in norm: the full logits' own bfloat16 gradients are 0.5 to 1 % from float32's here, and
    near-zero elements make an elementwise bound meaningless."""
    mb = uneven_micro_batch(seed=6)
    real = mb.completion_mask.bool()
    results = []
    for budget in (None, budget_for(7)):
        model = llama("sdpa").train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, entropy = score(model, mb, layout, budget, temperature=0.8, entropy_grad=True)
            ((logp + 0.1 * entropy) * real).sum().backward()
        results.append((logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert results[1][0].dtype == torch.float32
    torch.testing.assert_close(results[1][0][real], results[0][0][real], **BF16)
    torch.testing.assert_close(results[1][1][real], results[0][1][real], **BF16)
    for name, grad in results[0][2].items():
        assert results[1][2][name].dtype == torch.float32
        relative = ((results[1][2][name] - grad).norm() / grad.norm()).item()
        assert relative <= 4 * 2 ** -8, f"{name}: {relative}"


# ---- families: the final hidden state is the head's input, and what the model does after its head ----------------

def family_model(name: str) -> torch.nn.Module:
    """A 2-layer model of family ``name`` from a config (random weights), with its post-head transform made large
    enough to matter: Granite's ``logits_scaling``, Cohere's ``logit_scale``, Gemma 2's soft cap."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    configs = {
        "llama": lambda: tf.LlamaConfig(**common),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=8),
        "mistral": lambda: tf.MistralConfig(**common, sliding_window=None),
        "gemma": lambda: tf.GemmaConfig(**common, head_dim=8),
        "gemma2": lambda: tf.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.2, sliding_window=128),
        "granite": lambda: tf.GraniteConfig(**common, logits_scaling=0.25),
        "cohere": lambda: tf.CohereConfig(**common, logit_scale=4.0),
        "gpt2": lambda: tf.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=32, n_layer=2, n_head=2),
    }
    config = configs[name]()
    config._attn_implementation = "eager" if name == "gemma2" else "sdpa"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).float().eval()


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "granite", "cohere", "gpt2")


@pytest.mark.parametrize("name", FAMILIES)
def test_the_last_hidden_state_is_the_head_s_input(name: str) -> None:
    """transformers 5.24: ``hidden_states[-1]`` of a forward with ``output_hidden_states=[-1]`` is what the model
    feeds its head (after the final norm), and the model's logits are the head's output after the family's
    transform."""
    model = family_model(name)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        logits = model(input_ids=ids, logits_to_keep=4).logits
        out = model(input_ids=ids, **hidden_only(ids.device))
    hook.remove()
    assert chunked_head_unsupported(model) is None
    assert out.logits.shape[1] == 0  # the head ran on no position
    torch.testing.assert_close(final_hidden(out)[:, -4:], seen[0], atol=0, rtol=0)
    full, _ = logprobs_and_entropy(logits, ids[:, -4:])
    with torch.no_grad():
        chunked, _ = chunked_logprobs(final_hidden(out)[:, -4:], ids[:, -4:], model.get_output_embeddings(), 1.0, 3,
                                      transform=logit_transform(model.config))
    torch.testing.assert_close(chunked, full, atol=TOL, rtol=0)
    if name in ("gemma2", "granite", "cohere"):  # the transform matters: without it the numbers differ
        plain, _ = logprobs_and_entropy(model.get_output_embeddings()(seen[0]), ids[:, -4:])
        assert (plain - full).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere"])
def test_families_with_a_transform_score_in_chunks(name: str) -> None:
    model = family_model(name)
    mb = uneven_micro_batch(seed=7)
    real = mb.completion_mask.bool()
    with torch.no_grad():
        full, full_entropy = completion_logprobs(model, mb, 0.7, with_entropy=True, head_chunk_mb=None)
        chunked, chunked_entropy = completion_logprobs(model, mb, 0.7, with_entropy=True,
                                                       head_chunk_mb=budget_for(5))
    torch.testing.assert_close(chunked[real], full[real], atol=TOL, rtol=0)
    torch.testing.assert_close(chunked_entropy[real], full_entropy[real], atol=TOL, rtol=0)


def test_a_family_it_does_not_handle_is_refused_in_one_line_and_scored_whole() -> None:
    """A config with a post-head setting the chunked head does not know (Falcon-H1's ``lm_head_multiplier``): one
    line naming it; the scoring functions then take the full logits (the engines' and the server's defaults)."""
    model = llama("sdpa").eval()
    model.config.lm_head_multiplier = 2.0
    why = chunked_head_unsupported(model)
    assert why is not None and "\n" not in why and "lm_head_multiplier=2.0" in why
    assert head_chunk_tokens(model, DEFAULT_HEAD_CHUNK_MB) is None


def test_the_module_refuses_a_bad_budget_and_an_unhandled_family(monkeypatch: pytest.MonkeyPatch) -> None:
    import lit_grpo.training.module as module

    def tiny_with_multiplier(name: str, dtype: str, attn_implementation=None) -> tuple[torch.nn.Module, object]:
        model = tiny_llama(VOCAB).float()
        model.config.lm_head_multiplier = 2.0
        return model, None

    for bad in (0, -3.0, float("nan")):
        with pytest.raises(ValueError, match=r"head_chunk_mb must be a finite number of MiB > 0 \(null: the full"):
            tiny_module(head_chunk_mb=bad)
    monkeypatch.setattr(module, "load_model_and_tokenizer", tiny_with_multiplier)
    with pytest.raises(ValueError, match=r"model.head_chunk_mb: .*lm_head_multiplier.*head_chunk_mb: null") as err:
        tiny_module()
    assert "\n" not in str(err.value)
    assert tiny_module(head_chunk_mb=None).scoring["head_chunk_mb"] is None  # off: the full logits, accepted


# ---- the module: a fit with chunks equals one with the full logits -----------------------------------------------

@pytest.mark.parametrize("layout", ["padded", "checkpointing", "packed"])
def test_a_fit_in_chunks_equals_one_with_the_full_logits(tmp_path, monkeypatch, layout: str) -> None:
    """Two steps with pi_ref (beta), T = 0.8, the entropy bonus and the top-entropy mask, and the TV monitor's pass:
    every scoring pass of the module (policy, pi_ref, the monitor) in chunks of 5 tokens of the tiny model's
    100-token vocabulary, against the full logits: the same logged metrics and updated weights."""
    from conftest import MetricsRecorder
    from lit_grpo.callbacks import WeightSync

    import lit_grpo.core.chunked_head as chunked_head
    from lit_grpo.math.entropy_terms import EntropyOptions

    chunked_passes = []
    counted = lambda *args, **kwargs: chunked_passes.append(args[4]) or chunked_logprobs(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(chunked_head, "chunked_logprobs", counted)
    runs = []
    for budget in (None, budget_for(5, 100)):
        torch.manual_seed(0)
        module = tiny_module(beta=0.1, temperature=0.8, head_chunk_mb=budget, packing=layout == "packed",
                             gradient_checkpointing=layout == "checkpointing",
                             entropy=EntropyOptions(coef=0.05, top_entropy_quantile=0.5))
        recorder = MetricsRecorder()
        tiny_trainer(tmp_path / str(budget), 2, callbacks=[WeightSync(), recorder]).fit(
            module, datamodule=tiny_data(temperature=0.8))
        runs.append((recorder.steps, {k: v.detach().clone() for k, v in module.policy.state_dict().items()}))
    (steps, weights), (chunked_steps, chunked_weights) = runs
    # every pass of the chunked fit, none of the other: per step pi_ref's, the policy's, the monitor's per micro-batch
    assert len(chunked_passes) >= 2 * 3 and set(chunked_passes) == {5}
    for a, b in zip(steps, chunked_steps, strict=True):
        for key in ("train/loss", "train/kl", "train/entropy", "train/grad_norm", "train/ratio_mean"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
    worst = max((chunked_weights[k] - weights[k]).abs().max().item() for k in weights)
    assert worst <= 1e-5, f"updated weights differ by {worst}"
