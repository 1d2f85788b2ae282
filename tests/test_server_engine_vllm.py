"""``ServerEngine(kind="vllm")`` against stand-ins: a fake ``vllm.distributed.weight_transfer`` shaped like vLLM
0.33's trainer side (``NCCLTrainerInitInfo``, ``WeightTransferTrainerFactory.trainer_init``,
``HTTPVLLMWeightSyncClient``, ``WeightSource``/``ParamMeta``; its ``send_weights`` follows
``NCCLTrainerWeightTransferEngine.send_weights``: start, update alongside the broadcast, finish without a version;
``base``'s ``TrainerInitInfo`` and ``TrainerWeightTransferEngine``, which the gloo plugin builds on) and a fake
``vllm serve`` HTTP server that records every route, query and body. No GPU, no vLLM."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import types
import urllib.request
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest
import torch

from lit_grpo.data.producer import RolloutProducer
from lit_grpo.engines.base import SamplingConfig
from lit_grpo.engines.remote.client import ServerEngine
from lit_grpo.engines.vllm_engine import prompt_seed
from lit_grpo.models.loading import tiny_llama
from lit_grpo.models.lora import LoraArgs, adapter_update, apply_lora
from lit_grpo.wire.protocol import ServerError


# ---- fake vllm.distributed.weight_transfer -----------------------------------------------------------
@dataclass(frozen=True)
class ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)


class WeightSource(ABC):
    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]: ...

    def iter_full(self):  # noqa: ANN201
        raise NotImplementedError

    def implements_iter_full(self) -> bool:
        return type(self).iter_full is not WeightSource.iter_full


class HTTPVLLMWeightSyncClient:
    """As vLLM's ``clients.py`` (urllib instead of requests)."""

    def __init__(self, base_url: str, timeout: float = 300) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _post(self, path: str, json_body: dict | None = None) -> None:
        data = json.dumps(json_body).encode() if json_body is not None else None
        request = urllib.request.Request(f"{self.base_url}/{path}", data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=self.timeout) as response:
            response.read()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version is not None else None)


@dataclass
class NCCLTrainerInitInfo:
    backend: ClassVar[str] = "nccl"
    master_address: str
    master_port: int
    world_size: int
    packed: bool = True
    rank: int = field(default=0, kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


@dataclass
class TrainerInitInfo:
    """``base.TrainerInitInfo``: the trainer rank, keyword-only; rank 0 sends."""

    backend: ClassVar[str]
    rank: int = field(kw_only=True)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


class TrainerWeightTransferEngine:
    """``base.TrainerWeightTransferEngine``: holds the client and the source; ``shutdown`` does nothing."""

    def __init__(self, *, client: Any, source: Any = None, is_sender: bool = True) -> None:
        self.client, self.source, self.is_sender = client, source, is_sender

    def shutdown(self) -> None:
        pass


class FakeTrainerEngine:
    """``NCCLTrainerWeightTransferEngine`` without NCCL: the "broadcast" records the tensors it would send;
    ``shutdown`` (its communicator's destroy) is counted."""

    instances: ClassVar[list] = []

    def __init__(self, client: Any, source: Any, info: NCCLTrainerInitInfo) -> None:
        self.client, self.source, self.info = client, source, info
        self.is_sender = info.is_sender
        self.rounds: list[list[tuple[str, torch.Tensor]]] = []
        self.shutdowns = 0
        FakeTrainerEngine.instances.append(self)

    def shutdown(self) -> None:
        self.shutdowns += 1

    @classmethod
    def trainer_init(cls, init_info: NCCLTrainerInitInfo, *, client: Any, source: Any) -> FakeTrainerEngine:
        assert source is not None and source.implements_iter_full()
        for m in source.metadata:
            assert m.owners is None or m.owners[0] == 0
        engine = cls(client, source, init_info)
        if engine.is_sender:
            payload = {"master_address": init_info.master_address, "master_port": init_info.master_port,
                       "rank_offset": 1, "world_size": init_info.world_size, "packed": init_info.packed}
            with ThreadPoolExecutor(max_workers=1) as executor:  # run_trainer_rendezvous
                future = executor.submit(client.init_weight_transfer_engine, payload)
                future.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata
        if not self.is_sender:
            for _ in self.source.iter_full():
                pass
            return
        update_info = {"names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
                       "shapes": [list(m.shape) for m in meta]}
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as executor:
            future = executor.submit(self.client.update_weights, update_info)
            sent = []
            for i, (name, tensor) in enumerate(self.source.iter_full()):  # _checked_iter
                assert (name, tensor.dtype, tuple(tensor.shape)) == (meta[i].name, meta[i].dtype, meta[i].shape)
                sent.append((name, tensor.clone()))
            assert len(sent) == len(meta)
            future.result()
        self.client.finish_weight_update()
        self.rounds.append(sent)


class WeightTransferTrainerFactory:
    @classmethod
    def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> FakeTrainerEngine:
        assert init_info.backend == "nccl"
        return FakeTrainerEngine.trainer_init(init_info, client=client, source=source)


@pytest.fixture
def fake_vllm(monkeypatch):
    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.distributed", "vllm.distributed.weight_transfer", "vllm.distributed.weight_transfer.nccl_engine",
        "vllm.distributed.weight_transfer.base")}
    base = modules["vllm.distributed.weight_transfer.base"]
    base.TrainerInitInfo, base.TrainerWeightTransferEngine = TrainerInitInfo, TrainerWeightTransferEngine
    wt = modules["vllm.distributed.weight_transfer"]
    wt.ParamMeta, wt.WeightSource = ParamMeta, WeightSource
    wt.HTTPVLLMWeightSyncClient = HTTPVLLMWeightSyncClient
    wt.WeightTransferTrainerFactory = WeightTransferTrainerFactory
    modules["vllm.distributed.weight_transfer.nccl_engine"].NCCLTrainerInitInfo = NCCLTrainerInitInfo
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("LIT_GRPO_SERVER_TOKEN", raising=False)
    FakeTrainerEngine.instances.clear()
    yield


