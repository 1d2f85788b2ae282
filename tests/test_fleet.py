"""The fleet survives (``lit_grpo.engines.remote.fleet``): over two project servers on a plain URL list, one killed
with SIGKILL mid-run and restarted at its URL costs retries, not the run. Its requests go, as they were, to the other
server; it rejoins at the next push, with the current weights, before it gets work; and the fit trains exactly like
the clean run (the same per-step losses), because a request's seed belongs to its place in the layout, not to its
server. With every server down the fit stops within its timeout, in one line naming them. Real processes: two
trainer ranks (FSDP2 on gloo) and the servers, on the loopback."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from distributed_launch import assert_same_steps, free_port, launch, launch_to_the_end
from server_process import ServerProcess

from lit_grpo.engines.remote.fleet import Fleet, NoServerUp, ServerDown
from lit_grpo.wire.protocol import ServerError

JOB = dict(strategy="fsdp2", v=1, max_steps=14, module=dict(beta=0.1, lr=1e-2), data=dict(prompts_per_step=2))


def fleet_options(servers: list[ServerProcess]) -> dict:
    return dict(urls=[s.url for s in servers], token=servers[0].token, timeout_s=30, bucket_mb=0.05)


def restart_when_dead(server: ServerProcess, delay_s: float, out: dict, args: tuple[str, ...] = ()) -> threading.Thread:
    """A thread that waits for ``server`` to die, then starts a new server process at its port after ``delay_s``."""
    def run() -> None:
        while server.proc.poll() is None:
            time.sleep(0.05)
        out["killed_at"] = time.monotonic()
        time.sleep(delay_s)
        port = int(server.url.rsplit(":", 1)[1])
        again = ServerProcess(server.workdir.parent / "restarted", port=port, token=server.token, args=args)
        again.wait_ready()
        out["server"], out["back_at"] = again, time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow  # real server and trainer processes
def test_a_killed_and_restarted_server_costs_retries_and_the_fit_trains_as_the_clean_run(tmp_path):
    """With pi_ref scored on the servers (``data.reference_on_server``; the chaos test below scores it on the
    trainer): the restarted server gets the current pi_ref right after the push that brings it back, so every
    batch's pi_ref is still the servers', and the sampler check takes the first batch after that push again."""
    token = "f" * 32
    servers = [ServerProcess(tmp_path / f"server{i}", port=free_port(), token=token) for i in range(2)]
    restarted: dict = {}
    job = dict(JOB, data=dict(JOB["data"], reference_on_server=True))
    try:
        for server in servers:
            server.wait_ready()
        clean = launch([dict(job, server=fleet_options(servers))], world=2, workdir=tmp_path / "clean",
                       timeout_s=600)
        watcher = restart_when_dead(servers[1], 0.5, restarted)
        # killed after step 2, back (waited for) after step 8: the push of step 9 brings it in
        survived = launch([dict(job, server=fleet_options(servers),
                                kill_server=dict(pid=servers[1].proc.pid, after_batch=2),
                                wait_for_servers=dict(urls=[servers[1].url], at_step=8))],
                          world=2, workdir=tmp_path / "killed", timeout_s=600)
        watcher.join(120)
    finally:
        for server in [*servers, restarted.get("server")]:
            if server is not None:
                server.kill()
    for rank in range(2):
        steps = survived[rank][0]["steps"]
        assert len(steps) == JOB["max_steps"]

        def trained(steps: list[dict]) -> list[dict]:  # what the fit computed, not how many servers served it
            return [{k: v for k, v in s.items() if k != "rollout/servers_up"} for s in steps]

        assert_same_steps(trained(clean[rank][0]["steps"]), trained(steps))
        # one server up after the kill, both again once the restarted one took a push
        up = [s["rollout/servers_up"] for s in steps]
        assert up[0] == 2.0 and 1.0 in up and up[-1] == 2.0, up
        # the sampler check ran on the first batch of pushed weights, and again on the first after the rejoin
        checks = survived[rank][0]["sampler_checks"]
        back = up.index(2.0, up.index(1.0))
        assert checks == [1.0] * back + [2.0] * (len(steps) - back), (checks, up)
        assert clean[rank][0]["sampler_checks"] == [1.0] * len(steps)
        # every batch's pi_ref scored by a server, the rejoined one's included
        assert all(s["train/reference_served"] == 1.0 for s in steps), [s["train/reference_served"] for s in steps]


@pytest.mark.slow  # real server, router and trainer processes
def test_through_the_router_a_killed_server_leaves_its_list_and_returns_only_after_a_push(tmp_path):
    """The same kill and restart behind ``python -m lit_grpo route`` (vllm-router, its retries off): the router
    answers a request for the dead server with a 500, the trainer finds the server down, takes it out of the
    router's list and sends the request again; the restarted server is put back in the list only by the push that
    reached it, so it never samples with its start-up weights (the fit would stop on the version check), and the
    fit trains exactly like a clean run through the router."""
    pytest.importorskip("vllm_router")
    from route_process import RouteProcess

    token = "g" * 32
    servers = [ServerProcess(tmp_path / f"server{i}", port=free_port(), token=token, args=("--log-requests",))
               for i in range(2)]
    restarted: dict = {}
    router = watcher = None
    try:
        for server in servers:
            server.wait_ready()
        router = RouteProcess(tmp_path, [s.url for s in servers], token)
        router.wait_ready()
        options = dict(fleet_options(servers), router_url=router.url)
        clean = launch([dict(JOB, server=options)], world=2, workdir=tmp_path / "clean", timeout_s=600)
        watcher = restart_when_dead(servers[1], 0.5, restarted, args=("--log-requests",))
        survived = launch([dict(JOB, server=options, kill_server=dict(pid=servers[1].proc.pid, after_batch=2),
                                wait_for_servers=dict(urls=[servers[1].url], at_step=8))],
                          world=2, workdir=tmp_path / "killed", timeout_s=600)
        watcher.join(120)
        workers = router.workers()
    finally:
        # killed: let its restart finish, so that no server outlives the test
        if watcher is not None and servers[1].proc.poll() is not None:
            watcher.join(120)
        for process in [router, *servers, restarted.get("server")]:
            if process is not None:
                process.kill()
    assert sorted(workers) == sorted(s.url for s in servers)  # back in the router's list at the end
    for rank in range(2):
        steps = survived[rank][0]["steps"]
        assert len(steps) == JOB["max_steps"]
        trained = [[{k: v for k, v in s.items() if k != "rollout/servers_up"} for s in run[rank][0]["steps"]]
                   for run in (clean, survived)]
        assert_same_steps(*trained)
        up = [s["rollout/servers_up"] for s in steps]
        assert up[0] == 2.0 and 1.0 in up and up[-1] == 2.0, up
    # the restarted server took its first push before its first request, and then served requests
    lines = (restarted["server"].workdir / "server.log").read_text().splitlines()
    routes = [line.split('"')[1].split()[1] for line in lines if '"' in line]
    served = [i for i, route in enumerate(routes) if route == "/v1/completions"]
    pushed = [i for i, route in enumerate(routes) if route not in ("/health", "/weight_info", "/v1/completions")]
    assert served and pushed and pushed[0] < served[0], routes


@pytest.mark.slow
def test_chaos_servers_killed_and_restarted_at_seeded_points_leave_the_fit_as_the_clean_run(tmp_path):
    """Three servers; two of them, drawn with a seed, killed with SIGKILL after steps drawn with it, each restarted
    at its URL after a drawn delay (bounded: two kills in the fit, at most two servers down at once, never all)."""
    import random

    rng = random.Random(20261202)
    token = "c" * 32
    servers = [ServerProcess(tmp_path / f"server{i}", port=free_port(), token=token) for i in range(3)]
    victims = rng.sample(range(3), 2)
    steps = sorted(rng.sample(range(2, JOB["max_steps"] - 4), 2))
    restarted: list[dict] = [{} for _ in victims]
    try:
        for server in servers:
            server.wait_ready()
        start = time.monotonic()
        clean = launch([dict(JOB, server=fleet_options(servers))], world=2, workdir=tmp_path / "clean",
                       timeout_s=600)
        clean_seconds = time.monotonic() - start
        watchers = [restart_when_dead(servers[v], rng.uniform(0.2, 1.5), out) for v, out in zip(victims, restarted)]
        kills = [dict(pid=servers[v].proc.pid, after_batch=step) for v, step in zip(victims, steps)]
        start = time.monotonic()
        chaos = launch([dict(JOB, server=fleet_options(servers), kill_servers=kills,
                             wait_for_servers=dict(urls=[s.url for s in servers], at_step=JOB["max_steps"] - 2))],
                       world=2, workdir=tmp_path / "chaos", timeout_s=600)
        seconds = time.monotonic() - start
        for watcher in watchers:
            watcher.join(120)
    finally:
        for server in [*servers, *(out.get("server") for out in restarted)]:
            if server is not None:
                server.kill()
    print(f"chaos: servers {victims} killed after steps {steps}, the fit took {seconds:.1f} s "
          f"(the clean one {clean_seconds:.1f} s)")
    for rank in range(2):
        up = [s.pop("rollout/servers_up") for s in chaos[rank][0]["steps"]]
        for s in clean[rank][0]["steps"]:
            s.pop("rollout/servers_up")
        assert_same_steps(clean[rank][0]["steps"], chaos[rank][0]["steps"])
        assert min(up) < 3.0 and up[0] == 3.0 and up[-1] == 3.0, up


@pytest.mark.slow
def test_every_server_down_stops_the_fit_within_its_timeout_in_one_line(tmp_path):
    server = ServerProcess(tmp_path / "server", port=free_port())
    try:
        server.wait_ready()
        job = dict(JOB, max_steps=4, server=dict(fleet_options([server]), timeout_s=10),
                   kill_server=dict(pid=server.proc.pid, after_batch=1))
        codes, logs, elapsed = launch_to_the_end([job], world=2, workdir=tmp_path / "run", timeout_s=240)
    finally:
        server.kill()
    assert None not in codes and all(code != 0 for code in codes), codes
    for log in logs:
        assert f"every rollout server is down ({server.url})" in log, log[-3000:]
    assert elapsed < 120


class Stub:
    """A connection whose calls fail as scripted: ``lost`` connections, then answers."""

    def __init__(self, url: str, failures: int = 0) -> None:
        self.url, self.failures, self.calls, self.expected_version = url, failures, 0, None

    def answer(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise ServerError(f"rollout server {self.url}: POST /v1/completions failed: refused", lost=True)
        return self.url


def test_a_lost_connection_is_retried_then_the_request_goes_to_the_next_server_up(monkeypatch):
    monkeypatch.setattr(Fleet, "probe", lambda self, server: None)  # between tries, no server answers a probe
    a, b = Stub("http://a", failures=2), Stub("http://b")
    fleet = Fleet([a, b], timeout_s=1.0, delays_s=(0.0, 0.0))
    # two lost connections, then an answer: retried on the same server, which stays up
    assert fleet.on_any(a, lambda s: s.answer()) == "http://a" and fleet.stats()["servers_up"] == 2.0
    dead = Stub("http://dead", failures=10**6)
    fleet = Fleet([dead, b], timeout_s=1.0, delays_s=(0.0, 0.0))
    with pytest.warns(UserWarning, match=r"rollout server http://dead is down .*taken out of routing"):
        assert fleet.on_any(dead, lambda s: s.answer()) == "http://b"
    assert dead.calls == 3 and fleet.stats()["servers_up"] == 1.0
    assert fleet.on_any(dead, lambda s: s.answer()) == "http://b" and dead.calls == 3  # no longer tried
    with pytest.raises(ServerDown):
        fleet.call(dead, lambda s: s.answer())


def test_other_errors_fail_as_before():
    def refuse(server):  # noqa: ANN001, ANN202
        raise ServerError(f"rollout server {server.url}: POST /v1/completions returned 400: bad", status=400)

    fleet = Fleet([Stub("http://a"), Stub("http://b")], timeout_s=1.0, delays_s=(0.0,))
    with pytest.raises(ServerError, match="returned 400"):
        fleet.on_any(fleet.servers[0], refuse)
    assert fleet.stats()["servers_up"] == 2.0


def test_with_none_up_a_request_waits_its_timeout_then_one_line_names_every_server(monkeypatch):
    a, b = Stub("http://a", failures=10**6), Stub("http://b", failures=10**6)
    fleet = Fleet([a, b], timeout_s=0.3, delays_s=(0.0,))
    monkeypatch.setattr(fleet, "probe", lambda server: None)
    with pytest.warns(UserWarning), pytest.raises(NoServerUp, match=r"^every rollout server is down \(http://a, "
                                                                      r"http://b\), none answered"):
        fleet.on_any(a, lambda s: s.answer())


def test_a_server_that_comes_back_with_other_weights_is_down_until_a_push_reaches_it(monkeypatch):
    restarted, other = Stub("http://restarted", failures=1), Stub("http://other")
    restarted.expected_version = "7"
    fleet = Fleet([restarted, other], timeout_s=1.0, delays_s=(0.0, 0.0))
    monkeypatch.setattr(fleet, "probe", lambda server: "0" if server is restarted else "7")
    with pytest.warns(UserWarning, match=r"it restarted: it holds weight version '0', not the pushed '7'"):
        assert fleet.on_any(restarted, lambda s: s.answer()) == "http://other"
    assert restarted.calls == 1  # not asked again for work: a fresh server would answer with its own weights


class Scorer(Stub):
    """A server that scores pi_ref: it holds ``reference_version`` and answers each micro-batch with ``value``."""

    def __init__(self, url: str, version: str | None, value: float, failures: int = 0) -> None:
        super().__init__(url, failures)
        self.reference_version, self.value, self.client = version, value, self

    def post(self, path: str, body: dict, timeout_s: float) -> dict:
        self.answer()
        (mb,) = body["micro_batches"]
        shape = (len(mb["completion_ids"]), len(mb["completion_ids"][0]))
        return {"reference_version": body["reference_version"], "logprobs": [torch.full(shape, self.value).tolist()]}


def micro_batch(rows: list[int], width: int):  # noqa: ANN201
    from types import SimpleNamespace

    ids = torch.ones(len(rows), width, dtype=torch.long)
    return SimpleNamespace(rows=torch.tensor(rows), prompt_ids=ids, prompt_mask=ids, prompt_index=torch.tensor(rows),
                           completion_ids=ids, completion_mask=ids)


def test_pi_ref_is_scored_by_the_first_server_up_that_holds_it_and_a_lost_one_hands_the_batch_on():
    from lit_grpo.engines.remote.reference_client import ReferenceClient

    stale = Scorer("http://stale", "0", value=-9.0)  # rejoined: its own start-up pi_ref, not the current one
    lost = Scorer("http://lost", "1", value=-8.0, failures=10**6)
    holder = Scorer("http://holder", "1", value=-1.5)
    fleet = Fleet([stale, lost, holder], timeout_s=1.0, delays_s=(0.0,))
    fleet.probe = lambda server: None  # noqa: ARG005 (no server answers between tries)
    client = ReferenceClient(fleet, timeout_s=1.0)
    with pytest.warns(UserWarning, match=r"rollout server http://lost is down"):
        scores, version = client.score([micro_batch([0, 1], 3), micro_batch([2], 3)], 3, 4, 1.0, None, "1")
    assert version == "1" and stale.calls == 0 and lost.calls == 2 and holder.calls == 2
    assert torch.equal(scores[:, :3], torch.full((3, 3), -1.5)) and torch.equal(scores[:, 3], torch.zeros(3))
    holder.reference_version = "0"
    with pytest.raises(ServerError, match=r"^no rollout server up holds pi_ref version '1' \(http://stale, "
                                          r"http://lost, http://holder\)"):
        client.score([micro_batch([0], 3)], 1, 3, 1.0, None, "1")


class RouterStub:
    """A router's worker list (``RouterConnection``'s membership calls), recorded."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.calls = list(urls), []

    def remove_worker(self, url: str) -> None:
        self.calls.append(("remove", url))
        self.urls = [u for u in self.urls if u != url]

    def add_worker(self, url: str) -> None:
        self.calls.append(("add", url))
        self.urls.append(url)


