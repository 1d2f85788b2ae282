"""Dynamic decoding that frees finished slots (``TransformersEngine``'s dynamic path, ``max_num_seqs``): finished
rows leave the running batch, waiting sequences take the freed slots, and the completions keep their meaning: the
same tokens as the decoding loop that kept every row to the end (greedy), the sampler's log-probs equal to the
engine's recompute, the same completions for the same seed whatever the slot cap."""

from __future__ import annotations

import pytest
import torch

from lit_grpo.core.batch import left_pad
from lit_grpo.core.cache_argument import cache_kwarg, output_cache
from lit_grpo.core.scoring import positions_from_mask
from lit_grpo.data.rollout import pad_rollouts
from lit_grpo.engines.base import Completion, SamplingConfig
from lit_grpo.engines.continuous_batching import left_pad_rows, rebuild_due, sample_with_uniforms
from lit_grpo.engines.options import engine_options
from lit_grpo.engines.transformers_engine import TransformersEngine, top_p_filter
from lit_grpo.math.logprobs import selective_log_softmax
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer

TEXTS = ("What is 2+2?", "Name a prime number.", "12*3=", "hello", "abc", "The sky is", "7 times 8", "x")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    return model.eval(), tokenizer, [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture
def eos_bias(tiny):
    """Adds ``bias`` to the EOS logit of every forward of the tiny model (sampling and scoring alike), so that
    completions end early and unevenly; yields the setter."""
    model, tokenizer, _ = tiny
    eos = eos_token_ids(tokenizer, model)
    bias = torch.zeros(len(tokenizer))
    handle = model.lm_head.register_forward_hook(lambda module, args, out: out + bias)

    def set_bias(value: float) -> None:
        bias.zero_()
        bias[eos] = value

    yield set_bias
    handle.remove()


def engine_of(tiny, **options) -> TransformersEngine:
    model, tokenizer, _ = tiny
    return TransformersEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, copy_weights=False,
                              decode="dynamic", **options)


def as_tuples(groups: list[list[Completion]]) -> list[list[tuple]]:
    return [[(c.token_ids, c.logprobs, c.truncated) for c in g] for g in groups]


def batch_sizes(model: torch.nn.Module):
    """A list that collects the batch size of every forward of ``model``, and the hook's handle."""
    sizes: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: sizes.append(kwargs["input_ids"].shape[0]),
                                              with_kwargs=True)
    return sizes, handle


@torch.inference_mode()
def old_generate(model, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int, eos_ids: list[int],
                 pad: int) -> list[list[Completion]]:
    """The dynamic decoding loop before finished rows left the batch (every row stepped until the longest
    completion ended, finished rows fed pad tokens), without the preallocated cache (bit for bit the same)."""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(int(seed))
    ids, mask = left_pad(prompts, pad, device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=True,
                logits_to_keep=1)
    expand = torch.arange(len(prompts), device=device).repeat_interleave(n)
    cache = output_cache(out)
    cache.batch_select_indices(expand)
    cache_name = cache_kwarg(model)
    logits = out.logits[:, -1][expand]
    attention = mask[expand]
    rows = expand.numel()
    eos = torch.tensor(eos_ids, device=device)
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(rows, dtype=torch.long, device=device)
    tokens, logps = [], []
    for _ in range(sampling.max_new_tokens):
        scaled = logits.float() / sampling.temperature
        probs = torch.softmax(top_p_filter(scaled, sampling.top_p), dim=-1)
        sampled = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        sampled = torch.where(finished, torch.full_like(sampled, pad), sampled)
        tokens.append(sampled)
        logps.append(selective_log_softmax(scaled, sampled))
        lengths += (~finished).long()
        finished = finished | torch.isin(sampled, eos)
        if len(tokens) == sampling.max_new_tokens or bool(finished.all()):
            break
        attention = torch.cat([attention, (~finished).long().unsqueeze(-1)], dim=1)
        logits = model(input_ids=sampled.unsqueeze(-1), attention_mask=attention,
                       position_ids=(attention.sum(-1, keepdim=True) - 1).clamp(min=0), use_cache=True,
                       **{cache_name: cache}).logits[:, -1]
    token_rows, logp_rows, ended = torch.stack(tokens, 1).tolist(), torch.stack(logps, 1).tolist(), finished.tolist()
    return [[Completion(token_rows[r][: int(lengths[r])], logp_rows[r][: int(lengths[r])], truncated=not ended[r])
             for r in range(p * n, (p + 1) * n)] for p in range(len(prompts))]


