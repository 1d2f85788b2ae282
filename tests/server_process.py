"""Run the rollout server as a real process on a free port of 127.0.0.1 (``--port 0``: the server picks it and
prints it), with a fresh token in a 0600 file."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import select
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
READY = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    def __init__(self, workdir: Path, model: str = "tiny-random-llama", args: tuple[str, ...] = (),
                 token: str | None = None, port: int = 0, device: str = "cpu") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.token = token or secrets.token_hex(16)
        token_file = workdir / "token"
        token_file.write_text(self.token)
        token_file.chmod(0o600)
        # threads and device pinned: the tests' trainers run on the CPU
        cmd = [sys.executable, "-m", "lit_grpo", "serve", "--model", model, "--port", str(port),
               "--token-file", str(token_file), "--threads", "1", "--device", device, *args]
        env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
        env.pop("LIT_GRPO_SERVER_TOKEN", None)
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        self.url: str | None = f"http://127.0.0.1:{port}" if port else None
        self.ready = False

    def wait_ready(self, timeout_s: float = 240.0) -> str:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if self.proc.poll() is not None:
                log = self.log_path.read_text()[-3000:]
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{log}")
            if time.monotonic() > deadline:
                self.kill()
                log = self.log_path.read_text()[-3000:]
                raise RuntimeError(f"the server did not start within {timeout_s} s:\n{log}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                match = READY.search(self.proc.stdout.readline())
                if match:
                    self.url, self.ready = match.group(1), True
        return self.url

    def call(self, method: str, path: str, body: dict | None = None, token: str | None = "default") -> tuple[int, dict]:
        """One raw request (``token=None``: no Authorization header); ``(status, JSON body)``."""
        headers = {"Content-Type": "application/json"}
        token = self.token if token == "default" else token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=30) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw else {}
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw) if raw else {}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


@contextlib.contextmanager
def running_server(folder: Path) -> Iterator[ServerProcess]:
    """A server process started in ``folder``, ready, and killed on exit (a module fixture's body)."""
    process = ServerProcess(folder)
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()
