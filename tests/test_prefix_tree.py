"""The prefix-tree layout (``lit_grpo.core.prefix_tree``): each shared prefix fed once, its mask letting each token see
its own path only, and the padded path's log-probs, entropies and gradients from it."""

from __future__ import annotations

import pytest
import torch
from test_packing import TOL, llama, uneven_micro_batch

from lit_grpo.core.batch import MicroBatch, left_pad, micro_batch_views
from lit_grpo.core.micro_batch_plan import tree_tokens
from lit_grpo.core.packing import packed_completion_logprobs, packed_layout_kind
from lit_grpo.core.prefix_tree import tree_layout, tree_supported, tree_token_count, tree_windows
from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.core.tree_attention import tree_attention_mask


def shared_turns_micro_batch() -> MicroBatch:
    """Two groups with the same 5-token prompt and one with its own; in group 0 rows 0 and 1 share a 6-token first
    turn (model tokens, then 3 environment tokens, as a multi-turn trajectory), row 2 repeats row 0 exactly, row 3
    is a prefix of row 0; an empty completion; a one-token completion."""
    prompt = [5, 6, 7, 8, 9]
    prompts = [prompt, [11, 12, 13], prompt]
    turn = [20, 21, 22, 23, 24, 25]
    completions = [
        turn + [30, 31, 32, 33],  # group 0
        turn + [34, 35],
        turn + [30, 31, 32, 33],  # a duplicate of row 0
        turn[:4],  # a prefix of row 0
        [14, 15, 16],  # group 1
        [],
        [17],
        turn + [36],  # group 2: the same prompt as group 0, so it joins its path
    ]
    group_index = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2])
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0, device=torch.device("cpu"))
    width = max(len(c) for c in completions)
    completion_ids = torch.zeros(len(completions), width, dtype=torch.long)
    completion_mask = torch.zeros_like(completion_ids)
    for row, tokens in enumerate(completions):
        completion_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        completion_mask[row, : len(tokens)] = 1
    loss_mask = completion_mask.clone()
    loss_mask[:3, 3:6] = 0  # the environment's tokens of the shared turn
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, group_index, completion_ids, completion_mask,
                              len(completions), loss_mask)
    return mb


def row_sequences(mb: MicroBatch) -> dict[int, list[int]]:
    """Each row's ``prompt + completion[:-1]`` tokens, read from the padded layout directly."""
    out = {}
    for row in range(mb.completion_ids.shape[0]):
        prompt = mb.prompt_ids[mb.prompt_index[row]][mb.prompt_mask[mb.prompt_index[row]].bool()].tolist()
        completion = mb.completion_ids[row][mb.completion_mask[row].bool()].tolist()
        if completion:
            out[row] = prompt + completion[:-1]
    return out


def test_the_tree_has_one_node_per_distinct_prefix() -> None:
    mb = shared_turns_micro_batch()
    sequences = row_sequences(mb)
    layout = tree_layout(mb)
    prefixes = {tuple(s[: k + 1]) for s in sequences.values() for k in range(len(s))}
    assert layout.input_ids.shape == (1, len(prefixes))
    copies = sum(len(s) for s in sequences.values())
    assert layout.input_ids.shape[1] < copies  # what the copies layout would feed
    # the budgeted count is an upper bound: distinct prompts once, completions not merged
    lengths = mb.completion_mask.sum(1).tolist()
    prompt_lengths = mb.prompt_mask.sum(1)[mb.prompt_index].tolist()
    assert int(tree_token_count(mb)) == tree_tokens(lengths, prompt_lengths, mb.prompt_index.tolist())
    assert int(tree_token_count(mb)) >= layout.input_ids.shape[1]


def test_each_row_reads_its_own_sequence_along_its_path() -> None:
    """Following the mask from each predicting node back to the root spells the row's sequence, at positions
    0, 1, 2, ...: the tree holds every row whole."""
    mb = shared_turns_micro_batch()
    layout = tree_layout(mb)
    allowed = tree_attention_mask(layout.subtree_end)
    ids, positions = layout.input_ids[0], layout.position_ids[0]
    keep = layout.keep.tolist()
    start = 0
    for row, sequence in sorted(row_sequences(mb).items()):
        c = int(mb.completion_mask[row].sum())
        last = keep[start + c - 1]  # the node predicting the row's last token ends its sequence
        path = allowed[last].nonzero().flatten()
        assert ids[path].tolist() == sequence
        assert positions[path].tolist() == list(range(len(sequence)))
        targets = layout.targets[start: start + c].tolist()
        assert targets == mb.completion_ids[row, :c].tolist()
        start += c
    assert start == layout.keep.numel()


