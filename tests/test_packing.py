"""Packing without padding gives the padded path's log-probs, entropies and gradients, in both layouts: each
completion after its own prompt copy (``"packed"``, ``lit_grpo.core.packing``) and the prefix tree
(``"packed_tree"``, ``lit_grpo.core.prefix_tree``; its own tests are in tests/test_prefix_tree.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from lit_grpo.core.batch import MicroBatch, left_pad, micro_batch_views
from lit_grpo.core.packing import packed_completion_logprobs, packed_layout, packed_layout_kind, packing_supported
from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.models import tiny_llama

VOCAB = 40
TOL = 1e-5
LAYOUTS = ("packed", "packed_tree")


def uneven_micro_batch(seed: int = 0, prompts: int = 3, group: int = 3, multi_turn: bool = False) -> MicroBatch:
    """Distinct prompts of 2 to 9 tokens (left-padded), ``group`` completions each of 1 to 40 tokens (right-padded,
    the extremes always present), as ``RolloutBatch.micro_batches`` lays them out; ``multi_turn`` adds a
    ``loss_mask`` with stretches of environment tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lists = [torch.randint(3, VOCAB, (int(torch.randint(2, 10, (1,), generator=gen)),), generator=gen).tolist()
                    for _ in range(prompts)]
    prompt_ids, prompt_mask = left_pad(prompt_lists, pad_id=0, device=torch.device("cpu"))
    rows = prompts * group
    lengths = torch.randint(1, 41, (rows,), generator=gen)
    lengths[0], lengths[-1] = 1, 40
    width = int(lengths.max())
    completion_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, VOCAB, (rows, width), generator=gen) * completion_mask
    loss_mask = None
    if multi_turn:  # the model's turn, then 3 to 5 environment tokens, then the model again, and so on
        loss_mask = completion_mask.clone()
        for row in range(rows):
            for start in range(4, int(lengths[row]) - 1, 11):
                loss_mask[row, start:start + 3 + row % 3] = 0
        loss_mask *= completion_mask
    group_index = torch.arange(prompts).repeat_interleave(group)
    (mb,) = micro_batch_views(prompt_ids, prompt_mask, group_index, completion_ids, completion_mask, rows, loss_mask)
    return mb


def llama(attn: str) -> torch.nn.Module:
    model = tiny_llama(VOCAB).float()
    model.config._attn_implementation = attn
    return model


def test_layout_has_no_padding() -> None:
    mb = uneven_micro_batch()
    input_ids, positions, keep, targets = packed_layout(mb)
    prompt_tokens = int(mb.prompt_mask[mb.prompt_index].sum())
    completion_tokens = int(mb.completion_mask.sum())
    rows = mb.completion_ids.shape[0]
    assert input_ids.shape == positions.shape == (1, prompt_tokens + completion_tokens - rows)
    assert keep.numel() == targets.numel() == completion_tokens
    assert int((positions == 0).sum()) == rows  # each sequence restarts at 0
    assert torch.equal(targets, mb.completion_ids[mb.completion_mask.bool()])
    assert input_ids.numel() < mb.completion_ids.shape[0] * (mb.prompt_ids.shape[1] + mb.completion_ids.shape[1])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("seed", [0, 1])
def test_logprobs_and_entropy_equal_the_padded_path(attn: str, seed: int, layout: str) -> None:
    model = llama(attn).eval()
    mb = uneven_micro_batch(seed)
    real = mb.completion_mask.bool()
    with torch.no_grad():
        padded, padded_entropy = completion_logprobs(model, mb, 0.7, with_entropy=True)
        packed, packed_entropy = packed_completion_logprobs(model, mb, 0.7, with_entropy=True, layout=layout)
    assert packed.shape == padded.shape and packed.dtype == padded.dtype == torch.float32
    torch.testing.assert_close(packed[real], padded[real], atol=TOL, rtol=0)
    torch.testing.assert_close(packed_entropy[real], padded_entropy[real], atol=TOL, rtol=0)
    assert not packed[~real].any() and not packed_entropy[~real].any()


def test_without_the_block_causal_mask_the_numbers_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The copies layout's equality rests on transformers detecting the packed sequences: with the detection off,
    the sequences attend to one another and the comparison fails."""
    from transformers import masking_utils

    model = llama("sdpa").eval()
    mb = uneven_micro_batch()
    real = mb.completion_mask.bool()
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with torch.no_grad():
        padded, _ = completion_logprobs(model, mb, 1.0)
        leaking, _ = packed_completion_logprobs(model, mb, 1.0, layout="packed")
    assert (leaking[real] - padded[real]).abs().max() > 1e-3


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_gradient_equals_the_padded_path(attn: str, entropy_grad: bool, layout: str) -> None:
    mb = uneven_micro_batch(seed=2, multi_turn=True)
    weights = torch.randn(mb.completion_ids.shape, generator=torch.Generator().manual_seed(3))
    mask = mb.loss_mask.float()
    grads, values = [], []
    for packed in (False, True):
        model = llama(attn).train()
        if packed:
            logp, entropy = packed_completion_logprobs(model, mb, 1.0, True, entropy_grad, layout)
        else:
            logp, entropy = completion_logprobs(model, mb, 1.0, with_entropy=True, entropy_grad=entropy_grad)
        loss = (weights * logp * mask).sum() / mask.sum() - 0.1 * (entropy * mask).sum() / mask.sum()
        loss.backward()
        assert entropy.requires_grad == entropy_grad
        values.append(loss.detach())
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    torch.testing.assert_close(values[1], values[0], atol=TOL, rtol=0)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=TOL, rtol=0, msg=name)
    assert any(g.abs().sum() > 0 for g in grads[1].values())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multi_turn_micro_batch_equals_the_padded_path(layout: str) -> None:
    model = llama("sdpa").eval()
    mb = uneven_micro_batch(seed=4, multi_turn=True)
    assert (mb.loss_mask != mb.completion_mask).any()
    with torch.no_grad():
        padded, _ = completion_logprobs(model, mb, 1.0)
        packed, _ = packed_completion_logprobs(model, mb, 1.0, layout=layout)
    mask = mb.loss_mask.bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=TOL, rtol=0)
    # the environment's tokens are context: scored like any real token, then left out by the loss mask
    env = mb.completion_mask.bool() & ~mask
    torch.testing.assert_close(packed[env], padded[env], atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_learned_absolute_positions_pack(layout: str) -> None:
    """GPT-2 indexes its position embedding with the position ids given, so it packs too."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    model.config._attn_implementation = "sdpa"
    assert packing_supported(model) is None
    mb = uneven_micro_batch(seed=5)
    real = mb.completion_mask.bool()
    with torch.no_grad():
        padded, _ = completion_logprobs(model, mb, 1.0)
        packed, _ = packed_completion_logprobs(model, mb, 1.0, layout=layout)
    torch.testing.assert_close(packed[real], padded[real], atol=TOL, rtol=0)