def test_sampling_with_uniforms_inverts_the_cumulative_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0], [0.1, 0.2, 0.3, 0.0]])
    low = sample_with_uniforms(probs, torch.tensor([0.0, 0.0, 0.0]))
    assert low.tolist() == [0, 2, 0]  # a token of probability 0 is never drawn, also at u = 0
    mid = sample_with_uniforms(probs, torch.tensor([0.5, 0.5, 0.5]))
    assert mid.tolist() == [2, 2, 2]  # 0.5 * 0.6 = 0.3 lies in token 2's interval [0.3, 0.6)
    top = sample_with_uniforms(probs, torch.tensor([1 - 1e-16, 0.999, 1 - 1e-16]))
    assert top.tolist() == [3, 2, 2]  # never the trailing token of probability 0
    # frequencies follow the probabilities
    draws = sample_with_uniforms(probs[:1].expand(40_000, -1), torch.rand(40_000, generator=torch.Generator()
                                                                          .manual_seed(0), dtype=torch.float64))
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert torch.allclose(freq, probs[0].double(), atol=0.01), freq
    with pytest.raises(ValueError, match=r"expected probs \[rows, vocab\] and uniforms \[rows\]"):
        sample_with_uniforms(probs, torch.zeros(2))


def test_a_rebuild_waits_for_a_fraction_of_finished_rows():
    assert not rebuild_due(0, 16, 5)
    assert not rebuild_due(1, 16, 0, fraction=0.125) and rebuild_due(2, 16, 0, fraction=0.125)
    assert rebuild_due(1, 16, 0, fraction=0.0)  # every finish
    assert rebuild_due(3, 3, 7)  # all finished and sequences wait: their slots at once
    assert rebuild_due(3, 3, 0)  # all finished, kept going (lockstep): down to one row
    assert not rebuild_due(1, 1, 0)  # one finished row is the least a rank keeps
    with pytest.raises(ValueError, match="fraction must lie in"):
        rebuild_due(1, 2, 0, fraction=1.5)


def test_left_padding_rows_right_aligns_each_part():
    a, b = torch.ones(2, 3), torch.full((1, 5), 2.0)
    out = left_pad_rows([a, b], dim=1)
    assert out.tolist() == [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [2, 2, 2, 2, 2]]


