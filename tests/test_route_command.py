"""``python -m lit_grpo route`` (``lit_grpo/cli/route.py``): bad arguments refused in one line before the router's
package loads, and the router configured as a trainer needs it (sticky sessions, 503s passed through, every route
authenticated against the first server, loopback). The router routing a fit: tests/test_server_routing.py."""

from __future__ import annotations

import sys

import pytest

from lit_grpo.cli.route import build_parser, check, router_kwargs


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
                                  "--metrics-port", "8009"))
    assert kwargs["worker_urls"] == ["http://127.0.0.1:8001/", "http://127.0.0.1:8002"]
    assert kwargs["policy"] == PolicyType.StickyLeastLoaded
    assert kwargs["disable_retries"] is True and kwargs["disable_circuit_breaker"] is True
    assert kwargs["api_key_validation_urls"] == ["http://127.0.0.1:8001/is_paused"]
    assert (kwargs["host"], kwargs["port"]) == ("127.0.0.1", 8000)
    assert (kwargs["prometheus_host"], kwargs["prometheus_port"]) == ("127.0.0.1", 8009)


def test_without_the_router_package_the_command_says_how_to_install_it(monkeypatch):
    from lit_grpo.cli import route

    monkeypatch.setitem(sys.modules, "vllm_router", None)
    monkeypatch.setitem(sys.modules, "vllm_router.router", None)
    with pytest.raises(ValueError, match=r"needs vllm-router: pip install 'lit_grpo\[router\]'"):
        route.main(["--servers", "http://127.0.0.1:8001", "--port", "8000"])
