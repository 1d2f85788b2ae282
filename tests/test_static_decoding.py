"""The static-cache decoding path of the in-process engine (compiled into CUDA graphs on a GPU; here, on the CPU,
the same code without compilation): what it reports equals teacher-forced scoring, it agrees token for token with
the dynamic path where sampling is deterministic, and a seed reproduces it."""

from collections import Counter

import pytest
import torch

from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.data.rollout import collate_rollouts, pad_rollouts
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.static_decoding import cut_at_eos, padded_width
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer

TEXTS = ("What is 2+2?", "Name a prime number.", "12*3=")


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    prompts = [tokenizer.encode(t) for t in TEXTS]  # three lengths: left padding differs by row
    return model, tokenizer, prompts


def engine(tiny, decode: str) -> TransformersEngine:
    model, tokenizer, _ = tiny
    return TransformersEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, decode=decode,
                              width_multiple=8)


def test_reported_logprobs_equal_teacher_forced_scoring(tiny):
    model, tokenizer, prompts = tiny
    groups = engine(tiny, "static").generate(prompts, 4, SamplingConfig(max_new_tokens=12, temperature=0.8), seed=3)
    assert any(c.truncated for g in groups for c in g) or any(not c.truncated for g in groups for c in g)
    batch = collate_rollouts(pad_rollouts(prompts, groups, tokenizer.pad_token_id, 5), [0.0, 1.0, 0.5, 0.0] * 3)
    reported = batch.sampler_logp
    with torch.no_grad():
        for mb in batch.micro_batches():
            scored, _ = completion_logprobs(model.eval(), mb, 0.8)
            mask = mb.completion_mask.bool()
            assert torch.allclose(scored[mask], reported[mb.rows, : scored.shape[1]][mask], atol=1e-4, rtol=0)


def test_static_and_dynamic_paths_agree_where_sampling_is_deterministic(tiny):
    """At top_p 1 the two paths draw from different random streams (transformers' sampler on the global generator,
    the dynamic path's own seeded generator), so their completions are different draws of one distribution. A
    nucleus this small keeps only the most likely token, which makes both deterministic: then the prompt padding,
    positions, cache and end-of-sequence handling of the two must agree token for token."""
    _, _, prompts = tiny
    greedy = SamplingConfig(max_new_tokens=16, temperature=1.0, top_p=1e-6)
    static = engine(tiny, "static").generate(prompts, 2, greedy, seed=0)
    dynamic = engine(tiny, "dynamic").generate(prompts, 2, greedy, seed=1)
    assert [[c.token_ids for c in g] for g in static] == [[c.token_ids for c in g] for g in dynamic]
    assert [[c.truncated for c in g] for g in static] == [[c.truncated for c in g] for g in dynamic]


def test_a_seed_reproduces_the_static_path_and_another_seed_does_not(tiny):
    _, _, prompts = tiny
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0)
    a = engine(tiny, "static")
    first = [[c.token_ids for c in g] for g in a.generate(prompts, 3, sampling, seed=5)]
    again = [[c.token_ids for c in g] for g in a.generate(prompts, 3, sampling, seed=5)]
    other = [[c.token_ids for c in g] for g in a.generate(prompts, 3, sampling, seed=6)]
    assert first == again and first != other
    assert len({tuple(t) for g in first for t in g}) > 1


def test_model_generation_defaults_do_not_change_the_distribution(tiny):
    """A model whose own generation config asks for top-k and a repetition penalty (as Qwen2.5-Instruct's does)
    samples with neither: the greedy check above still holds with them set."""
    model, tokenizer, prompts = tiny
    saved = model.generation_config.top_k, model.generation_config.repetition_penalty
    model.generation_config.top_k = 1
    model.generation_config.repetition_penalty = 5.0
    try:
        test_static_and_dynamic_paths_agree_where_sampling_is_deterministic(tiny)
        sampling = SamplingConfig(max_new_tokens=10, temperature=1.0)
        groups = engine(tiny, "static").generate(prompts, 4, sampling, seed=2)
        assert len({tuple(c.token_ids) for g in groups for c in g}) > 1  # top_k 1 would make them all equal
    finally:
        model.generation_config.top_k, model.generation_config.repetition_penalty = saved


class Unreadable:
    """A field value no part of ``generate`` accepts: reading it fails or changes what comes out."""

    def __repr__(self) -> str:
        return "Unreadable()"


