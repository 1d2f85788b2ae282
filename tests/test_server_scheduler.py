"""The rollout server's one decode loop (``lit_grpo.serve.scheduler``): requests in flight at once share its running
batch (at most ``--max-num-seqs`` rows), each keeping the completions it gets alone; requests of another sampling
key wait for the batch to empty; a ``keep`` pause parks every request the loop holds, an abort ends them, and a
failure inside decoding fails the requests it held, not the server."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lit_grpo.serve.server import RolloutServer
from lit_grpo.wire.protocol import HTTPFailure

LONG_PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]
SHORT_PROMPTS = [[14, 15], [3, 4, 5, 6, 7], [8]]


@pytest.fixture(scope="module")
def tiny():
    from lit_grpo.models.loading import load_model_and_tokenizer

    torch.set_num_threads(1)
    return load_model_and_tokenizer("tiny-random-llama")


def served(tiny, max_num_seqs=None) -> RolloutServer:  # noqa: ANN001
    model, tokenizer = tiny
    server = RolloutServer(model, tokenizer, "tiny-random-llama", "t" * 32, max_num_seqs=max_num_seqs)
    server.policy.set_version("1")
    return server


def body(prompts, n, max_tokens, seed, **extra) -> dict:  # noqa: ANN001
    return {"prompt": prompts, "n": n, "max_tokens": max_tokens, "seed": seed, "logprobs": 0,
            "return_token_ids": True, "return_weight_versions": True, **extra}


class RowsSeen:
    """The batch sizes of the model's forwards (decode steps have one input column)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.decode: list[int] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:  # noqa: ANN001
        ids = kwargs["input_ids"]
        if ids.shape[1] == 1:
            self.decode.append(int(ids.shape[0]))


def concurrently(server: RolloutServer, first: dict, second: dict) -> tuple[dict, dict]:
    """``first`` on a thread, then ``second`` once the loop decodes ``first``'s rows; both answers."""
    out: dict[str, object] = {}

    def run(name: str, request: dict) -> None:
        try:
            out[name] = server.generation.completions(dict(request), {})
        except HTTPFailure as err:
            out[name] = err

    thread = threading.Thread(target=run, args=("first", first))
    thread.start()
    deadline = time.monotonic() + 30
    while server.generation.scheduler.peak_rows == 0:
        assert time.monotonic() < deadline, "the first request never decoded"
        time.sleep(0.001)
    run("second", second)
    thread.join(60)
    return out["first"], out["second"]


def two_in_flight(server: RolloutServer, first: dict, second: dict) -> tuple[dict, list[threading.Thread]]:
    """``first`` and ``second`` on threads of their own, returned once both are held by the decode loop (the first
    decoding already); their answers (or ``HTTPFailure``) land in the dict under "a" and "b"."""
    answers: dict[str, object] = {}

    def run(name: str, request: dict) -> None:
        try:
            answers[name] = server.generation.completions(request, {})
        except HTTPFailure as err:
            answers[name] = err

    threads = [threading.Thread(target=run, args=(k, b)) for k, b in (("a", first), ("b", second))]
    threads[0].start()
    while server.generation.scheduler.peak_rows == 0:
        time.sleep(0.001)
    threads[1].start()
    while server.policy.in_flight < 2:
        time.sleep(0.001)
    return answers, threads


def tokens(answer: dict) -> list[list[int]]:
    return [c["token_ids"] for c in answer["choices"]]


def logprobs(answer: dict) -> list[list[float]]:
    return [c["logprobs"]["token_logprobs"] for c in answer["choices"]]


@pytest.mark.parametrize("max_num_seqs", [None, 5])
def test_requests_in_flight_share_one_batch_and_each_gets_its_completions_alone(tiny, max_num_seqs):
    first = body(LONG_PROMPTS, 4, 300, seed=1)
    second = body(SHORT_PROMPTS, 2, 40, seed=2)
    alone = served(tiny, max_num_seqs)
    first_alone = alone.generation.completions(dict(first), {})
    second_alone = alone.generation.completions(dict(second), {})
    seen = RowsSeen(tiny[0])
    try:
        first_shared, second_shared = concurrently(served(tiny, max_num_seqs), first, second)
    finally:
        seen.handle.remove()
    first_rows, second_rows = 8, 6
    if max_num_seqs is None:  # the second request's rows joined the running batch of the first's
        assert max(seen.decode) > first_rows
    else:
        assert max(seen.decode) <= max_num_seqs
    for shared, single, rows in ((first_shared, first_alone, first_rows), (second_shared, second_alone,
                                                                            second_rows)):
        assert len(shared["choices"]) == rows
        assert tokens(shared) == tokens(single)
        for got, expected in zip(logprobs(shared), logprobs(single)):
            assert got == pytest.approx(expected, abs=1e-5)
    assert len({len(t) for t in tokens(first_alone)}) > 1  # rows ended at different tokens: slots were freed


