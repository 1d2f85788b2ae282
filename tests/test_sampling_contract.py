"""One sampling contract for every engine: tokens come from ``softmax(logits / T)`` (nucleus ``top_p`` when set) and
from nothing else, whatever the model's generation config says; and the first-push check that refuses a sampler
whose log-probs are not the trainer's. The vLLM engines are checked the same way in
``tests/test_sampling_contract_vllm.py`` (the vLLM tier)."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch
from polluted_config import SAMPLING_JSON, sampling_fields_of_the_class, write_polluted_generation_config
from server_process import ServerProcess

from lit_grpo.data.sampler_check import (
    DEFAULT_MAX_GAP,
    SamplerCheck,
    SamplerMismatchError,
    rejoined_servers,
    sampler_gap,
)
from lit_grpo.engines.base import Completion, SamplingConfig
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.sampling_fields import vllm_sampling_fields
from lit_grpo.engines.transformers_engine import TransformersEngine
from lit_grpo.models.loading import eos_token_ids, load_model_and_tokenizer
from lit_grpo.wire.protocol import HTTPFailure, Limits, parse_completion_request

TEXTS = ("What is 2+2?", "Name a prime.", "12*3=")
#: the sampling fields vLLM 0.32/0.33 fill from a model's generation config when a request leaves them unset
#: (``ModelConfig.get_diff_sampling_param``), as vLLM names them in a request
VLLM_FILLED = {"repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
               "min_p", "max_tokens"}


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model_and_tokenizer("tiny-random-llama")
    return model.eval(), tokenizer, [tokenizer.encode(t) for t in TEXTS]


@torch.no_grad()
def teacher_forced(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of the completion's tokens: one plain forward, float64."""
    logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].double()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_gap(model, prompts, groups, temperature: float) -> float:
    gaps = [(torch.tensor(c.logprobs, dtype=torch.float64) - teacher_forced(model, p, c.token_ids, temperature)).abs()
            for p, g in zip(prompts, groups) for c in g if c.token_ids]
    return float(torch.cat(gaps).max())


def test_every_field_vllm_fills_is_sent_at_its_neutral_value():
    sampling = SamplingConfig(max_new_tokens=7, temperature=0.7, top_p=0.9)
    fields = vllm_sampling_fields(sampling)
    assert set(fields) == VLLM_FILLED
    assert (fields["temperature"], fields["top_p"], fields["max_tokens"]) == (0.7, 0.9, 7)
    # neutral: no top-k cut (vLLM's 0), no min-p, and penalties that change no logit
    assert (fields["top_k"], fields["min_p"], fields["repetition_penalty"], fields["presence_penalty"],
            fields["frequency_penalty"]) == (0, 0.0, 1.0, 0.0, 0.0)


def test_the_polluted_config_sets_every_sampling_field_of_the_class():
    from transformers import GenerationConfig

    # the fields of the class that steer sampling or stopping: every one is set, away from its default
    fields = sampling_fields_of_the_class()
    assert {"temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size",
            "bad_words_ids", "suppress_tokens", "sequence_bias", "max_new_tokens", "do_sample"} <= fields
    default = GenerationConfig().to_dict()
    assert all(SAMPLING_JSON[name] != default[name] for name in fields)
    assert {"presence_penalty", "frequency_penalty"} <= set(SAMPLING_JSON)  # read by vLLM from the file


def test_the_project_server_takes_neutral_fields_and_refuses_others():
    limits = Limits()
    body = {"prompt": [1, 2], "n": 2, "max_tokens": 4, **vllm_sampling_fields(SamplingConfig(max_new_tokens=4))}
    request = parse_completion_request(body, limits, vocab_size=10)
    assert request.temperature == 1.0 and request.top_p == 1.0
    for key, value in (("top_k", 20), ("repetition_penalty", 1.1), ("min_p", 0.05), ("presence_penalty", 0.5),
                       ("frequency_penalty", True)):
        with pytest.raises(HTTPFailure, match=key) as err:
            parse_completion_request({**body, key: value}, limits, vocab_size=10)
        assert err.value.status == 400 and "\n" not in str(err.value)


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_in_process_engine_samples_the_contract_under_a_polluted_generation_config(tiny, decode, tmp_path):
    from transformers import GenerationConfig

    model, tokenizer, prompts = tiny
    write_polluted_generation_config(tmp_path)
    polluted = copy.deepcopy(model)
    polluted.generation_config = GenerationConfig.from_pretrained(tmp_path)
    engine = TransformersEngine(polluted, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, decode=decode,
                                width_multiple=8, compile=False)
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.8)
    groups = engine.generate(prompts, 3, sampling, seed=4)
    assert max(len(c.token_ids) for g in groups for c in g) > 2  # the config's max_new_tokens=2 did not apply
    assert max_gap(model, prompts, groups, 0.8) < 1e-4