# ---- fake `vllm serve` --------------------------------------------------------------------------------
class FakeVLLMServer:
    def __init__(self, port: int = 0) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.version: str | None = None
        self.fail: set[str] = set()
        #: routes at which the server dies: the connection closes without an answer and the port refuses from then on
        self.die_on: set[str] = set()
        self.generate_delay_s = 0.0  # a slow generation, to have requests in flight during a push
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                owner.calls.append((method, self.path, body))
                if self.path.split("?")[0] in owner.die_on:
                    owner.httpd.socket.close()  # refused from now on, like a killed process's port
                    threading.Thread(target=owner.httpd.shutdown, daemon=True).start()
                    self.close_connection = True
                    return
                status, payload = owner.answer(method, self.path.split("?")[0], body)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, method: str, path: str, body: Any) -> tuple[int, dict]:
        if path in self.fail:
            return 500, {"detail": f"{path} broke"}
        if path == "/get_world_size":
            return 200, {"world_size": 1}
        if path == "/weight_info":
            return 200, {"weight_version": self.version}
        if path == "/finish_weight_update":
            if body is not None:
                self.version = body["weight_version"]
            return 200, {"message": "Weight update finished"}
        if path == "/weight_checker":  # vLLM 0.32's: SHA-256 of each parameter it holds, as the last push sent it
            return 200, {"checksums": self.checksums()}
        if path == "/v1/completions":
            time.sleep(self.generate_delay_s)
            (prompt,) = body["prompt"]
            choices = []
            for j in range(body["n"]):
                tokens = [body["seed"] % 97 + j, len(prompt), 2]
                choices.append({"index": j, "text": "", "token_ids": tokens, "finish_reason": "stop",
                                "logprobs": {"token_logprobs": [-0.5 - j, -1.0, -0.25], "tokens": ["a", "b", "c"]},
                                "weight_versions": [{"version": self.version, "start": 0, "end": 3}]})
            return 200, {"choices": choices}
        return 200, {"message": "ok"}

    def checksums(self) -> dict[str, str]:
        """What a server that loaded every tensor of the last push to it holds (the fake transfer sends nothing)."""
        from lit_grpo.engines.remote.vllm_verify import sha256

        rounds = [e.rounds[-1] for e in FakeTrainerEngine.instances if e.is_sender and e.rounds
                  and e.client.base_url == self.url]
        return {f"dp0:pp0:pcp0:tp0:{name}": sha256(t) for name, t in (rounds[-1] if rounds else [])}

    def routes(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _ in self.calls]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server():
    server = FakeVLLMServer()
    yield server
    server.close()


#: before each server's push rank 0 reads the version it holds: another than the one pushed to it means it restarted
HELD = ("GET", "/weight_info")
PUSH = [("POST", "/pause?mode=wait"), ("POST", "/start_weight_update"), ("POST", "/update_weights"),
        ("POST", "/finish_weight_update"), ("GET", "/weight_info"), ("POST", "/weight_checker"), ("POST", "/resume")]


