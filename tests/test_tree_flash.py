"""The prefix tree under flash attention (``lit_grpo.core.tree_flash``): its segments see exactly the tree's rule, and
through transformers' own flash path (with the float32 varlen reference of ``tests/flash_reference.py`` as the
kernel, since flash-attn needs a GPU) every family's log-probs and gradients match each row run alone."""

from __future__ import annotations

import pytest
import torch
from flash_reference import serve_flash_on_cpu, varlen_reference
from test_packing_families import FAMILIES, TOL, build, max_difference, micro_batch, per_row_reference
from test_prefix_tree import shared_turns_micro_batch

from lit_grpo.core.packing import packed_completion_logprobs, packed_layout_kind, packing_supported
from lit_grpo.core.prefix_tree import tree_layout, tree_supported
from lit_grpo.core.tree_attention import tree_attention_mask
from lit_grpo.core.tree_flash import (
    TREE_SUFFIX,
    route_tree_flash,
    tree_flash_attention,
    tree_forward_guard,
    tree_segments,
)
from lit_grpo.models.checkpointing import enable_checkpointing


@pytest.fixture
def flash_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """transformers' flash kernels served by the CPU stand-in; each varlen call's counts."""
    return serve_flash_on_cpu(monkeypatch)


def as_flash(model: torch.nn.Module, kernel: str = "flash_attention_2") -> torch.nn.Module:
    """``model`` (built with sdpa or eager: a CPU cannot load flash-attn) switched to a flash kernel's name, which the
    ``flash_calls`` fixture serves."""
    model.config._attn_implementation = kernel
    return model


@pytest.mark.parametrize("which", ["shared_turns", "families"])
def test_each_segment_sees_exactly_the_trees_rule(which: str) -> None:
    """Segment by segment, bottom-right causal attention over its gathered keys lets each node see exactly the
    nodes the dense rule allows it: its ancestors and itself."""
    layout = tree_layout(shared_turns_micro_batch() if which == "shared_turns" else micro_batch())
    rule = tree_attention_mask(layout.subtree_end)
    segments = tree_segments(layout.subtree_end)
    assert segments.cu_seqlens_q[-1] == rule.shape[0] and segments.cu_seqlens_q.numel() > 2
    seen = torch.zeros_like(rule)
    for s in range(segments.cu_seqlens_q.numel() - 1):
        q0, q1 = int(segments.cu_seqlens_q[s]), int(segments.cu_seqlens_q[s + 1])
        keys = segments.kv_index[int(segments.cu_seqlens_k[s]):int(segments.cu_seqlens_k[s + 1])]
        assert bool((keys[1:] > keys[:-1]).all())  # ascending: depth order along the path
        for i, q in enumerate(range(q0, q1)):
            seen[q, keys[: i + keys.numel() - (q1 - q0) + 1]] = True
    assert torch.equal(seen, rule)
    assert segments.max_seqlen_k == int((segments.cu_seqlens_k[1:] - segments.cu_seqlens_k[:-1]).max())