def test_the_mask_is_ancestry_computed_from_parent_links() -> None:
    """``k <= q < subtree_end[k]`` against ancestry found independently: each node's parent is the nearest earlier
    node one level up (pre-order), and a node sees itself and its parent's ancestors."""
    mb = uneven_micro_batch(seed=3)
    layout = tree_layout(mb)
    depth = layout.position_ids[0].tolist()
    size = len(depth)
    expected = torch.zeros(size, size, dtype=torch.bool)
    for node in range(size):
        expected[node, node] = True
        if depth[node] > 0:
            parent = max(k for k in range(node) if depth[k] == depth[node] - 1)
            expected[node] |= expected[parent]
    assert torch.equal(tree_attention_mask(layout.subtree_end), expected)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_turns_and_duplicates_equal_the_padded_path(attn: str) -> None:
    model = llama(attn).eval()
    mb = shared_turns_micro_batch()
    real = mb.completion_mask.bool()
    with torch.no_grad():
        padded, padded_entropy = completion_logprobs(model, mb, 0.9, with_entropy=True)
        tree, tree_entropy = packed_completion_logprobs(model, mb, 0.9, with_entropy=True, layout="packed_tree")
    torch.testing.assert_close(tree[real], padded[real], atol=TOL, rtol=0)
    torch.testing.assert_close(tree_entropy[real], padded_entropy[real], atol=TOL, rtol=0)
    assert not tree[~real].any()
    torch.testing.assert_close(tree[2], tree[0])  # a duplicate row reads the same nodes


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_gradient_through_shared_nodes_equals_the_padded_path(attn: str) -> None:
    """A shared node's gradient sums over every row below it, as the padded path sums over the rows' copies."""
    mb = shared_turns_micro_batch()
    weights = torch.randn(mb.completion_ids.shape, generator=torch.Generator().manual_seed(1))
    mask = mb.loss_mask.float()
    grads = []
    for packed in (False, True):
        model = llama(attn).train()
        if packed:
            logp, _ = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree")
        else:
            logp, _ = completion_logprobs(model, mb, 1.0)
        ((weights * logp * mask).sum() / mask.sum()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=TOL, rtol=0, msg=name)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("precision", ["bf16 weights", "bf16 autocast"])
def test_the_tree_holds_in_bf16(attn: str, precision: str) -> None:
    """In bf16 (weights, or fp32 weights under autocast as bf16-mixed runs) the tree equals the padded path in the
    same precision to within bf16 rounding (measured: at most 2e-3, the size of bf16's own error against fp32):
    the eager mask is additive in the hidden states' dtype, sdpa's boolean."""
    mb = shared_turns_micro_batch()
    real = mb.completion_mask.bool()
    model = llama(attn).eval()
    if precision == "bf16 weights":
        model = model.to(torch.bfloat16)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16 autocast"):
        padded, _ = completion_logprobs(model, mb, 1.0)
        tree, _ = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree")
    torch.testing.assert_close(tree[real], padded[real], atol=1e-2, rtol=0)


