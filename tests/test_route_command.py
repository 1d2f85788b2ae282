"""``python -m lit_grpo route`` (``lit_grpo/cli/route.py``): bad arguments refused in one line before the router's
package loads, the router configured as a trainer needs it (sticky sessions, 503s passed through, loopback), and
every route authenticated against every live server (``TokenGate``, against loopback stub servers, and through the
real router). The router routing a fit: tests/test_server_routing.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ports import free_port

from lit_grpo.cli.route import TokenGate, build_parser, check, router_kwargs, server_verdict, start_gate

TOKEN = "t" * 32


def parsed(*argv: str):  # noqa: ANN201
    args = build_parser().parse_args(list(argv))
    check(args)
    return args


@pytest.mark.parametrize(("argv", "message"), [
    (["--servers", "localhost:8001", "--port", "8000"], "--servers takes URLs like http://HOST:PORT, got "
                                                         "'localhost:8001'"),
    (["--servers", "http://127.0.0.1:1", "http://127.0.0.1:1", "--port", "8000"], "names a server twice"),
    (["--servers", "http://127.0.0.1:1", "--port", "0"], "--port must be a TCP port in 1..65535, got 0"),
    (["--servers", "http://127.0.0.1:1", "--port", "29000"], "--port and --metrics-port are both 29000"),
    (["--servers", "http://127.0.0.1:1", "--port", "8000", "--validate-path", "is_paused"],
     "--validate-path must be a route like /is_paused"),
])
def test_bad_arguments_are_one_line_before_the_router_loads(argv, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm_router", None)  # importing it would fail: the check comes first
    with pytest.raises(ValueError, match=message) as err:
        parsed(*argv)
    assert "\n" not in str(err.value)


def test_the_router_is_sticky_passes_503_through_checks_tokens_and_listens_on_loopback():
    pytest.importorskip("vllm_router")  # the dev extra installs it
    from vllm_router.router import PolicyType

    kwargs = router_kwargs(parsed("--servers", "http://127.0.0.1:8001/", "http://127.0.0.1:8002", "--port", "8000",
                                  "--metrics-port", "8009"), "http://127.0.0.1:8010/validate")
    assert kwargs["worker_urls"] == ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"]
    assert kwargs["policy"] == PolicyType.StickyLeastLoaded
    assert kwargs["disable_retries"] is True and kwargs["disable_circuit_breaker"] is True
    assert kwargs["api_key_validation_urls"] == ["http://127.0.0.1:8010/validate"]  # the gate, not a server
    assert (kwargs["host"], kwargs["port"]) == ("127.0.0.1", 8000)
    assert (kwargs["prometheus_host"], kwargs["prometheus_port"]) == ("127.0.0.1", 8009)


def test_without_the_router_package_the_command_says_how_to_install_it(monkeypatch):
    from lit_grpo.cli import route

    monkeypatch.setitem(sys.modules, "vllm_router", None)
    monkeypatch.setitem(sys.modules, "vllm_router.router", None)
    with pytest.raises(ValueError, match=r"needs vllm-router: pip install 'lit_grpo\[router\]'"):
        route.main(["--servers", "http://127.0.0.1:8001", "--port", "8000"])


class StubServer:
    """A rollout server's authentication on the loopback: ``GET /health`` answers 200 to anyone (the router's
    health check sends no token), ``GET /is_paused`` 200 with ``Authorization: Bearer <token>`` and 401 otherwise;
    ``token`` None: a server without authentication, 200 to anyone. Records each request's path and header."""

    def __init__(self, token: str | None) -> None:
        self.calls: list[tuple[str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                header = self.headers.get("Authorization")
                stub.calls.append((self.path, header))
                if self.path == "/health" or token is None:
                    status = 200
                elif self.path == "/is_paused":
                    status = 200 if header == f"Bearer {token}" else 401
                else:
                    status = 404
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:  # noqa: ANN002
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """Down: nothing listens on its port any more."""
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stubs():
    made: list[StubServer] = []

    def make(token: str | None) -> StubServer:
        made.append(StubServer(token))
        return made[-1]

    yield make
    for stub in made:
        if stub.httpd.socket.fileno() != -1:
            stub.stop()


def down_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_token_is_valid_when_every_live_server_accepts_it(stubs):
    first, second = stubs(TOKEN), stubs(TOKEN)
    gate = TokenGate([first.url + "/", second.url], "/is_paused")
    assert gate.valid(bearer(TOKEN))
    assert not gate.valid(bearer("x" * 32)) and not gate.valid(None) and not gate.valid("")
    # each server was asked at its validation route with the client's header as it came
    assert (first.calls[0], second.calls[0]) == (("/is_paused", bearer(TOKEN)),) * 2
    assert len(first.calls) == len(second.calls) == 2  # no header: no server asked


def test_a_server_without_authentication_does_not_admit_everyone(stubs):
    gate = TokenGate([stubs(None).url, stubs(TOKEN).url], "/is_paused")  # the open one first
    assert not gate.valid(bearer("x" * 32))
    assert gate.valid(bearer(TOKEN))


def test_a_down_server_is_skipped_and_with_none_live_every_token_is_refused(stubs):
    live = stubs(TOKEN)
    gate = TokenGate([down_url(), live.url], "/is_paused")  # the down one first
    assert gate.valid(bearer(TOKEN))
    assert not gate.valid(bearer("x" * 32))
    live.stop()
    assert not gate.valid(bearer(TOKEN))  # no server answers: no one vouches for the token


def test_any_answer_but_a_2xx_refuses(stubs):
    server = stubs(TOKEN)
    assert server_verdict(server.url + "/is_paused", bearer(TOKEN)) is True
    assert server_verdict(server.url + "/is_paused", bearer("x" * 32)) is False  # 401
    assert server_verdict(server.url + "/v1/models", bearer(TOKEN)) is False  # 404: a wrong --validate-path
    assert server_verdict(server.url + "/is_paused", "Bearer a\r\nInjected: 1") is False  # never sent
    assert server_verdict(down_url() + "/is_paused", bearer(TOKEN)) is None
    # a server that accepts the token but refuses through a wrong route still refuses: all must accept
    assert not TokenGate([server.url], "/v1/models").valid(bearer(TOKEN))


def status_of(url: str, token: str | None, timeout_s: float = 10.0) -> int:
    """The status of ``GET url`` with ``token`` (None: no Authorization header)."""
    request = urllib.request.Request(url, headers={"Authorization": bearer(token)} if token else {})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_gate_answers_on_the_loopback_200_or_401(stubs):
    gate = TokenGate([stubs(TOKEN).url, down_url()], "/is_paused").start()
    try:
        assert gate.url.startswith("http://127.0.0.1:")
        assert [status_of(gate.url, token) for token in (TOKEN, "x" * 32, None)] == [200, 401, 401]
    finally:
        gate.close()


def test_the_gate_process_answers_and_ends_with_the_route_command(stubs):
    """The route command runs the gate in a child process (the router holds the GIL); closing the command's end of
    the pipe, as its exit or its death does, ends the child."""
    process, alive, url = start_gate([stubs(TOKEN).url], "/is_paused")
    try:
        assert [status_of(url, token) for token in (TOKEN, "x" * 32)] == [200, 401]
    finally:
        alive.close()
        process.join(timeout=10)
    assert process.exitcode == 0


def router_status(port: int, token: str | None, timeout_s: float = 10.0) -> int:
    """The status of ``GET /health`` at the router (authenticated there too; no token: refused without asking)."""
    return status_of(f"http://127.0.0.1:{port}/health", token, timeout_s)


@pytest.mark.slow  # starts `python -m lit_grpo route` and vllm-router in it: about 10 s
def test_the_router_checks_each_new_token_against_every_live_server(stubs, tmp_path):
    """Through ``python -m lit_grpo route``: the first server without authentication no longer admits a wrong
    token, and once it is down, the second server's token is admitted. The router keeps the tokens it admitted,
    so each case takes a token of its own."""
    pytest.importorskip("vllm_router")
    open_first, second = stubs(None), stubs(TOKEN)
    port, metrics = free_port(), free_port()
    log = open(tmp_path / "router.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lit_grpo", "route", "--servers", open_first.url, second.url,
                             "--port", str(port), "--metrics-port", str(metrics)],
                            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 120
        while True:  # it binds its port before it answers: ready at its first answer (a 401, without a token)
            assert proc.poll() is None, (tmp_path / "router.log").read_text()
            try:
                if router_status(port, None, timeout_s=2.0) == 401:
                    break
            except OSError:  # not answering yet: ask again below
                pass
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.5)
        assert router_status(port, "x" * 32) == 401  # the open first server alone would have admitted it
        open_first.stop()
        assert router_status(port, TOKEN) == 200  # the down first server alone would have refused it
        second.stop()
        assert router_status(port, "y" * 32) == 401  # no live server
    finally:
        proc.kill()
        proc.wait()
        log.close()