def test_the_reference_kernel_is_causal_attention() -> None:
    """The CPU stand-in for flash-attn agrees with sdpa: causal attention per sequence (GQA), and its window."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(11, heads, 8, generator=gen) for heads in (4, 2, 2))
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    out = varlen_reference(q, k, v, cu, cu, causal=True)
    for a, b in ((0, 4), (4, 11)):
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1), is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[a:b], expected.transpose(0, 1), atol=1e-6, rtol=0)
    window = varlen_reference(q, k, v, cu, cu, causal=True, window_size=(2, 2))
    i, j = torch.arange(7)[:, None], torch.arange(7)[None]
    mask = (j <= i) & (i - j <= 2)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[4:].transpose(0, 1), k[4:].transpose(0, 1), v[4:].transpose(0, 1), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(window[4:], expected.transpose(0, 1), atol=1e-6, rtol=0)


#: the families packing refuses under flash attention, and why: Falcon's flash attention is a class of its own and
#: XGLM has none, neither through transformers' AttentionInterface; StableLM's decoder layer calls its attention
#: without **kwargs; GPT-OSS's attention sinks are dropped by the kernels transformers hands them to (flash-attn 2)
FLASH_REFUSED = {"falcon": "AttentionInterface", "xglm": "AttentionInterface",
                 "stablelm": "StableLmDecoderLayer calls its self_attn without **kwargs", "gpt_oss": "sinks"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_matches_the_per_row_reference_under_flash(name: str, flash_calls: list[dict]) -> None:
    """Under a flash kernel a packed row's layers are handed its segments (the tree's, or one per sequence in the
    copies layout), and both layouts equal each row run alone (the reference model keeps sdpa or eager); the
    families that cannot carry them are refused in one line."""
    attn = FAMILIES[name].attns[0]
    reference_model, model, mb = build(name, attn), as_flash(build(name, attn)), micro_batch()
    if name in FLASH_REFUSED:
        reason = packing_supported(model)
        assert reason is not None and FLASH_REFUSED[name] in reason and "\n" not in reason, reason
        assert tree_supported(model.config, model) == reason
        if name == "stablelm":  # the refusal is earned: forced, the layer without the segments stops the tree
            from lit_grpo.core.prefix_tree import tree_forward

            with pytest.raises(RuntimeError, match="StableLmAttention was called without"), torch.no_grad():
                tree_forward(model, model.config._attn_implementation, tree_layout(mb))
        return
    with torch.no_grad():
        reference = per_row_reference(reference_model, mb, 1.0)
        assert packing_supported(model) is None
        assert max_difference(packed_completion_logprobs(model, mb, 1.0, layout="packed")[0], reference, mb) <= TOL
        assert tree_supported(model.config, model) is None and packed_layout_kind(model) == "packed_tree"
        flash_calls.clear()
        values = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree")[0]
    assert max_difference(values, reference, mb) <= TOL, name
    assert model.config._attn_implementation == "flash_attention_2" + TREE_SUFFIX
    segments = tree_segments(tree_layout(mb).subtree_end)
    tree_calls = [call for call in flash_calls if call["sequences"] == segments.cu_seqlens_q.numel() - 1]
    assert tree_calls and all(call["keys"] == segments.kv_index.numel() for call in tree_calls)


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2_sliding", "gemma2", "gpt_neox"])
def test_gradient_matches_the_per_row_reference_under_flash(name: str, flash_calls: list[dict]) -> None:
    """Gradients of ``sum(logp)`` through the gathered keys and values (index_select's backward adds each
    segment's share back): every parameter within ``TOL`` of the per-row reference's largest entry."""
    attn, mb = FAMILIES[name].attns[0], micro_batch()
    real = mb.completion_mask.bool()

    def gradients(model: torch.nn.Module, tree: bool) -> dict[str, torch.Tensor]:
        logp = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree")[0] if tree else \
            per_row_reference(model, mb, 1.0)
        logp[real].sum().backward()
        return {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}

    reference = gradients(build(name, attn), tree=False)
    scale = max(float(g.abs().max()) for g in reference.values())
    grads = gradients(as_flash(build(name, attn)), tree=True)
    assert grads.keys() == reference.keys()
    for key, grad in reference.items():
        torch.testing.assert_close(grads[key], grad, atol=TOL * scale, rtol=0, msg=f"{name}: {key}")


@pytest.mark.parametrize("mode", [True, "selective"])
def test_checkpointing_recomputes_the_tree(mode: bool | str, flash_calls: list[dict]) -> None:
    """Activation checkpointing recomputes each layer in the backward, after the forward has returned: the
    segments travel with the layer's kwargs, so the gradients are the same bits."""
    mb = shared_turns_micro_batch()
    grads = []
    for checkpointing in (False, mode):
        model = as_flash(build("llama", "sdpa")).train()
        enable_checkpointing(model, checkpointing)
        logp = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree")[0]
        (logp * mb.loss_mask).sum().backward()
        grads.append({key: p.grad.clone() for key, p in model.named_parameters()})
    for key, grad in grads[0].items():
        assert torch.equal(grads[1][key], grad), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_multi_turn_tree_matches_the_dense_mask(dtype: torch.dtype, flash_calls: list[dict]) -> None:
    """Shared turns, a duplicate row and a row that is a prefix of another: the flash tree against sdpa over the
    dense mask, within float32's rounding, and within bf16's in bf16 (both compute their softmax in float32)."""
    mb = shared_turns_micro_batch()
    with torch.no_grad():
        dense = packed_completion_logprobs(build("llama", "sdpa", dtype=dtype), mb, 1.0, layout="packed_tree",
                                           dense_mask=True)[0]
        flash = packed_completion_logprobs(as_flash(build("llama", "sdpa", dtype=dtype)), mb, 1.0,
                                           layout="packed_tree")[0]
    tol = TOL if dtype == torch.float32 else 5e-2
    assert max_difference(flash, dense, mb) <= tol
    assert max_difference(flash, dense, mb) > 0 or dtype == torch.float32  # two computations, not one


def test_the_routed_model_keeps_flashs_own_path(flash_calls: list[dict]) -> None:
    """After the switch a forward without the segments (generation, the padded layout) is flash's own: the same
    bits as the flash name before it."""
    model = as_flash(build("llama", "sdpa"))
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = (ids != 0).long()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        assert route_tree_flash(model) == "flash_attention_2" + TREE_SUFFIX
        assert route_tree_flash(model) == "flash_attention_2" + TREE_SUFFIX  # idempotent
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, after)