def test_project_server_samples_the_contract_under_a_polluted_generation_config(tiny, tmp_path, one_thread):
    model, tokenizer, prompts = tiny
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    write_polluted_generation_config(tmp_path / "model")
    server = ServerProcess(tmp_path / "server", model=str(tmp_path / "model"))
    try:
        server.wait_ready()
        engine = ServerEngine(url=server.url, token=server.token, stop_token_ids=eos_token_ids(tokenizer, model),
                              bucket_mb=0.05)
        engine.load_weights(model.named_parameters(), step=0)  # the same weights: a push makes them servable
        groups = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=12, temperature=0.8), seed=4)
        engine.close()
    finally:
        server.kill()
    assert max(len(c.token_ids) for g in groups for c in g) > 2
    assert max_gap(model, prompts, groups, 0.8) < 1e-4


# ---- the first-push check ---------------------------------------------------------------------------------------
def sampled(model, tokenizer, prompts, temperature: float) -> list[list[Completion]]:
    engine = TransformersEngine(model, eos_token_ids(tokenizer, model), tokenizer.pad_token_id, compile=False)
    return engine.generate(prompts, 2, SamplingConfig(max_new_tokens=10, temperature=temperature), seed=1)


def check(model, prompts, groups, temperature: float, **kwargs):
    return SamplerCheck(**kwargs)(model, prompts, groups, temperature, torch.device("cpu"), "rollout server at X",
                                  nullcontext)


def test_gap_is_the_mean_absolute_difference_over_the_first_sequences(tiny):
    model, _, prompts = tiny
    groups = [[Completion([5, 6], [-1.0, -2.0], False), Completion([7], [-0.5], False)],
              [Completion([8, 9, 10], [-1.0, -1.0, -1.0], False), Completion([], [], False)]]
    total, count = sampler_gap(model, prompts, groups, 0.9, sequences=3, device=torch.device("cpu"))
    expected = [(torch.tensor(c.logprobs, dtype=torch.float64) - teacher_forced(model, p, c.token_ids, 0.9)).abs()
                for p, c in ((prompts[0], groups[0][0]), (prompts[0], groups[0][1]), (prompts[1], groups[1][0]))]
    assert count == 6
    assert total == pytest.approx(float(torch.cat(expected).sum()), rel=1e-9)


def test_check_passes_the_trainers_own_sampler_and_restores_train_mode(tiny):
    model, tokenizer, prompts = tiny
    groups = sampled(model, tokenizer, prompts, 0.7)
    model.train()
    try:
        report = check(model, prompts, groups, 0.7)
        assert model.training
    finally:
        model.eval()
    assert report.mean_gap < 1e-5 and report.tokens > 0 and report.seconds >= 0


def test_check_refuses_another_model_in_one_line(tiny):
    model, tokenizer, prompts = tiny
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    groups = sampled(other, tokenizer, prompts, 1.0)  # the weights the trainer pushed never arrived
    with pytest.raises(SamplerMismatchError) as err:
        check(model, prompts, groups, 1.0)
    message = str(err.value)
    assert "\n" not in message and "rollout server at X" in message
    for hint in ("processed_logprobs", "dtype", "same model", "generation config"):
        assert hint in message