def test_supported_setups() -> None:
    for attn in ("sdpa", "eager", "flex_attention", "flash_attention_2"):
        model = llama("sdpa")
        model.config._attn_implementation = attn
        assert packing_supported(model) is None, attn


def test_unsupported_attention_is_refused_in_one_line() -> None:
    model = llama("sdpa")
    model.config._attn_implementation = "paged|sdpa"
    reason = packing_supported(model)
    assert reason is not None and "\n" not in reason and "'paged|sdpa'" in reason


def test_model_without_position_ids_is_refused() -> None:
    class NoPositions(torch.nn.Module):
        config = llama("sdpa").config

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            return input_ids

    reason = packing_supported(NoPositions())
    assert reason is not None and "position_ids" in reason and "\n" not in reason


def test_recurrent_layers_are_refused() -> None:
    model = llama("sdpa")
    model.config.layer_types = ["full_attention", "linear_attention"]
    reason = packing_supported(model)
    assert reason is not None and "linear_attention" in reason


def test_bad_layouts_are_refused() -> None:
    mb = uneven_micro_batch()
    holes = mb.completion_mask.clone()
    holes[-1, 3] = 0
    with pytest.raises(ValueError, match="contiguous"):
        packed_layout(MicroBatch(mb.prompt_ids, mb.prompt_mask, mb.prompt_index, mb.completion_ids, holes, mb.rows))
    empty = torch.zeros_like(mb.prompt_mask)
    with pytest.raises(ValueError, match="at least one prompt token"):
        packed_layout(MicroBatch(mb.prompt_ids, empty, mb.prompt_index, mb.completion_ids, mb.completion_mask,
                                 mb.rows))


# ---- the token budget under packing (data.micro_batch_tokens with model.packing) ---------------------------------

def packed_fit(tmp_path, monkeypatch, micro_batch_tokens: int | None) -> list[tuple[int, int]]:
    """One step of the tiny fit with ``model.packing``: ``(rows, tokens)`` of every packed row the module fed (each
    fed as the tree its sdpa attention takes)."""
    from conftest import tiny_data, tiny_module, tiny_trainer
    from lit_grpo.callbacks import WeightSync

    import lit_grpo.core.scoring as scoring
    from lit_grpo.core.packing import packed_token_count

    fed: list[tuple[int, int]] = []
    packed = scoring.packed_completion_logprobs

    def recording(model, mb, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        assert packed_layout_kind(model) == "packed_tree" and kwargs.get("layout") is None
        fed.append((int(mb.completion_ids.shape[0]), int(packed_token_count(mb, "packed_tree"))))
        return packed(model, mb, *args, **kwargs)

    monkeypatch.setattr(scoring, "packed_completion_logprobs", recording)
    module = tiny_module(packing=True, beta=0.1)  # pi_ref's pass is packed too
    data = tiny_data(micro_batch_tokens=micro_batch_tokens, micro_batch_size=8)
    tiny_trainer(tmp_path, 1, callbacks=[WeightSync()]).fit(module, datamodule=data)
    return fed


def test_the_budget_bounds_every_packed_row_the_module_feeds(tmp_path, monkeypatch, recwarn) -> None:
    """The padded plan counts a shared prompt once per micro-batch, packed copies once per completion, a tree once
    per group it holds. Planned with the cost of the layout fed (sdpa here: the tree),
    no row the module feeds (policy, pi_ref) is longer than ``data.micro_batch_tokens``, unless one sequence alone
    is; and the budget set, nothing is warned about packing."""
    budget = 300  # the tiny data's prompts are 140 to 331 tokens: two short sequences fit, no group whole
    fed = packed_fit(tmp_path, monkeypatch, budget)
    assert fed and any(rows > 1 for rows, _ in fed)  # the budget packs several sequences per row
    assert all(tokens <= budget or rows == 1 for rows, tokens in fed), fed
    assert not [w for w in recwarn if "micro_batch_tokens" in str(w.message)]


def test_packing_without_a_budget_is_warned_once_where_attention_is_dense() -> None:
    """sdpa's tree attends in blocks, so a row of whole sequences costs what it holds; eager's mask is dense."""
    from conftest import tiny_module

    from lit_grpo.data.fit_checks import packing_without_budget

    module = tiny_module(packing=True)
    assert packing_without_budget(module, None, 16) is None
    assert packing_without_budget(module, 4096, 16) is None
    module.policy.config._attn_implementation = "eager"
    line = packing_without_budget(module, None, 16)
    assert "\n" not in line and "eager attention in the prefix tree" in line and "data.micro_batch_tokens" in line
