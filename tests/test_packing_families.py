"""Packing is right on every decoder family it accepts: for each family transformers ships, a tiny random model of
it scores one micro-batch in every layout the project would run for it (padded; ``"packed"`` where
``packing_supported`` accepts the model; ``"packed_tree"`` where ``tree_supported`` accepts it too), and each
layout's log-probs (and, for a few families, their gradients) are compared with a reference computed apart from
the project: each row run alone, unpadded, at the model's default positions. A family whose packing is wrong is
refused in one line, and the test asserts both the refusal and that the refused layout really is wrong, so
removing the refusal fails it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from torch import nn

from lit_grpo.core.batch import MicroBatch, left_pad, micro_batch_views
from lit_grpo.core.packing import packed_completion_logprobs, packing_supported
from lit_grpo.core.prefix_tree import tree_supported
from lit_grpo.core.scoring import completion_logprobs

VOCAB = 96
TOL = 1e-5  # float32, as tests/test_packing.py
# the tiny shape every Llama-like config takes; initializer_range 0.2 (not the default 0.02, at which the logits are
# nearly uniform and sequences leaking into one another would move the log-probs little) spreads the logits
LLAMA_LIKE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
                  initializer_range=0.2)
#: a window shorter than the rows (prompt 6 + completion 7), so that the sliding-window layers cut
WINDOW = 4


@dataclasses.dataclass(frozen=True)
class Family:
    module: str  # transformers.models.<module>
    config: str  # its config class
    options: dict[str, object]
    attns: tuple[str, ...] = ("sdpa", "eager")
    tree: bool = True  # tree_supported accepts it (False: sliding windows, which only the copies layout keeps)
    refused: str | None = None  # a substring of packing_supported's refusal, for a family packing gets wrong


FAMILIES = {
    "llama": Family("llama", "LlamaConfig", LLAMA_LIKE),
    "qwen2": Family("qwen2", "Qwen2Config", LLAMA_LIKE),
    "qwen3": Family("qwen3", "Qwen3Config", dict(LLAMA_LIKE, head_dim=8)),
    "mistral": Family("mistral", "MistralConfig", dict(LLAMA_LIKE, sliding_window=WINDOW)),
    # one full and one sliding layer: the tree passes a mask per layer kind
    "qwen2_sliding": Family("qwen2", "Qwen2Config", dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=WINDOW,
                                                         max_window_layers=1)),
    "phi3": Family("phi3", "Phi3Config", LLAMA_LIKE),
    "gemma": Family("gemma", "GemmaConfig", dict(LLAMA_LIKE, head_dim=8)),
    # transformers 5.24 has no sdpa path for Gemma 2 (its attention soft-capping): eager only
    "gemma2": Family("gemma2", "Gemma2Config", dict(LLAMA_LIKE, head_dim=8, sliding_window=WINDOW),
                     attns=("eager",)),
    "olmo2": Family("olmo2", "Olmo2Config", LLAMA_LIKE),
    "granite": Family("granite", "GraniteConfig", LLAMA_LIKE),
    "gpt2": Family("gpt2", "GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                              initializer_range=0.2)),
    "gpt_neox": Family("gpt_neox", "GPTNeoXConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, max_position_embeddings=128,
                                                         initializer_range=0.2)),
    "stablelm": Family("stablelm", "StableLmConfig", LLAMA_LIKE),
    "falcon": Family("falcon", "FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    initializer_range=0.2)),
    "qwen2_moe": Family("qwen2_moe", "Qwen2MoeConfig", dict(LLAMA_LIKE, moe_intermediate_size=32, num_experts=4,
                                                            num_experts_per_tok=2,
                                                            shared_expert_intermediate_size=32)),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeConfig", dict(LLAMA_LIKE, head_dim=8, moe_intermediate_size=32,
                                                            num_experts=4, num_experts_per_tok=2)),
    "phi": Family("phi", "PhiConfig", LLAMA_LIKE),
    "cohere": Family("cohere", "CohereConfig", LLAMA_LIKE),
    # their decoders call create_causal_mask without position ids, so nothing separates the copies layout's
    # sequences under sdpa, eager or flex attention (their learned positions are read from the position ids given);
    # XGLM and GPT-OSS have no sdpa path in transformers 5.24: eager only
    "opt": Family("opt", "OPTConfig", dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                           max_position_embeddings=128, word_embed_proj_dim=32, init_std=0.2),
                  refused="OPTDecoder.forward builds its mask without them"),
    "biogpt": Family("biogpt", "BioGptConfig", dict(LLAMA_LIKE, num_key_value_heads=None),
                     refused="BioGptModel.forward builds its mask without them"),
    "xglm": Family("xglm", "XGLMConfig", dict(d_model=32, ffn_dim=64, num_layers=2, attention_heads=4,
                                              max_position_embeddings=128, init_std=0.2),
                   attns=("eager",), refused="XGLMModel.forward builds its mask without them"),
    "gpt_oss": Family("gpt_oss", "GptOssConfig", dict(LLAMA_LIKE, head_dim=8, num_local_experts=4,
                                                      num_experts_per_tok=2, sliding_window=WINDOW),
                      attns=("eager",), tree=False, refused="GptOssModel.forward builds its mask without them"),
}
CASES = [(name, attn) for name, family in FAMILIES.items() for attn in family.attns]


def build(name: str, attn: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny random model of ``FAMILIES[name]`` with attention ``attn``, in eval mode (no dropout), built from its
    config alone (nothing downloaded)."""
    family = FAMILIES[name]
    pytest.importorskip(f"transformers.models.{family.module}.modeling_{family.module}",
                        reason=f"transformers {transformers.__version__} does not ship {family.module}")
    if not hasattr(transformers, family.config):
        pytest.skip(f"transformers {transformers.__version__} has no {family.config}")
    options = {key: value for key, value in family.options.items() if value is not None}
    # special tokens inside the tiny vocabulary (the defaults of some configs lie beyond it); the rows never use them
    config = getattr(transformers, family.config)(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                 **options)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    assert model.config._attn_implementation == attn
    return model.eval()


