"""Two rollout servers as real processes on the loopback, a 2-rank DDP fit on multi-turn trajectories against both.
Each group of trajectories is a session: its first turn goes to the least-loaded server, every later turn to the
same server, and it is released when its last trajectory ends. Twice:

- plain URLs (``data.engine_options.urls``): the trainer routes (``lit_grpo.engines.remote.session_routing``) and
  logs the sequences each server got;
- through ``vllm-router`` (``python -m lit_grpo route``, ``router_url``): the trainer names each session in
  ``X-Session-ID`` and finishes it at the router; the servers' request logs say which server took which session.

Every request the trainers send and every session they release is recorded (``routing_worker.py``)."""

from __future__ import annotations

import json
from unittest import mock

import pytest
from distributed_launch import free_port
from multi_turn_helpers import multi_turn_data, stopping_tiny_llama
from route_process import RouteProcess
from server_process import ServerProcess

pytestmark = pytest.mark.slow  # an end-to-end tier of its own: python -m pytest -m slow


def distinct_task(path, rows: int = 40):  # noqa: ANN001, ANN201
    """``TwoTurns`` rows with distinct targets, so that no two groups share a prompt."""
    path.write_text("\n".join(json.dumps({"target": 10 + i}) for i in range(rows)) + "\n")
    return path


def two_rank_fit(root, model: str, task, engine_options: dict) -> tuple[list[dict], list[list[dict]]]:  # noqa: ANN001
    """A 2-rank DDP fit of 3 steps on ``task`` through ``routing_worker.py``: each rank's results and records."""
    import distributed_launch

    job = dict(strategy="ddp", max_steps=3, module=dict(beta=0.1, lr=1e-2, model_name=model),
               data=multi_turn_data(task, prompts_per_step=3), server=engine_options)
    with mock.patch.object(distributed_launch, "WORKER", distributed_launch.WORKER.with_name("routing_worker.py")):
        results = distributed_launch.launch([job], world=2, workdir=root / "two", timeout_s=400)
    records = [[json.loads(line) for line in (root / "two" / f"requests.{rank}.jsonl").read_text().splitlines()]
               for rank in range(2)]
    return [r[0] for r in results], records


TOKEN = "r" * 32


@pytest.fixture(scope="module")
def fit(tmp_path_factory):
    root = tmp_path_factory.mktemp("routing")
    model, task = str(stopping_tiny_llama(root / "model")), distinct_task(root / "task.jsonl")
    servers = [ServerProcess(root / f"server{i}", model=model, token=TOKEN, port=free_port()) for i in range(2)]
    try:
        results, records = two_rank_fit(root, model, task, dict(urls=[s.url for s in servers], token=TOKEN,
                                                                  timeout_s=60, bucket_mb=0.05))
        yield results, records, [s.url for s in servers]
    finally:
        for server in servers:
            server.kill()


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
    root = tmp_path_factory.mktemp("routed")
    model, task = str(stopping_tiny_llama(root / "model")), distinct_task(root / "task.jsonl")
    servers = [ServerProcess(root / f"server{i}", model=model, token=TOKEN, port=free_port(),
                             args=("--log-requests",)) for i in range(2)]
    router = None
    try:
        for server in servers:
            server.wait_ready()
        router = RouteProcess(root, [s.url for s in servers], TOKEN)
        router.wait_ready()
        results, records = two_rank_fit(root, model, task, dict(urls=[s.url for s in servers], router_url=router.url,
                                                                  token=TOKEN, timeout_s=60, bucket_mb=0.05))
        logs = [s.log_path.read_text() for s in servers]
        yield results, records, logs, router
    finally:
        if router is not None:
            router.kill()
        for server in servers:
            server.kill()


def test_every_turn_of_a_trajectory_goes_to_the_server_of_its_first_turn(fit):
    _, requests, urls = fit
    for rank_requests in requests:
        first_turn: dict[tuple[int, ...], str] = {}
        later = []
        released = [s for record in rank_requests for s in record.get("released", [])]
        for request in (r for r in rank_requests if "released" not in r):
            for prompt in request["prompts"]:
                if request["n"] > 1:  # a group's first turn: its prompt, G completions
                    assert tuple(prompt) not in first_turn
                    first_turn[tuple(prompt)] = request["url"]
                else:
                    later.append((tuple(prompt), request["url"]))
        assert later, "no trajectory had a second turn"
        for prompt, url in later:
            (start,) = [p for p in first_turn if prompt[: len(p)] == p]
            assert url == first_turn[start]
        # the first turns spread: 3 groups of 4 over two servers, the least-loaded first
        assert set(first_turn.values()) == set(urls)
        assert len(released) == len(set(released)) == len(first_turn)  # each group's session released once


def test_both_servers_are_logged_and_the_fit_trains(fit):
    results, _, _ = fit
    for rank in results:
        assert len(rank["steps"]) == 3
        for step in rank["steps"]:
            assert step["rollout/turns"] > 1.0 and step["rollout/env_errors"] == 0.0
            assert step["rollout/server_0_sequences"] > 0 and step["rollout/server_1_sequences"] > 0
            assert 1.0 <= step["rollout/server_load_ratio_max"] <= 2.0
            assert abs(step["train/loss"]) < 1e3
    # the ranks agree on the step's metrics (reduced over ranks)
    assert results[0]["steps"] == results[1]["steps"]


def test_through_the_router_every_session_stays_on_one_server_and_is_finished(routed):
    results, records, logs, router = routed
    sent = {}  # session id -> requests naming it
    released = set()
    for rank_records in records:
        for record in rank_records:
            if "released" in record:
                released.update(record["released"])
            else:
                assert record["url"] == router.url and record["session"]
                sent[record["session"]] = sent.get(record["session"], 0) + 1
    assert any(count > 1 for count in sent.values()), "no session had a second turn"
    assert released == set(sent)  # every session was finished at the router
    where = {}
    for server, log in enumerate(logs):
        for line in log.splitlines():
            if "POST /v1/completions" in line and "session=" in line:
                where.setdefault(line.rsplit("session=", 1)[1].strip(), set()).add(server)
    assert set(where) == set(sent)
    assert all(len(servers) == 1 for servers in where.values()), where  # sticky
    assert {s for servers in where.values() for s in servers} == {0, 1}  # least-loaded: both got sessions
    for rank in results:
        assert len(rank["steps"]) == 3
        assert all(step["rollout/turns"] > 1.0 and step["rollout/env_errors"] == 0.0 for step in rank["steps"])


def test_the_router_refuses_a_request_without_the_servers_token(routed):
    _, _, _, router = routed
    assert router.call("/health", None) == 401
    workers = router.answer("/list_workers", TOKEN)
    assert workers[0] == 200
    assert router.call("/add_worker?url=http://127.0.0.1:9", "x" * 32, method="POST") == 401
    assert router.call("/remove_worker?url=" + json.loads(workers[1])["urls"][0], None, method="POST") == 401
    assert router.answer("/list_workers", TOKEN) == workers  # the refused requests changed nothing
