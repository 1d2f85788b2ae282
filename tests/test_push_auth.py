"""The shared token and the loopback rule (``lit_grpo.wire.auth``), and what they guard without vLLM: the gloo
plugin's worker side refusing an init (against a stand-in for vLLM's ``WeightTransferEngine`` base class),
``ServerOptions`` refusing a ``vllm serve`` URL off this machine, and ``ServerEngine`` refusing to push to ``vllm
serve`` without a token. The same refusals against a real ``vllm serve``: ``tests/test_vllm_serve.py`` (vLLM tier)."""

from __future__ import annotations

import re

import pytest
import torch

from lit_grpo.engines.options import ServerOptions, engine_options
from lit_grpo.wire import auth

TOKEN = "0123456789abcdef-shared"


def test_same_token_compares_whole_tokens_and_refuses_missing_ones():
    assert auth.same_token(TOKEN, TOKEN)
    assert not auth.same_token(TOKEN[:-1], TOKEN)
    assert not auth.same_token(TOKEN + "x", TOKEN)
    assert not auth.same_token(None, TOKEN) and not auth.same_token("", TOKEN) and not auth.same_token(123, TOKEN)


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("localhost", True), ("LOCALHOST", True), ("::1", True),
    ("[::1]", True), ("10.0.0.2", False), ("0.0.0.0", False), ("192.168.1.5", False), ("trainer.example", False),
    ("localhost.attacker.example", False), ("", False), (None, False)])
def test_is_loopback_takes_loopback_addresses_and_localhost_only(host, loopback):
    assert auth.is_loopback(host) is loopback


def test_find_token_reads_the_file_argument_then_the_file_variable_then_the_variable(tmp_path):
    given, named = tmp_path / "given", tmp_path / "named"
    given.write_text("from-the-argument-file\n")
    named.write_text("  from-the-named-file \n")
    env = {auth.TOKEN_ENV: "from-the-variable", auth.TOKEN_FILE_ENV: str(named)}
    assert auth.find_token(str(given), env) == ("from-the-argument-file", f"token file {given}")
    assert auth.find_token(None, env) == ("from-the-named-file", f"token file {named}")
    assert auth.find_token(None, {auth.TOKEN_ENV: " from-the-variable "}) == ("from-the-variable",
                                                                            f"${auth.TOKEN_ENV}")
    assert auth.find_token(None, {auth.TOKEN_ENV: "  "}) == (None, f"${auth.TOKEN_ENV}")
    with pytest.raises(ValueError, match=r"no token: .*\$LIT_GRPO_SERVER_TOKEN_FILE\) or \$LIT_GRPO_SERVER_TOKEN "):
        auth.read_token(None, {})
    with pytest.raises(ValueError, match=r"the token in \$LIT_GRPO_SERVER_TOKEN has 5 characters; use at least 16"):
        auth.read_token(None, {auth.TOKEN_ENV: "short"})


def test_the_project_server_reads_its_token_through_the_shared_reader(tmp_path, monkeypatch):
    from lit_grpo.serve.server import read_token

    named = tmp_path / "token"
    named.write_text(TOKEN)
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.setenv(auth.TOKEN_FILE_ENV, str(named))
    assert read_token(None) == TOKEN
    monkeypatch.delenv(auth.TOKEN_FILE_ENV)
    with pytest.raises(ValueError, match="no token"):
        read_token(None)


@pytest.mark.parametrize(("environ", "address", "token", "expected"), [
    ({}, "127.0.0.1", TOKEN, r"^no token: start vllm serve with \$LIT_GRPO_SERVER_TOKEN .* in its environment"),
    ({auth.TOKEN_ENV: "short"}, "127.0.0.1", "short", "has 5 characters; use at least 16"),
    ({auth.TOKEN_ENV: TOKEN}, "127.0.0.1", None, "missing or wrong token in the init info"),
    ({auth.TOKEN_ENV: TOKEN}, "127.0.0.1", "", "missing or wrong token"),
    ({auth.TOKEN_ENV: TOKEN}, "127.0.0.1", TOKEN[:-1] + "X", "missing or wrong token"),
    ({auth.TOKEN_ENV: TOKEN}, "10.0.0.7", TOKEN, "'10.0.0.7', not on this machine; set LIT_GRPO_ALLOW_REMOTE_PUSH=1"),
    ({auth.TOKEN_ENV: TOKEN, auth.ALLOW_REMOTE_ENV: "0"}, "10.0.0.7", TOKEN, "not on this machine"),
    ({auth.TOKEN_FILE_ENV: "/nonexistent/token"}, "127.0.0.1", TOKEN, "cannot read the token file .*No such file"),
])
def test_push_refusal_names_what_is_wrong_in_one_line(environ, address, token, expected):
    refusal = auth.push_refusal(address, token, environ)
    assert refusal is not None and "\n" not in refusal
    assert re.search(expected, refusal), refusal


def test_push_refusal_lets_the_right_token_through_and_remote_stores_only_when_allowed(tmp_path):
    assert auth.push_refusal("127.0.0.1", TOKEN, {auth.TOKEN_ENV: TOKEN}) is None
    assert auth.push_refusal("localhost", TOKEN, {auth.TOKEN_ENV: TOKEN}) is None
    named = tmp_path / "token"
    named.write_text(TOKEN + "\n")
    assert auth.push_refusal("127.0.0.1", TOKEN, {auth.TOKEN_FILE_ENV: str(named)}) is None
    assert auth.push_refusal("10.0.0.7", TOKEN, {auth.TOKEN_ENV: TOKEN, auth.ALLOW_REMOTE_ENV: "1"}) is None