def micro_batch() -> MicroBatch:
    """Two prompts of 6 and 3 real tokens (left-padded), three completions each of different lengths (right-padded,
    one of a single token), as ``RolloutBatch.micro_batches`` lays them out."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (length,), generator=gen).tolist() for length in (6, 3)]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0, device=torch.device("cpu"))
    lengths = torch.tensor([5, 2, 7, 1, 4, 6])
    completion_mask = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, VOCAB, completion_mask.shape, generator=gen) * completion_mask
    group_index = torch.tensor([0, 0, 0, 1, 1, 1])
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, group_index, completion_ids, completion_mask, len(lengths))
    return mb


def per_row_reference(model: nn.Module, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """``[s, C']`` log-probs of each real completion token (0 elsewhere) from one forward per row over exactly its
    ``prompt_real + completion[:-1]``: batch 1, no padding, no mask, the model's default positions. Nothing of the
    project's scoring is used, so a shared mistake cannot hide."""
    rows = []
    for row in range(mb.completion_ids.shape[0]):
        prompt_row = mb.prompt_index[row]
        prompt = mb.prompt_ids[prompt_row][mb.prompt_mask[prompt_row].bool()]
        completion = mb.completion_ids[row][mb.completion_mask[row].bool()]
        logits = model(input_ids=torch.cat([prompt, completion[:-1]])[None]).logits[0, prompt.numel() - 1:]
        logp = torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, completion[:, None])[:, 0]
        rows.append(nn.functional.pad(logp, (0, mb.completion_ids.shape[1] - completion.numel())))
    return torch.stack(rows)


def layouts_run(model: nn.Module) -> list[str]:
    """The layouts the project would run ``model`` in: padded always; packed where it packs at all; the tree where
    its attention takes one."""
    if packing_supported(model) is not None:
        return ["padded"]
    return ["padded", "packed"] + (["packed_tree"] if tree_supported(model.config, model) is None else [])


def layout_logprobs(model: nn.Module, mb: MicroBatch, temperature: float, layout: str) -> torch.Tensor:
    if layout == "padded":
        return completion_logprobs(model, mb, temperature)[0]
    return packed_completion_logprobs(model, mb, temperature, layout=layout)[0]


def max_difference(values: torch.Tensor, reference: torch.Tensor, mb: MicroBatch) -> float:
    real = mb.completion_mask.bool()
    return float((values[real] - reference[real]).abs().max())