#: values of a model's generation config that change what ``generate`` samples if they reach it (token ids lie in
#: the tiny model's vocabulary of 100); every other field gets an ``Unreadable``
SAMPLING_CHANGES = dict(
    max_length=3, max_new_tokens=2, min_length=30, min_new_tokens=11, do_sample=False, temperature=0.05, top_k=1,
    top_p=0.05, min_p=0.9, top_h=0.2, typical_p=0.2, epsilon_cutoff=0.3, eta_cutoff=0.3, repetition_penalty=5.0,
    no_repeat_ngram_size=1, bad_words_ids=[[28], [44]], renormalize_logits=True, forced_bos_token_id=40,
    forced_eos_token_id=78, exponential_decay_length_penalty=(1, 2.0), suppress_tokens=[19, 47],
    begin_suppress_tokens=[46], sequence_bias={(28,): 20.0}, eos_token_id=[28], pad_token_id=44, bos_token_id=40,
    num_beams=2, num_return_sequences=2, max_time=1e-9, use_cache=False, cache_implementation="dynamic",
)


def polluted_generation_config():
    """A generation config with EVERY field ``GenerationConfig`` has (read from the class, so a field added by a
    later transformers is covered too) set to a value other than its default."""
    from transformers import GenerationConfig

    default = GenerationConfig().to_dict()
    config = GenerationConfig()
    for name in default:
        if name != "transformers_version":
            setattr(config, name, SAMPLING_CHANGES.get(name, Unreadable()))
    assert all(getattr(config, name) != value for name, value in default.items() if name != "transformers_version")
    return config


def completions(groups):
    return [[(c.token_ids, c.logprobs, c.truncated) for c in g] for g in groups]


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_no_field_of_the_models_generation_config_reaches_the_sampler(tiny, decode):
    """transformers fills every field the sampling config leaves ``None`` from the model's generation config; the
    log-probs are the plain ``softmax(logits / T)``, so nothing of it may reach the sampler. The dynamic path never
    calls ``generate``; it is checked the same way."""
    _, _, prompts = tiny
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0)
    plain = engine(tiny, decode)
    baseline = plain.generate(prompts, 3, sampling, seed=7)
    polluted = engine(tiny, decode)
    own = polluted_generation_config()
    polluted.model.generation_config = own
    got = polluted.generate(prompts, 3, sampling, seed=7)
    assert completions(got) == completions(baseline)
    assert polluted.model.generation_config is own  # put back after the call


def test_suppressed_tokens_of_the_model_are_still_sampled(tiny):
    """The reproduction of the review: the model's ``generation_config.suppress_tokens`` is not part of the
    distribution the tokens are drawn from (alpha is the full softmax), so the five tokens drawn most often
    without it are drawn exactly as often with it."""
    _, _, prompts = tiny
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0)
    baseline = engine(tiny, "static").generate(prompts, 4, sampling, seed=3)
    counts = Counter(t for g in baseline for c in g for t in c.token_ids)
    frequent = [t for t, _ in counts.most_common(5)]
    assert sum(counts[t] for t in frequent) >= 15
    suppressing = engine(tiny, "static")
    suppressing.model.generation_config.suppress_tokens = frequent
    got = suppressing.generate(prompts, 4, sampling, seed=3)
    assert completions(got) == completions(baseline)


def test_auto_takes_the_dynamic_path_on_cpu_and_bad_options_are_refused(tiny):
    model, tokenizer, _ = tiny
    assert not engine(tiny, "auto").uses_static_decoding()
    with pytest.raises(ValueError, match="unknown decode 'fast'"):
        TransformersEngine(model, [tokenizer.eos_token_id], tokenizer.pad_token_id, decode="fast")


def test_padding_and_eos_helpers_by_hand():
    assert [padded_width(n, 64) for n in (1, 64, 65, 130)] == [64, 64, 128, 192]
    tokens = torch.tensor([[5, 2, 0, 0], [5, 6, 7, 8], [2, 9, 2, 0]])
    lengths, ended = cut_at_eos(tokens, [2])
    assert lengths.tolist() == [2, 4, 1] and ended.tolist() == [True, False, True]


def test_static_path_runs_under_the_trainers_autocast(tiny):
    """Under bf16-mixed the rollout runs inside the trainer's autocast; transformers' static cache cannot hold the
    float32 keys and bfloat16 values Llama produces there, so the path samples in float32 (its log-probs are the
    float32 teacher-forced ones) instead of failing."""
    model, tokenizer, prompts = tiny
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0)
    plain = engine(tiny, "static").generate(prompts, 2, sampling, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = engine(tiny, "static").generate(prompts, 2, sampling, seed=4)
    assert [[c.token_ids for c in g] for g in mixed] == [[c.token_ids for c in g] for g in plain]
    assert [[c.logprobs for c in g] for g in mixed] == [[c.logprobs for c in g] for g in plain]