@pytest.mark.parametrize("path", ["dense mask", "blocks"])
def test_without_the_tree_rule_branches_see_each_other(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality rests on the rule: with plain causal attention over the layout (the dense mask's rule replaced;
    for the blocks, the whole row taken for one segment, so no block stops at a branch end), a branch attends to
    its siblings laid out before it and the numbers differ."""
    import lit_grpo.core.tree_attention as tree_attention

    model = llama("sdpa").eval()
    mb = uneven_micro_batch(seed=0)
    real = mb.completion_mask.bool()
    if path == "dense mask":
        monkeypatch.setattr(tree_attention, "may_attend",
                            lambda queries, keys, *rest: keys[None, :] <= queries[:, None])
    else:
        monkeypatch.setattr(tree_attention, "segment_starts",
                            lambda end: torch.arange(end.numel(), device=end.device) == 0)
    with torch.no_grad():
        padded, _ = completion_logprobs(model, mb, 1.0)
        leaking, _ = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree", dense_mask=path == "dense mask")
    assert (leaking[real] - padded[real]).abs().max() > 1e-3


def test_flex_attention_block_mask_equals_the_padded_path() -> None:
    """Flex attention gets the rule as a ``BlockMask`` (forward only: torch runs no flex backward on a CPU)."""
    model = llama("flex_attention").eval()
    mb = shared_turns_micro_batch()
    real = mb.completion_mask.bool()
    with torch.no_grad():
        padded, _ = completion_logprobs(llama("sdpa").eval(), mb, 1.0)
        tree, _ = packed_completion_logprobs(model, mb, 1.0, layout="packed_tree")
    torch.testing.assert_close(tree[real], padded[real], atol=TOL, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex attention's backward)")
def test_flex_attention_gradient_equals_the_padded_path_on_cuda() -> None:
    mb = shared_turns_micro_batch()
    mb = MicroBatch(*(t.cuda() for t in (mb.prompt_ids, mb.prompt_mask, mb.prompt_index, mb.completion_ids,
                                         mb.completion_mask)), mb.rows, mb.loss_mask.cuda())
    grads = []
    for attn, packed in (("sdpa", False), ("flex_attention", True)):
        model = llama(attn).cuda().train()
        logp, _ = (packed_completion_logprobs(model, mb, 1.0, layout="packed_tree") if packed
                   else completion_logprobs(model, mb, 1.0))
        (logp * mb.loss_mask).sum().backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-4, rtol=0, msg=name)


def test_which_models_pack_as_a_tree() -> None:
    model = llama("sdpa")
    assert tree_supported(model.config) is None and packed_layout_kind(model) == "packed_tree"
    model.config._attn_implementation = "flash_attention_2"  # no mask: the tree's segments (tests/test_tree_flash.py)
    assert tree_supported(model.config, model) is None and packed_layout_kind(model) == "packed_tree"
    model.config._attn_implementation = "flash_attention_2:lit_grpo_tree"  # the function it is routed to
    assert tree_supported(model.config, model) is None and packed_layout_kind(model) == "packed_tree"
    model.config._attn_implementation = "paged|sdpa"
    reason = tree_supported(model.config)
    assert reason is not None and "'paged|sdpa'" in reason and "\n" not in reason
    assert packed_layout_kind(model) == "packed"
    model.config._attn_implementation = "sdpa"
    # Llama ignores a sliding_window setting (its decoder builds no sliding mask): the tree stays full; without the
    # model to read, the setting is taken at its word and refused
    model.config.sliding_window = 16
    assert tree_windows(model.config, model) is None and packed_layout_kind(model) == "packed_tree"
    assert "sliding window" in tree_supported(model.config)
    model.config.sliding_window = None
    model.config.layer_types = ["full_attention", "chunked_attention"]
    assert "chunked_attention" in tree_supported(model.config, model)
    with pytest.raises(ValueError, match="packed_tree layout: .*chunked_attention"):
        packed_completion_logprobs(model, uneven_micro_batch(), 1.0, layout="packed_tree")
    model.config.layer_types, model.config.sliding_window = ["full_attention", "sliding_attention"], 8
    reason = tree_supported(model.config, model)  # Llama's decoder takes no mapping of masks per layer kind
    assert "one mask per layer kind" in reason and "LlamaForCausalLM" in reason
    model.config._attn_implementation = "flex_attention"
    assert "BlockMask" in tree_supported(model.config, model)


def test_an_all_empty_micro_batch_feeds_nothing() -> None:
    mb = uneven_micro_batch()
    empty = MicroBatch(mb.prompt_ids, mb.prompt_mask, mb.prompt_index, mb.completion_ids,
                       torch.zeros_like(mb.completion_mask), mb.rows)
    layout = tree_layout(empty)
    assert layout.input_ids.numel() == 0 and int(tree_token_count(empty)) == 0
    logp, _ = packed_completion_logprobs(llama("sdpa").eval(), empty, 1.0, layout="packed_tree")
    assert not logp.any()