def test_vllm_push_follows_the_weight_sync_protocol(fake_vllm, fake_server):
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: model, dtype="bfloat16", timeout_s=10)
    assert engine.rescore is False  # vLLM's sampler log-probs are alpha's
    engine.load_weights(model.named_parameters(), step=3)
    # first the baseline read of vLLM's prefix-cache counters (engines/remote/prefix_cache.py), then the push
    assert fake_server.routes() == [("GET", "/metrics"), ("GET", "/get_world_size"), HELD, ("GET", "/get_world_size"),
                                    ("POST", "/init_weight_transfer_engine"), *PUSH]
    bodies = {path: body for _, path, body in fake_server.calls}
    init = bodies["/init_weight_transfer_engine"]["init_info"]
    assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["master_address"] == "127.0.0.1"
    assert isinstance(init["master_port"], int) and init["packed"] is True
    assert bodies["/start_weight_update"] is None
    update = bodies["/update_weights"]["update_info"]
    params = dict(model.named_parameters())
    assert update["names"] == list(params) and set(update["dtype_names"]) == {"bfloat16"}
    assert update["shapes"] == [list(p.shape) for p in params.values()]
    assert bodies["/finish_weight_update"] == {"weight_version": "3"}
    assert engine.synced_step == 3
    (trainer,) = FakeTrainerEngine.instances
    assert trainer.is_sender
    sent = dict(trainer.rounds[0])
    assert all(torch.equal(sent[name], p.detach().to(torch.bfloat16)) for name, p in params.items())
    # the next push reuses the group: no second init
    fake_server.calls.clear()
    with torch.no_grad():
        next(iter(model.parameters())).add_(1.0)
    engine.load_weights(model.named_parameters(), step=4)
    assert fake_server.routes() == [HELD, *PUSH] and engine.synced_step == 4
    assert fake_server.calls[4][2] == {"weight_version": "4"}
    first = next(iter(params))
    assert torch.equal(dict(trainer.rounds[1])[first], params[first].detach().to(torch.bfloat16))


def test_a_server_whose_weight_checker_answers_no_checksums_stops_the_push_in_one_line(fake_vllm, fake_server,
                                                                                       monkeypatch):
    """A ``vllm serve`` without the weight checker (or a proxy that drops its answer) cannot have its pushes verified:
    the push fails naming it and the switch; with ``verify_pushes: false`` it is not asked."""
    monkeypatch.setattr(fake_server, "checksums", lambda: {})
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: model, timeout_s=10)
    with pytest.raises(ServerError) as refused:
        engine.load_weights(model.named_parameters(), step=1)
    line = str(refused.value)
    assert "\n" not in line and f"rollout server {fake_server.url}: POST /weight_checker answered" in line
    assert "expected {'checksums'" in line and "verify_pushes: false" in line
    assert fake_server.routes()[-1] == ("POST", "/resume")  # not left paused
    unverified = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: model, timeout_s=10,
                              verify_pushes=False)
    fake_server.calls.clear()
    unverified.load_weights(model.named_parameters(), step=2)
    assert ("POST", "/weight_checker") not in fake_server.routes() and unverified.synced_step == 2


def test_vllm_rollouts_one_request_per_prompt_and_version_checked(fake_vllm, fake_server):
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=model, stop_token_ids=[2], timeout_s=10)
    engine.load_weights(model.named_parameters(), step=5)
    fake_server.calls.clear()
    prompts = [[5, 6, 7], [8, 9]]
    groups = engine.generate(prompts, 3, SamplingConfig(max_new_tokens=4, temperature=0.7), seed=11)
    requests = sorted((b for _, p, b in fake_server.calls if p == "/v1/completions"), key=lambda b: b["seed"])
    assert [b["prompt"] for b in requests] == [[p] for p in prompts]  # vLLM seeds a request's prompts alike
    assert [b["seed"] for b in requests] == [prompt_seed(11, p, 3) for p in range(2)]
    for body in requests:
        assert body["n"] == 3 and body["logprobs"] == 0 and body["return_token_ids"] is True
        assert body["return_weight_versions"] is True and body["stop_token_ids"] == [2]
        assert body["temperature"] == 0.7 and body["max_tokens"] == 4 and body["top_p"] == 1.0
    assert [[c.token_ids for c in g] for g in groups] == [
        [[prompt_seed(11, p, 3) % 97 + j, len(prompts[p]), 2] for j in range(3)] for p in range(2)]
    assert groups[0][1].logprobs == [-1.5, -1.0, -0.25] and not groups[0][0].truncated
    fake_server.version = "99"  # someone else pushed, or the server restarted and was pushed to
    with pytest.raises(ServerError, match=r"sampled with weight version \['99'\], but this trainer pushed version '5'"):
        engine.generate(prompts, 3, SamplingConfig(max_new_tokens=4), seed=11)