def test_check_refuses_log_probs_reported_at_temperature_one(tiny):
    """What a vllm serve without --logprobs-mode processed_logprobs reports: the tokens sampled at T, their
    log-probs at temperature 1."""
    model, tokenizer, prompts = tiny
    groups = sampled(model, tokenizer, prompts, 0.5)
    raw = [[Completion(c.token_ids, teacher_forced(model, p, c.token_ids, 1.0).tolist(), c.truncated) for c in g]
           for p, g in zip(prompts, groups)]
    assert check(model, prompts, groups, 0.5).mean_gap < 1e-5
    with pytest.raises(SamplerMismatchError, match="processed_logprobs"):
        check(model, prompts, raw, 0.5)


def test_check_refuses_a_sampler_with_top_k(tiny):
    """What a generation config's top_k does to the reported (processed) log-probs: renormalised over the top k."""
    model, tokenizer, prompts = tiny
    groups = sampled(model, tokenizer, prompts, 1.0)
    cut = []
    for p, g in zip(prompts, groups):
        row = []
        for c in g:
            logits = model(input_ids=torch.tensor([p + c.token_ids])).logits[0, len(p) - 1: -1].double().detach()
            top = logits.topk(5, dim=-1).values.logsumexp(-1)
            chosen = logits.gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            row.append(Completion(c.token_ids, (chosen - top).tolist(), c.truncated))
        cut.append(row)
    with pytest.raises(SamplerMismatchError):
        check(model, prompts, cut, 1.0)


def test_bad_check_options_are_one_line(monkeypatch):
    from lit_grpo.data.datamodule import RolloutDataModule
    from lit_grpo.engines.remote import client

    monkeypatch.setattr(client, "check_servers", lambda options: None)  # no server is started here

    for kwargs, needle in ((dict(sampler_check_max_gap=-1.0), "sampler_check_max_gap"),
                           (dict(sampler_check_max_gap=True), "sampler_check_max_gap"),
                           (dict(sampler_check_sequences=0), "sampler_check_sequences")):
        with pytest.raises(ValueError, match=needle) as err:
            RolloutDataModule(**kwargs)
        assert "\n" not in str(err.value)
    assert RolloutDataModule(engine="server", engine_options={"url": "http://127.0.0.1:1", "token": "t" * 32}
                             ).sampler_check.max_gap == DEFAULT_MAX_GAP
    assert RolloutDataModule().sampler_check is None  # the in-process engine is the trainer's own code
    assert RolloutDataModule(engine="server", engine_options={"url": "http://127.0.0.1:1", "token": "t" * 32},
                             sampler_check_max_gap=None).sampler_check is None


def test_a_rejoined_server_arms_the_check_again_and_its_completions_are_checked_first(tiny):
    """A rollout server that rejoined the fleet (restarted, pushed the weights anew) gets the first-push check again:
    the next call checks, its completions first, and a refusal names it."""
    from dataclasses import replace

    model, tokenizer, prompts = tiny
    groups = sampled(model, tokenizer, prompts, 1.0)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    wrong = sampled(other, tokenizer, prompts, 1.0)
    # the first prompt's completions from the server that was always up, the last prompt's from the rejoined one,
    # sampled by weights the push never delivered
    mixed = [[replace(c, server="http://up") for c in groups[0]], [replace(c, server="http://up") for c in groups[1]],
             [replace(c, server="http://back") for c in wrong[2]]]
    sampler = SamplerCheck(sequences=2)
    sampler.rearm(rejoined_servers(object()))  # an engine without a fleet has none
    assert sampler(model, prompts[:2], mixed[:2], 1.0, torch.device("cpu"), "servers", nullcontext).mean_gap < 1e-5
    assert sampler.done
    sampler.rearm([])  # no server rejoined: nothing to check
    assert sampler.done
    sampler.rearm(["http://back"])
    assert not sampler.done
    with pytest.raises(SamplerMismatchError, match=r"right after the push that brought back http://back its "
                                                   r"log-probs differ"):
        sampler(model, prompts, mixed, 1.0, torch.device("cpu"), "servers", nullcontext)
    # in prompt order (without the rejoin) the two completions checked are the first prompt's, which match
    assert SamplerCheck(sequences=2)(model, prompts, mixed, 1.0, torch.device("cpu"), "servers",
                                     nullcontext).mean_gap < 1e-5