@pytest.mark.parametrize("max_num_seqs", [None, 3])
def test_greedy_completions_equal_the_loop_that_kept_every_row(tiny, eos_bias, max_num_seqs):
    """top_p tiny samples the argmax: the draws do not matter, so the tokens must be the old loop's, on
    completions of uneven lengths (some end at once, some run to the cap)."""
    model, tokenizer, prompts = tiny
    eos_bias(0.1)
    sampling = SamplingConfig(max_new_tokens=40, temperature=1.0, top_p=1e-6)
    want = old_generate(model, prompts, 2, sampling, 0, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
    got = engine_of(tiny, max_num_seqs=max_num_seqs).generate(prompts, 2, sampling, seed=0)
    lengths = [len(c.token_ids) for g in want for c in g]
    assert min(lengths) <= 5 and max(lengths) == 40  # uneven: the case finished rows leave
    for w, g in zip(want, got):
        for cw, cg in zip(w, g):
            assert cg.token_ids == cw.token_ids and cg.truncated == cw.truncated
            assert torch.allclose(torch.tensor(cg.logprobs), torch.tensor(cw.logprobs), atol=1e-5)


def test_forwards_after_rows_finish_run_on_fewer_rows(tiny, eos_bias):
    model, _, prompts = tiny
    eos_bias(3.0)
    sampling = SamplingConfig(max_new_tokens=40, temperature=1.0)
    sizes, handle = batch_sizes(model)
    try:
        groups = engine_of(tiny).generate(prompts[:4], 4, sampling, seed=3)
    finally:
        handle.remove()
    lengths = [len(c.token_ids) for g in groups for c in g]
    prefill, decode = sizes[0], sizes[1:]
    assert prefill == 4  # each prompt once for its 4 completions
    assert len(decode) == max(lengths) - 1  # as many decode forwards as the old loop: lockstep keeps its count
    assert decode[0] == 16 and decode == sorted(decode, reverse=True) and decode[-1] < 16
    # the forward after the s-th token runs the rows still decoding, those that ended at that token (they leave
    # after it) and fewer than 1/8 of the batch that ended before (a rebuild waits for 1/8 of it: here < 2 rows)
    for step, size in enumerate(decode, start=1):
        decoding, ending = sum(n > step for n in lengths), sum(n == step for n in lengths)
        assert decoding <= size <= decoding + ending + 1, (step, size, decoding, ending)
    assert sum(decode) < 0.6 * 16 * len(decode)


def test_same_seed_same_completions_and_another_seed_others(tiny, eos_bias):
    _, _, prompts = tiny
    eos_bias(2.0)
    sampling = SamplingConfig(max_new_tokens=30, temperature=1.0, top_p=0.9)
    for max_num_seqs in (None, 5):
        engine = engine_of(tiny, max_num_seqs=max_num_seqs)
        first = as_tuples(engine.generate(prompts, 3, sampling, seed=11))
        assert as_tuples(engine.generate(prompts, 3, sampling, seed=11)) == first
        assert as_tuples(engine.generate(prompts, 3, sampling, seed=12)) != first


def test_a_slot_cap_decodes_the_same_completions_in_fewer_rows(tiny, eos_bias):
    """Each row's draws are its own (one uniform per row and position), so capping the rows that decode at once
    changes the batches, not the completions: the same tokens, log-probs within float rounding of the batching."""
    model, _, prompts = tiny
    eos_bias(2.0)
    sampling = SamplingConfig(max_new_tokens=30, temperature=1.0)
    free = engine_of(tiny).generate(prompts, 3, sampling, seed=5)
    sizes, handle = batch_sizes(model)
    try:
        capped = engine_of(tiny, max_num_seqs=4).generate(prompts, 3, sampling, seed=5)
    finally:
        handle.remove()
    assert max(sizes) <= 4 and sizes[0] <= 2  # the first admission: 4 rows of 2 prompts, prefilled once each
    assert len(sizes) > max(len(c.token_ids) for g in capped for c in g)  # admissions added prefills
    for gf, gc in zip(free, capped):
        for cf, cc in zip(gf, gc):
            assert cc.token_ids == cf.token_ids and cc.truncated == cf.truncated
            assert torch.allclose(torch.tensor(cc.logprobs), torch.tensor(cf.logprobs), atol=1e-5)
    lengths = [len(c.token_ids) for g in capped for c in g]
    assert min(lengths) < max(lengths)  # uneven, so slots did free early


@pytest.mark.parametrize("max_num_seqs", [None, 4])
def test_sampler_log_probs_equal_the_engines_recompute(tiny, eos_bias, max_num_seqs):
    """mu (the sampler's log-probs) against ``score`` (alpha's recompute on the padded batch): the suite's
    tolerance for fp32 sampling (mean gap below 1e-5)."""
    model, tokenizer, prompts = tiny
    eos_bias(2.0)
    sampling = SamplingConfig(max_new_tokens=24, temperature=0.8)
    engine = engine_of(tiny, max_num_seqs=max_num_seqs)
    groups = engine.generate(prompts, 3, sampling, seed=2)
    padded = pad_rollouts(prompts, groups, tokenizer.pad_token_id, 6)
    alpha = engine.score(padded, sampling.temperature)
    mask = padded.completion_mask.bool()
    gap = (padded.sampler_logp - alpha)[mask].abs()
    assert mask.sum() > 0 and float(gap.mean()) < 1e-5 and float(gap.max()) < 1e-4


def test_a_rank_whose_rows_finished_keeps_one_row_while_its_peers_decode(tiny, eos_bias):
    """``all_finished`` is a collective on sharded models: it is called once per step, and each call that says
    "go on" is followed by one forward, also after this rank's rows all finished (one row left)."""
    model, _, prompts = tiny
    eos_bias(5.0)
    sampling = SamplingConfig(max_new_tokens=30, temperature=1.0)
    calls: list[bool] = []

    def peers_need_12_steps(done: bool) -> bool:
        calls.append(done)
        return len(calls) >= 12

    sizes, handle = batch_sizes(model)
    try:
        groups = engine_of(tiny).generate(prompts[:4], 4, sampling, seed=1, all_finished=peers_need_12_steps)
    finally:
        handle.remove()
    assert len(calls) == 12 and calls[-1]  # this rank finished early and waited for its peers
    assert len(sizes) - 1 == 11  # one forward per "go on"
    assert sizes[-1] == 1 and min(sizes) >= 1
    assert max(len(c.token_ids) for g in groups for c in g) < 12


@pytest.mark.parametrize("value", [0, -2, True, 2.5, "4"])
def test_a_bad_slot_cap_is_refused_in_one_line(tiny, value):
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1") as err:
        engine_of(tiny, max_num_seqs=value)
    assert "\n" not in str(err.value) and repr(value) in str(err.value)
    with pytest.raises(ValueError, match="max_num_seqs") as err:
        engine_options("transformers", {"max_num_seqs": value})
    assert "\n" not in str(err.value)


def test_the_option_reaches_the_engine():
    options = engine_options("transformers", {"max_num_seqs": 8, "decode": "dynamic"})
    assert options.max_num_seqs == 8
