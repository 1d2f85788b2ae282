"""A rollout server process for one miniature run (``python -m lit_grpo serve``, one thread, float32, on the CPU, a
free port of 127.0.0.1, a fresh token in a 0600 file), checked to hold exactly the weights the trainer starts from
before the trainer is started."""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

READY = re.compile(r"listening on (http://\S+)")


def parameter_checksums(model_name: str, dtype: str = "float32") -> dict[str, str]:
    """SHA-256 of every parameter of ``model_name`` loaded as the trainer loads it, named as the server names
    them: the baseline for the server's ``/weight_checker`` comparison."""
    from lit_grpo.models.loading import load_model_and_tokenizer
    from lit_grpo.wire.weight_transfer import checksum

    model, _ = load_model_and_tokenizer(model_name, dtype)
    return {name: checksum(p) for name, p in model.named_parameters()}


class MiniatureServer:
    """``with MiniatureServer(model, folder, baseline) as server:`` starts the server, waits until it listens,
    compares its weights with ``baseline`` (:func:`parameter_checksums`) and stops it on exit. ``server.url`` and
    ``server.token_file`` go to the trainer's ``data.engine_options``. ``env`` is the server's environment
    (default: this process's), so that it runs the kernels the trainer runs."""

    def __init__(self, model_name: str, folder: Path, baseline: dict[str, str], timeout_s: float = 300.0,
                 env: dict[str, str] | None = None) -> None:
        self.model_name = model_name
        self.folder = folder
        self.baseline = baseline
        self.timeout_s = timeout_s
        self.env = env
        self.token_file = folder / "server_token"
        self.log_path = folder / "server.log"
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> MiniatureServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.token_file.write_text(secrets.token_hex(16))
        self.token_file.chmod(0o600)
        cmd = [sys.executable, "-m", "lit_grpo", "serve", "--model", self.model_name, "--dtype", "float32",
               "--device", "cpu", "--threads", "1", "--port", "0", "--token-file", str(self.token_file)]
        env = dict(os.environ if self.env is None else self.env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True)
        try:
            self.url = self._wait_ready()
            self._check_weights()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the rollout server exited with {self.proc.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the rollout server did not listen within {self.timeout_s:.0f} s; "
                                   f"see {self.log_path}")
            ready, _, _ = select.select([self.proc.stdout], [], [], 0.5)
            if ready:
                match = READY.search(self.proc.stdout.readline())
                if match:
                    return match.group(1)

    def _check_weights(self) -> None:
        """The server must start from the trainer's exact weights: the run assumes they are synced at step 0."""
        body = json.dumps({"action": "compare", "baseline": self.baseline}).encode()
        request = urllib.request.Request(f"{self.url}/weight_checker", data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {self.token_file.read_text()}"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=60) as response:
            answer = json.loads(response.read())
        if not answer.get("match"):
            raise RuntimeError(f"the rollout server's weights of {self.model_name!r} differ from the trainer's in "
                               f"{answer.get('mismatches', [])[:5]}; both must load the same float32 model")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