# ---- the worker side of the gloo plugin, on a stand-in for vLLM's base class -------------------------------
@pytest.fixture
def gloo_worker(monkeypatch):
    """A gloo worker engine over a one-parameter model, its layerwise-reload calls recorded."""
    from fake_vllm import gloo_worker_over

    model = torch.nn.Linear(2, 2)
    worker, calls = gloo_worker_over(model, monkeypatch)
    return worker, model, calls


def init_info(token: str | None, address: str = "127.0.0.1") -> dict:
    info = {"master_address": address, "master_port": 1, "rank_offset": 1, "world_size": 2, "timeout_s": 1.0}
    return info if token is None else {**info, "token": token}


@pytest.mark.parametrize("token", [None, "", "wrong-token-of-some-length"])
def test_a_refused_init_joins_nothing_and_leaves_the_weights(gloo_worker, monkeypatch, token):
    worker, model, calls = gloo_worker
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    weights = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PermissionError, match="gloo weight transfer refused: missing or wrong token"):
        worker.init_transfer_engine(worker.parse_init_info(init_info(token)))  # port 1: joining would fail otherwise
    assert worker.group is None and worker.store is None
    with pytest.raises(RuntimeError, match="not initialised"):
        worker.start_weight_update()
    with pytest.raises(RuntimeError, match="not initialised"):
        worker.update_weights({"names": ["weight"], "dtype_names": ["float32"], "shapes": [[2, 2]]})
    assert calls == []  # no layer was put aside for reloading
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_a_refused_init_keeps_the_group_a_trainer_formed(gloo_worker, monkeypatch):
    worker, _, _ = gloo_worker
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    monkeypatch.delenv(auth.ALLOW_REMOTE_ENV, raising=False)
    formed = object()
    worker.group = formed  # as after the trainer's authenticated init
    for info in (init_info("wrong-token-of-some-length"), init_info(TOKEN, "10.0.0.7")):
        with pytest.raises(PermissionError, match="refused"):
            worker.init_transfer_engine(worker.parse_init_info(info))
        assert worker.group is formed


def test_a_worker_without_a_token_refuses_every_init_saying_how_to_set_it(gloo_worker, monkeypatch):
    worker, _, _ = gloo_worker
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    with pytest.raises(PermissionError, match=r"no token: start vllm serve with .* in its environment") as err:
        worker.init_transfer_engine(worker.parse_init_info(init_info(TOKEN)))
    assert "\n" not in str(err.value) and worker.group is None


def test_the_init_info_never_shows_the_token():
    from lit_grpo.wire.vllm_gloo import GlooWeightTransferInitInfo

    assert TOKEN not in repr(GlooWeightTransferInitInfo(**init_info(TOKEN)))


# ---- the trainer's side ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("urls", [
    {"url": "http://10.0.0.2:8000"}, {"url": "http://0.0.0.0:8000"}, {"url": "http://rollout-box:8000"},
    {"urls": ["http://127.0.0.1:8000", "http://192.168.0.9:8000"]}])
def test_vllm_server_urls_off_this_machine_are_refused_unless_allowed(urls):
    remote = urls.get("url") or urls["urls"][-1]
    with pytest.raises(ValueError, match=rf"kind 'vllm' server url '{remote}' is not on this machine.*allow_remote"):
        engine_options("server", {**urls, "kind": "vllm"})
    assert engine_options("server", {**urls, "kind": "vllm", "allow_remote": True}).allow_remote is True
    with pytest.raises(ValueError, match="not on this machine"):  # only true allows
        engine_options("server", {**urls, "kind": "vllm", "allow_remote": "yes"})


def test_loopback_vllm_urls_and_the_project_servers_urls_need_no_switch():
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://[::1]:8000"):
        assert engine_options("server", {"url": url, "kind": "vllm"}).url == url
    # the project's server authenticates every route and binds loopback unless its own --host says otherwise
    assert ServerOptions(url="http://10.0.0.2:8765").kind == "lit_grpo"
    with pytest.raises(ValueError, match="allow_remote must be bool"):
        engine_options("server", {"url": "http://127.0.0.1:8000", "kind": "vllm", "allow_remote": "yes"})


def test_a_gloo_push_to_vllm_serve_needs_a_token_before_anything_connects(monkeypatch):
    from lit_grpo.engines.remote.client import ServerEngine

    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    # port 9: nothing listens there, so reaching the server would fail otherwise
    with pytest.raises(ValueError, match=r"kind 'vllm' with backend 'gloo' needs the token vllm serve was started "
                                         r"with .*--api-key"):
        ServerEngine(url="http://127.0.0.1:9", kind="vllm", backend="gloo", timeout_s=1)


class _Store:
    """A store whose key count grows by one on each ``tick`` (a worker connecting)."""

    def __init__(self, keys: int = 0) -> None:
        self.keys = keys

    def num_keys(self) -> int:
        return self.keys


def test_the_trainer_joins_only_once_a_worker_is_in_the_store_and_a_refusal_returns_at_once():
    import time
    from concurrent.futures import Future

    from lit_grpo.wire.vllm_gloo import wait_for_peer

    refused: Future = Future()
    refused.set_exception(RuntimeError("gloo weight transfer refused: missing or wrong token"))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="refused: missing or wrong token"):
        wait_for_peer(_Store(3), 3, refused, timeout_s=60)
    assert time.monotonic() - start < 5  # not the transfer timeout
    assert wait_for_peer(_Store(4), 3, Future(), timeout_s=60) is None  # a worker connected: join now
    with pytest.raises(TimeoutError, match="no vLLM worker joined the weight-transfer group within 0.05 s"):
        wait_for_peer(_Store(3), 3, Future(), timeout_s=0.05)
    answered: Future = Future()
    answered.set_result(None)
    with pytest.raises(RuntimeError, match="answered the weight-transfer init without joining"):
        wait_for_peer(_Store(3), 3, answered, timeout_s=60)