def test_a_vllm_server_that_dies_during_a_push_is_left_out_and_rejoins_with_the_next(fake_vllm):
    """Two ``vllm serve``: one dies mid-push (its connection closed without an answer, its port refusing). The push
    goes on to the other, the dead one is out of routing, requests go to the one up; restarted at its URL, it takes
    the next push with a new trainer side, is back in routing, and is named as rejoined (the sampler check's)."""
    model = tiny_llama(vocab_size=100)
    first, second = FakeVLLMServer(), FakeVLLMServer()
    try:
        engine = ServerEngine(urls=[first.url, second.url], kind="vllm", policy=model, timeout_s=10)
        engine.load_weights(model.named_parameters(), step=1)
        assert engine.take_rejoined() == []  # the first push is the first check's, not a rejoin
        second.die_on = {"/update_weights"}
        with pytest.warns(UserWarning, match=rf"rollout server {second.url} is down \(it did not take the weight "
                                             r"push\)"):
            engine.load_weights(model.named_parameters(), step=2)
        assert engine.synced_step == 2 and first.version == "2" and second.version == "1"
        assert engine.routing_stats()["servers_up"] == 1.0
        groups = engine.generate([[5, 6], [7, 8]], 2, SamplingConfig(max_new_tokens=3), seed=3)
        assert {c.server for g in groups for c in g} == {first.url} and {c.versions for g in groups for c in g} == {
            ("2",)}
        port = int(second.url.rsplit(":", 1)[1])
        second.close()
        second = FakeVLLMServer(port=port)  # restarted: a fresh server holding no version of this trainer
        engine.load_weights(model.named_parameters(), step=3)
        assert (first.version, second.version) == ("3", "3") and engine.routing_stats()["servers_up"] == 2.0
        assert ("POST", "/init_weight_transfer_engine") in second.routes()
        assert engine.take_rejoined() == [second.url] and engine.take_rejoined() == []
        groups = engine.generate([[5, 6], [7, 8]], 2, SamplingConfig(max_new_tokens=3), seed=3)
        assert {c.server for g in groups for c in g} == {first.url, second.url}
        engine.close()
    finally:
        first.close()
        second.close()


def test_vllm_failed_push_names_the_server_resumes_it_and_starts_over(fake_vllm, fake_server):
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=model, timeout_s=10)
    fake_server.fail = {"/update_weights"}
    consumed = []

    def tensors():
        for name, p in model.named_parameters():
            consumed.append(name)
            yield name, p

    with pytest.raises(ServerError, match=f"weight push of step 6 to {fake_server.url} failed"):
        engine.load_weights(tensors(), step=6)
    assert consumed == [name for name, _ in model.named_parameters()]  # drained: other ranks are in the gathers
    assert fake_server.routes()[-1] == ("POST", "/resume")
    assert ("POST", "/finish_weight_update") not in fake_server.routes()
    (broken,) = FakeTrainerEngine.instances
    assert broken.shutdowns == 1  # its group and what it holds are released, not left to the end of the process
    fake_server.fail = set()
    fake_server.calls.clear()
    engine.load_weights(model.named_parameters(), step=7)
    assert ("POST", "/init_weight_transfer_engine") in fake_server.routes() and engine.synced_step == 7
    fresh = FakeTrainerEngine.instances[-1]
    assert fresh is not broken and fresh.shutdowns == 0
    engine.close()
    engine.close()  # again (as at exit): nothing more
    assert (broken.shutdowns, fresh.shutdowns) == (1, 1)


def test_vllm_failed_push_whose_shutdown_fails_still_raises_the_push_error(fake_vllm, fake_server, monkeypatch):
    def broken_shutdown(self: FakeTrainerEngine) -> None:
        raise RuntimeError("communicator already gone")

    monkeypatch.setattr(FakeTrainerEngine, "shutdown", broken_shutdown)
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=model, timeout_s=10)
    fake_server.fail = {"/update_weights"}
    with pytest.warns(UserWarning, match="weight-transfer engine failed: communicator already gone"), \
            pytest.raises(ServerError, match="weight push of step 1 to .* failed on rank 0"):
        engine.load_weights(model.named_parameters(), step=1)
    fake_server.fail = set()
    engine.load_weights(model.named_parameters(), step=2)  # a new group
    assert len(FakeTrainerEngine.instances) == 2 and engine.synced_step == 2