def test_through_a_router_a_server_it_cannot_reach_leaves_its_list_and_returns_after_a_push(monkeypatch):
    a, b = Stub("http://a"), Stub("http://b")
    fleet = Fleet([a, b], timeout_s=1.0, delays_s=(0.0, 0.0))
    fleet.router = router = RouterStub(["http://a", "http://b"])
    monkeypatch.setattr(fleet, "probe", lambda server: None if server is b else "1")
    answers = iter([ServerError("rollout server http://r: POST /v1/completions returned 500: Internal Server Error",
                                status=500), "done"])

    def through() -> str:
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    # vllm-router's 500 for a worker it could not reach: b does not answer a probe, leaves the list, and the
    # request goes again (to a, the only one left in the router's list)
    with pytest.warns(UserWarning, match=r"rollout server http://b is down \(the router could not reach it"):
        assert fleet.through_router(through) == "done"
    assert router.calls == [("remove", "http://b")] and router.urls == ["http://a"]
    assert fleet.stats()["servers_up"] == 1.0
    fleet.apply([], rejoin=True)  # a push reached b: back in the router's list, not before
    assert router.calls[-1] == ("add", "http://b") and fleet.stats()["servers_up"] == 2.0
    # a push that leaves a server out takes it out of the router's list too
    with pytest.warns(UserWarning, match="did not take the weight push"):
        fleet.apply(["http://a"], rejoin=True)
    assert router.calls[-1] == ("remove", "http://a")


