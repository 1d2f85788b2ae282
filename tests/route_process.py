"""``python -m lit_grpo route`` as a real process on the loopback, for the tests that route through vllm-router."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

from distributed_launch import free_port


class RouteProcess:
    """``python -m lit_grpo route`` over ``urls`` on a free loopback port, ready once its (authenticated) /health
    answers."""

    def __init__(self, workdir, urls: list[str], token: str) -> None:  # noqa: ANN001
        self.token = token
        self.port, metrics = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "router.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "lit_grpo", "route", "--servers", *urls, "--port",
                                      str(self.port), "--metrics-port", str(metrics)],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))

    def answer(self, path: str, token: str | None, method: str = "GET") -> tuple[int, bytes]:
        """``(status, body)`` of one request (``token`` None: no Authorization header)."""
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        request = urllib.request.Request(self.url + path, headers=headers, method=method,
                                         data=b"" if method == "POST" else None)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def call(self, path: str, token: str | None, method: str = "GET") -> int:
        return self.answer(path, token, method)[0]

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"the router exited with {self.proc.returncode}"
            try:
                if self.call("/health", self.token) == 200:
                    return
            except OSError:  # not listening yet: poll again below
                pass
            assert time.monotonic() < deadline, "the router did not start"
            time.sleep(0.5)

    def workers(self) -> list[str]:
        """The servers in the router's routing now (``GET /list_workers``)."""
        return json.loads(self.answer("/list_workers", self.token)[1])["urls"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.log.close()
