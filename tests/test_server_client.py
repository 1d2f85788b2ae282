"""``ServerEngine``'s generation in two steps: ``request_rollouts`` (HTTP only, safe on a background thread)
and ``check_lockstep`` (the ranks' agreement, on the training thread). A fake HTTP layer stands in for the server."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.remote.client import Rollouts, ServerEngine
from lit_grpo.wire.protocol import HTTPClient, ServerError

URL = "http://10.1.2.3:8765"
SAMPLING = SamplingConfig(max_new_tokens=4)


@pytest.fixture
def server(monkeypatch):
    """A server of float32 weights at version "5" that answers completions with one token per prompt and
    completion, or a 500 when ``state["fail"]``."""
    state = {"fail": False, "threads": set()}

    def request(self, method, path, body=None, query=None, timeout_s=None, headers=None):  # noqa: ANN001, ANN202
        if path == "/weight_info":
            return {"dtypes": ["float32"], "transfer_group": True, "weight_version": "5"}
        assert path == "/v1/completions"
        state["threads"].add(threading.current_thread().name)
        if state["fail"]:
            raise ServerError(f"rollout server {URL}: POST /v1/completions returned 500: boom", status=500)
        choices = [{"index": i, "token_ids": [7 + i], "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length",
                    "weight_versions": [{"version": "5", "start": 0, "end": 1}]}
                   for i in range(len(body["prompt"]) * body["n"])]
        return {"choices": choices, "weight_version": "5"}

    monkeypatch.setattr(HTTPClient, "request", request)
    engine = ServerEngine(url=URL, token="t" * 32)
    engine.servers[0].expected_version = "5"  # as after a push of step 5
    return engine, state


def test_request_rollouts_on_a_background_thread_then_check_lockstep(server):
    engine, state = server
    assert not dist.is_initialized()
    box = {}
    thread = threading.Thread(target=lambda: box.update(r=engine.request_rollouts([[1, 2], [3]], 2, SAMPLING, 9)),
                              name="producer")
    thread.start()
    thread.join(30)
    rollouts = box["r"]
    assert isinstance(rollouts, Rollouts) and rollouts.error is None
    groups = engine.check_lockstep(rollouts)
    assert [[c.token_ids for c in g] for g in groups] == [[[7], [8]], [[9], [10]]]
    assert all(c.truncated and c.logprobs == [-0.5] for g in groups for c in g)
    assert state["threads"] and "MainThread" not in state["threads"]  # sent from worker threads, not the caller
    assert [[c.token_ids for c in g] for g in engine.generate([[1, 2], [3]], 2, SAMPLING, 9)] == \
        [[[7], [8]], [[9], [10]]]


def test_a_failed_request_is_returned_then_raised_by_check_lockstep(server):
    engine, state = server
    state["fail"] = True
    rollouts = engine.request_rollouts([[1]], 2, SAMPLING, 3)  # does not raise: the ranks must agree first
    assert rollouts.groups is None and rollouts.error.startswith(f"rollout server {URL}: POST /v1/completions")
    with pytest.raises(ServerError, match="returned 500: boom"):
        engine.check_lockstep(rollouts)
    with pytest.raises(ServerError, match="returned 500: boom"):
        engine.generate([[1]], 2, SAMPLING, 3)


def test_bad_arguments_raise_before_any_request(server):
    engine, state = server
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        engine.request_rollouts([[1]], 0, SAMPLING, 3)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        engine.request_rollouts([[1], []], 2, SAMPLING, 3)
    assert not state["threads"]


def test_a_version_the_trainer_did_not_push_is_an_error(server):
    engine, _ = server
    engine.servers[0].expected_version = "4"
    rollouts = engine.request_rollouts([[1]], 1, SAMPLING, 3)
    assert "sampled with weight version ['5'], but this trainer pushed version '4'" in rollouts.error


def test_a_completion_without_versions_is_refused_when_a_push_began_while_it_was_sampled():
    from lit_grpo.engines.remote.client import ServerEngine
    from lit_grpo.engines.remote.connection import ServerConnection
    from lit_grpo.wire.protocol import ServerError

    engine = ServerEngine.__new__(ServerEngine)  # only what reading an answer needs
    engine.partial_rollouts, engine.pushes_started = False, 4
    server = ServerConnection("http://127.0.0.1:9", None, 1.0)
    server.expected_version = "7"
    answer = {"choices": [{"index": 0, "token_ids": [5, 6], "logprobs": {"token_logprobs": [-0.1, -0.2]},
                           "finish_reason": "stop"}], "weight_version": "7"}  # no weight_versions spans
    (group,) = engine._groups(server, answer, 1, 1, pushes=4)  # no push began: the server's version labels it
    assert group[0].versions == ("7",)
    with pytest.raises(ServerError, match="began a weight push while they were sampled"):
        engine._groups(server, answer, 1, 1, pushes=3)