def test_a_request_of_another_sampling_key_waits_for_the_batch_and_keeps_its_completions(tiny):
    first = body(LONG_PROMPTS, 4, 200, seed=3)
    second = body(SHORT_PROMPTS, 2, 30, seed=4, temperature=0.5, top_p=0.9)
    alone = served(tiny)
    expected = [alone.generation.completions(dict(b), {}) for b in (first, second)]
    seen = RowsSeen(tiny[0])
    try:
        answers = concurrently(served(tiny), first, second)
    finally:
        seen.handle.remove()
    assert max(seen.decode) <= 8  # never one batch of both keys
    for got, want in zip(answers, expected):
        assert tokens(got) == tokens(want)


def test_a_keep_pause_parks_every_request_held_and_a_swap_runs_past_them(tiny):
    server = served(tiny)
    policy = server.policy
    answers, threads = two_in_flight(server, body(LONG_PROMPTS, 4, 400, seed=5), body(SHORT_PROMPTS, 2, 400, seed=6))
    time.sleep(0.05)  # a few tokens under version 1
    policy.pause(abort=False, keep=True)  # returns once both wait at a token boundary
    assert policy.in_flight == 2 and policy.parked == 2
    with policy.swapped():  # runs past the parked requests; a request not parked would hold it back
        policy.set_version("2")
    assert not answers
    policy.resume()
    for thread in threads:
        thread.join(60)
    versions = {span["version"] for a in answers.values() for c in a["choices"] for span in c["weight_versions"]}
    assert versions == {"1", "2"}
    for answer in answers.values():
        for c in answer["choices"]:
            spans = c["weight_versions"]
            assert spans[0]["start"] == 0 and spans[-1]["end"] == len(c["token_ids"])
            assert all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
    assert policy.parked == 0 and policy.in_flight == 0


def test_an_abort_ends_the_requests_parked_by_a_keep_pause(tiny):
    server = served(tiny)
    policy = server.policy
    answers, threads = two_in_flight(server, body(LONG_PROMPTS, 4, 1000, seed=12),
                                     body(SHORT_PROMPTS, 2, 1000, seed=13))
    policy.pause(abort=False, keep=True)
    assert policy.parked == 2
    policy.pause(abort=True)  # returns once both ended
    for thread in threads:
        thread.join(30)
    assert all(isinstance(a, HTTPFailure) and a.status == 503 for a in answers.values()), answers
    assert policy.in_flight == 0 and policy.parked == 0
    policy.resume()
    assert len(server.generation.completions(body(SHORT_PROMPTS, 1, 4, seed=14), {})["choices"]) == 3


def test_an_abort_ends_every_request_held_with_503_and_the_loop_serves_on(tiny):
    server = served(tiny)
    policy = server.generation.scheduler.policy
    long_request = body(LONG_PROMPTS, 4, 1000, seed=7)

    def abort_soon() -> None:  # as soon as both are held: long before their 14 rows could all end
        while policy.in_flight < 2:
            time.sleep(0.001)
        policy.pause(abort=True)

    aborter = threading.Thread(target=abort_soon)
    aborter.start()
    first, second = concurrently(server, long_request, body(SHORT_PROMPTS, 2, 1000, seed=8))
    aborter.join(30)
    for answer in (first, second):
        assert isinstance(answer, HTTPFailure) and answer.status == 503, answer
    assert policy.in_flight == 0
    policy.resume()
    again = server.generation.completions(body(SHORT_PROMPTS, 2, 8, seed=9), {})
    assert len(again["choices"]) == 6


def test_a_failure_inside_decoding_fails_the_requests_held_and_the_next_request_is_served(tiny, capsys):
    server = served(tiny)
    model = tiny[0]
    calls = [0]

    def fail_once(module, args, kwargs) -> None:  # noqa: ANN001
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected")

    handle = model.register_forward_pre_hook(fail_once, with_kwargs=True)
    try:
        with pytest.raises(HTTPFailure) as failed:
            server.generation.completions(body(LONG_PROMPTS, 2, 50, seed=10), {})
        answer = server.generation.completions(body(SHORT_PROMPTS, 1, 5, seed=11), {})
    finally:
        handle.remove()
    assert failed.value.status == 500 and "RuntimeError: injected" in failed.value.message
    assert len(answer["choices"]) == 3
    assert server.policy.in_flight == 0