@pytest.mark.parametrize(("name", "attn"), CASES)
def test_every_layout_run_matches_the_per_row_reference(name: str, attn: str) -> None:
    family = FAMILIES[name]
    model = build(name, attn)
    mb = micro_batch()
    with torch.no_grad():
        reference = per_row_reference(model, mb, 1.0)
        layouts = layouts_run(model)
        for layout in layouts:
            difference = max_difference(layout_logprobs(model, mb, 1.0, layout), reference, mb)
            assert difference <= TOL, f"{name} ({attn}), {layout}: {difference:.1e}"
    reason = packing_supported(model)
    if family.refused is None:
        assert layouts == ["padded", "packed"] + (["packed_tree"] if family.tree else []), reason
        return
    # refused in one line naming the model and why; and the refusal is earned: the copies layout is wrong
    assert reason is not None and "\n" not in reason, f"{name} ({attn}) packs, but its copies layout is wrong"
    assert type(model).__name__ in reason and family.refused in reason, reason
    with torch.no_grad():
        wrong = max_difference(layout_logprobs(model, mb, 1.0, "packed"), reference, mb)
    assert wrong > 1e-2, f"{name} ({attn}) is refused, but its copies layout is off by {wrong:.1e} only"


@pytest.mark.parametrize("name", ["llama", "gpt2", "mistral", "falcon"])
def test_temperature_is_applied_alike(name: str) -> None:
    model = build(name, "sdpa")
    mb = micro_batch()
    with torch.no_grad():
        reference = per_row_reference(model, mb, 0.7)
        assert max_difference(reference, per_row_reference(model, mb, 1.0), mb) > 1e-2  # the temperature matters
        for layout in layouts_run(model):
            difference = max_difference(layout_logprobs(model, mb, 0.7, layout), reference, mb)
            assert difference <= TOL, f"{name}, {layout}: {difference:.1e}"


@pytest.mark.parametrize(("name", "attn"), [("llama", "sdpa"), ("gpt2", "eager"), ("mistral", "sdpa"),
                                            ("gpt_neox", "sdpa"), ("gemma2", "eager")])
def test_gradient_matches_the_per_row_reference(name: str, attn: str) -> None:
    """The gradient of ``sum(logp)`` over the real completion tokens w.r.t. every parameter, in each packed layout
    the model runs, against the per-row reference's, within ``TOL`` relative to the largest gradient entry: the
    sum's entries reach about 10, where float32 rounding alone differs by up to 1e-5 between two orders of
    summation (8e-6 between the padded path and the reference, which compute the same thing). A layout that mixes
    sequences is off by order 1 (OPT's copies: 7.8 on its position embedding)."""
    mb = micro_batch()
    real = mb.completion_mask.bool()

    def gradients(layout: str | None) -> dict[str, torch.Tensor]:
        model = build(name, attn)  # the same seed: the same weights, fresh gradients
        logp = per_row_reference(model, mb, 1.0) if layout is None else layout_logprobs(model, mb, 1.0, layout)
        logp[real].sum().backward()
        return {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}

    reference = gradients(None)
    scale = max(float(g.abs().max()) for g in reference.values())
    assert scale > 0
    packed_layouts = layouts_run(build(name, attn))[1:]
    assert packed_layouts, f"{name} ({attn}) does not pack"
    for layout in packed_layouts:
        grads = gradients(layout)
        assert grads.keys() == reference.keys()
        for key, grad in reference.items():
            torch.testing.assert_close(grads[key], grad, atol=TOL * scale, rtol=0,
                                       msg=f"{name} ({attn}), {layout}: {key}")


def test_the_refusal_depends_on_the_attention_that_needs_the_mask() -> None:
    """Under flash attention the packed sequences are kept apart in the attention call, by the segments the layers
    are handed (``lit_grpo.core.tree_flash``), not by the mask: OPT's mask without position ids is no reason to
    refuse it there (run through a CPU stand-in for the kernel in tests/test_tree_flash.py)."""
    model = build("opt", "sdpa")
    for attn in ("sdpa", "eager", "flex_attention"):
        model.config._attn_implementation = attn
        reason = packing_supported(model)
        assert reason is not None and attn in reason, attn
    model.config._attn_implementation = "flash_attention_2"
    assert packing_supported(model) is None


@pytest.mark.parametrize(("name", "attn"), [("mistral", "sdpa"), ("qwen2_sliding", "sdpa"), ("gemma2", "eager")])
def test_the_trees_window_is_what_keeps_sliding_layers_right(name: str, attn: str, monkeypatch) -> None:  # noqa: ANN001
    """The sliding-window families pass through the tree only with its window: without it their long rows see past
    it (measured 0.5 to 1.8 off here)."""
    import lit_grpo.core.prefix_tree as prefix_tree

    model, mb = build(name, attn), micro_batch()
    with torch.no_grad():
        reference = per_row_reference(model, mb, 1.0)
        monkeypatch.setattr(prefix_tree, "tree_windows", lambda config, model=None: None)
        windowless = layout_logprobs(model, mb, 1.0, "packed_tree")
    assert max_difference(windowless, reference, mb) > 1e-2