def test_vllm_serve_adapter_directory_stays_while_the_fit_runs_and_goes_at_close(fake_vllm, fake_server, tmp_path):
    torch.manual_seed(0)
    policy = apply_lora(tiny_llama(vocab_size=100), LoraArgs(r=4, alpha=8.0))
    shared = tmp_path / "shared"
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: policy, timeout_s=10, lora_dir=str(shared),
                          lora_keep=2)
    for step in (1, 2, 3):
        engine.load_adapter(adapter_update(policy, engine.merges_applied, with_hash=False, step=step), step=step)
    root = engine.vllm_adapters.versions.root
    loaded = [body["lora_path"] for _, path, body in fake_server.calls if path == "/v1/load_lora_adapter"]
    assert root.parent == shared and loaded == [str(root / f"lit_grpo-v{k}") for k in (1, 2, 3)]
    # while the fit runs, the server may read the kept versions again
    assert sorted(p.name for p in root.iterdir()) == ["lit_grpo-v2", "lit_grpo-v3"]
    engine.close()
    assert not root.exists() and shared.is_dir() and list(shared.iterdir()) == []  # lora_dir itself is the user's
    assert engine.vllm_adapters is None and [t.shutdowns for t in FakeTrainerEngine.instances] == [1]
    engine.close()  # again (as at exit): nothing more


class GlooPeer:
    """The server's worker for the gloo plugin's trainer side: its init joins the group as rank 1 through the
    trainer's store (what ``GlooWeightTransferEngine.init_transfer_engine`` does in ``vllm serve``)."""

    def __init__(self) -> None:
        self.held: list[Any] = []

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        import datetime

        import torch.distributed as dist

        from lit_grpo.wire.weight_transfer import open_group

        store = dist.TCPStore(init_info["master_address"], init_info["master_port"], init_info["world_size"], False,
                              datetime.timedelta(seconds=10))
        self.held += [store, open_group(store, 1, init_info["world_size"], "gloo", 10.0, "127.0.0.1")]


def test_gloo_trainer_engine_shutdown_releases_the_store_once_and_quietly(fake_vllm):
    """After ``ServerEngine.close`` the release at exit shuts the engine down again: no error either time (the
    store closes its own listening socket; closing it again was ``[Errno 9] Bad file descriptor``)."""
    from lit_grpo.wire.vllm_gloo import make_trainer_engine_class
    from lit_grpo.wire.weight_transfer import close_group

    engine_class = make_trainer_engine_class()
    info = engine_class.init_info_cls("127.0.0.1", 0, 2, timeout_s=10.0, rank=0)
    peer = GlooPeer()
    engine = engine_class.trainer_init(info, client=peer, source=object())
    try:
        port = engine.store.port
        assert engine.group is not None
        engine.shutdown()
        engine.shutdown()
        assert engine.group is None and engine.store is None and engine.listener is None
        with pytest.raises(ConnectionRefusedError):  # the store and its socket are gone, not left listening
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
    finally:
        close_group(peer.held[-1])


def test_vllm_push_waits_for_the_asynchronous_requests_in_flight(fake_vllm, fake_server):
    """max_staleness >= 1 with the vLLM kind: requests run on the producer's thread; a push first drains them, so
    they are answered, with the old version on every completion, before ``/pause``."""
    model = tiny_llama(vocab_size=100)
    engine = ServerEngine(url=fake_server.url, kind="vllm", policy=lambda: model, timeout_s=10)
    engine.load_weights(model.named_parameters(), step=1)
    producer = RolloutProducer()
    engine.before_push.append(producer.drain)
    fake_server.generate_delay_s = 0.3
    fake_server.calls.clear()
    producer.submit(1, lambda: engine.request_rollouts([[5, 6], [7]], 2, SamplingConfig(max_new_tokens=3), seed=4))
    time.sleep(0.05)  # the requests are in flight
    engine.load_weights(model.named_parameters(), step=2)
    rollouts, error = producer.take(1)
    assert error is None
    groups = engine.check_lockstep(rollouts)
    assert [c.versions for g in groups for c in g] == [("1",)] * 4  # sampled entirely before the push
    routes = fake_server.routes()
    assert routes.index(("POST", "/pause?mode=wait")) > max(i for i, r in enumerate(routes)
                                                             if r == ("POST", "/v1/completions"))
    assert engine.synced_step == 2
    producer.close()