def test_a_layer_without_the_segments_raises(flash_calls: list[dict]) -> None:
    """A decoder that does not hand the segments to a layer would attend across branches: refused while a tree
    forward runs, and a tree forward that reached no layer is refused after it."""
    model = as_flash(build("llama", "sdpa"))

    class Dropping(torch.nn.Module):  # a wrapper that takes **kwargs and drops them
        def __init__(self) -> None:
            super().__init__()
            self.inner = model
            self.config = model.config

        def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=use_cache)

        def get_input_embeddings(self) -> torch.nn.Module:
            return model.get_input_embeddings()

    with pytest.raises(RuntimeError, match="without the prefix tree's segments"):
        packed_completion_logprobs(Dropping(), micro_batch(), 1.0, layout="packed_tree")
    with pytest.raises(RuntimeError, match="reached no attention layer"), tree_forward_guard():
        pass
    layer = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="one row without a mask"):
        tree_flash_attention(layer, q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                             None, lit_grpo_tree=tree_segments(torch.tensor([3, 3, 3])))


def test_what_the_flash_tree_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked layers, a flash-attn that aligns causal masks top left, a forward without **kwargs, attention
    sinks: each in one line; the model then packs with the copies layout."""
    import transformers.modeling_flash_attention_utils as fa

    model = as_flash(build("llama", "sdpa"))
    assert tree_supported(model.config, model) is None
    model.config.layer_types = ["full_attention", "chunked_attention"]
    assert "chunked_attention" in tree_supported(model.config, model)
    model.config.layer_types = ["full_attention", "full_attention"]
    monkeypatch.setattr(fa, "flash_attn_supports_top_left_mask", lambda: True)
    assert "bottom-right" in tree_supported(model.config, model)
    assert packed_layout_kind(model) == "packed"
    monkeypatch.undo()

    class NoKwargs(torch.nn.Module):
        config = model.config

        def forward(self, input_ids):  # noqa: ANN001, ANN201
            return model(input_ids)

    reason = tree_supported(model.config, NoKwargs())
    assert "NoKwargs.forward takes no **kwargs" in reason and "\n" not in reason
    with pytest.raises(ValueError, match="flash_attention_2, flash_attention_3"):
        route_tree_flash(build("llama", "sdpa"))