def test_through_a_router_an_error_with_every_server_answering_fails_as_before(monkeypatch):
    fleet = Fleet([Stub("http://a"), Stub("http://b")], timeout_s=1.0, delays_s=(0.0, 0.0))
    fleet.router = router = RouterStub(["http://a", "http://b"])
    monkeypatch.setattr(fleet, "probe", lambda server: "1")
    calls = []

    def fail(status: int | None, lost: bool = False):  # noqa: ANN202
        def call() -> str:
            calls.append(status)
            raise ServerError(f"rollout server http://r: POST /v1/completions returned {status}", status=status,
                              lost=lost)
        return call

    for status in (500, 400, 503):
        with pytest.raises(ServerError, match=f"returned {status}"):
            fleet.through_router(fail(status))
    assert calls == [500, 400, 503] and router.calls == [] and fleet.stats()["servers_up"] == 2.0
    calls.clear()
    with pytest.raises(ServerError):  # the router itself unreachable: tried again after each delay, then raised
        fleet.through_router(fail(None, lost=True))
    assert len(calls) == 3


def test_the_router_connection_adds_and_removes_workers_and_an_existing_one_is_no_error(monkeypatch):
    from lit_grpo.engines.remote.connection import RouterConnection

    router = RouterConnection("http://127.0.0.1:9", "t" * 32, 1.0, [])
    sent = []

    def text(method: str, path: str, query: dict | None = None, **_: object) -> str:
        sent.append((method, path, query))
        if path == "/add_worker" and len(sent) > 1:
            raise ServerError("rollout server http://127.0.0.1:9: POST /add_worker returned 400: Bad Request",
                              status=400)
        if path == "/remove_worker" and len(sent) > 2:
            raise ServerError("rollout server http://127.0.0.1:9: POST /remove_worker failed: refused", lost=True)
        return "Successfully added worker"

    monkeypatch.setattr(router.client, "text", text)
    router.add_worker("http://a:1")
    router.add_worker("http://a:1")  # another rank added it first: vllm-router's 400 "already exists"
    with pytest.warns(UserWarning, match=r"^the router http://127.0.0.1:9 did not remove worker http://a:1: "):
        router.remove_worker("http://a:1")
    assert sent == [("POST", "/add_worker", {"url": "http://a:1"})] * 2 + [("POST", "/remove_worker",
                                                                               {"url": "http://a:1"})]
