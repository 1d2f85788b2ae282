"""`ServerEngine`: rollouts from one or more rollout servers over HTTP (the paper's layout: a GPU serves
rollouts, the FSDP ranks train), the policy's weights pushed to them every v batches.

Two kinds of server speak the same protocol (``lit_grpo.serving.protocol`` documents it):

- ``kind: lit_grpo``: the project's own ``python -m lit_grpo serve`` (``lit_grpo.serving.server``).
- ``kind: vllm``: ``vllm serve`` (0.32 or 0.33) in dev mode; what differs lives in ``lit_grpo.serving.vllm_client``,
  imported only for that kind.

The weight push is ``WeightPusher.load_weights`` (``lit_grpo.serving.weight_push``); with
``data.reference_on_server`` pi_ref is pushed too (``load_reference``) and the server scores it
(``ReferenceScorer``, ``lit_grpo.serving.reference_client``).

Generation is two steps, so that a background thread can run the first:

- ``request_rollouts``: HTTP only. Every rank sends its own prompts, spread over the servers in contiguous
  chunks, and gets back ``Rollouts``: the completions, or the error that stopped them. No torch.distributed
  call, so it is safe on a thread other than the training thread.
- ``check_lockstep(rollouts)``: on the training thread, one ``all_reduce`` of a flag (option ``lockstep``,
  world > 1) lets all ranks stop together when one rank's request failed; returns the completions.

``generate`` is both, one after the other.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import urlsplit

import torch
from torch import nn

from lit_grpo.distributed import GatherBuffer, everyone, rank_and_world
from lit_grpo.engines.base import Completion, RolloutEngine, SamplingConfig
from lit_grpo.serving.protocol import TOKEN_ENV, HTTPClient, ServerError, version_text
from lit_grpo.serving.reference_client import ReferenceScorer
from lit_grpo.serving.weight_push import WeightPusher

KINDS = ("lit_grpo", "vllm")
#: seeds of the chunks after the first when prompts are spread over several servers
CHUNK_SEED_STRIDE = 1_000_003
SEED_MODULUS = 2**62


@dataclass
class Rollouts:
    """What one rank's completion requests brought back: ``groups`` (``n`` completions per prompt, in prompt
    order) when every request succeeded; else ``groups`` is ``None`` and ``error`` says why (naming the server)."""

    groups: list[list[Completion]] | None
    error: str | None = None
    #: pi_ref's log-probs of the completions ``[S, C]`` in ``pad_rollouts``' layout and pi_ref's version, when the
    #: server scored them too (``data.reference_on_server``)
    reference: tuple[torch.Tensor, str] | None = None
    reference_seconds: float = 0.0  # how long the server took to score them


class ServerConnection:
    """One server: its HTTP client, the version this trainer last pushed to it and, on rank 0, the weight-transfer
    group (project's server) or vLLM's trainer side."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"server url must look like http://HOST:PORT, got {url!r}")
        self.url = url.rstrip("/")
        self.host = parts.hostname
        self.client = HTTPClient(url, token, timeout_s)
        self.expected_version: str | None = None  # what this trainer last pushed to it
        self.group = None
        self.store = None
        self.listener = None
        self.vllm = None  # (client, source, trainer engine) for kind vllm

    def close_group(self) -> None:
        from lit_grpo.serving.weight_transfer import close_group

        close_group(self.group)
        if self.listener is not None:
            self.listener.close()
        self.group = self.store = self.listener = None


class ServerEngine(WeightPusher, ReferenceScorer, RolloutEngine):
    """Rollouts from rollout servers (``data.engine: server``, ``data.engine_options: {url: ..., ...}``).

    Args:
        url / urls: one server, or several (each step's prompts are spread over them; weights go to all).
        token / token_file: the servers' bearer token; default ``$LIT_GRPO_SERVER_TOKEN``. Prefer the
            environment or a file: a config's values are saved with the run.
        timeout_s: limit of every control call and of each bucket's transfer; keep it below the trainer's
            process-group timeout, since the other ranks wait in a gather while rank 0 sends a bucket.
        generate_timeout_s: limit of one completion request (and of waiting for a paused server).
        kind: ``lit_grpo`` (``python -m lit_grpo serve``) or ``vllm`` (``vllm serve`` 0.32 or 0.33 in dev mode).
        bucket_mb: size of the buckets rank 0 gathers, then sends (lit_grpo kind).
        backend: ``gloo`` (CPU) or ``nccl`` (GPU) for the weight transfer. Default: ``gloo`` for the project's
            server, ``nccl`` for vLLM (a CPU ``vllm serve`` takes ``gloo`` when started with
            ``--weight-transfer-config '{"backend": "gloo"}'``, see ``lit_grpo.serving.vllm_gloo``).
        transfer_address: this machine's address the server connects to (default: the one that routes to it).
        dtype: the weights' dtype on the wire, which must be the server's (default: the one the project's server
            reports; ``bfloat16`` for vLLM).
        rescore: ``True``: when the server holds the policy's current weights (synced at this optimizer step),
            alpha = pi_k and the trainer's first forward gives alpha's log-probs (first-iteration ratio exactly 1;
            needs ``data.reuse_policy_logprobs``). Otherwise the server's sampler log-probs are alpha's. Default:
            ``True`` for the project's server, ``False`` for vLLM (whose kernels differ from the trainer's).
        stop_token_ids: token ids that end a completion besides the server's EOS (the data module passes the
            trainer's EOS ids, so both engines stop alike).
        policy: the policy module, or a callable returning it; vLLM's transfer needs its parameter names and
            shapes before the first gather (the data module passes it).
        lockstep: after generating, agree over the ranks that every request succeeded (one all-reduce), so a
            failure stops every rank at once.
        packed: send a bucket's tensors packed into one ``uint8`` buffer (one broadcast per bucket).
    """

    def __init__(
        self,
        url: str | None = None,
        urls: list[str] | None = None,
        token: str | None = None,
        token_file: str | None = None,
        timeout_s: float = 60.0,
        generate_timeout_s: float = 900.0,
        kind: str = "lit_grpo",
        bucket_mb: float = 64.0,
        backend: str | None = None,
        transfer_address: str | None = None,
        dtype: str | None = None,
        rescore: bool | None = None,
        stop_token_ids: Iterable[int] | None = None,
        policy: nn.Module | Callable[[], nn.Module] | None = None,
        lockstep: bool = True,
        packed: bool = True,
    ) -> None:
        from lit_grpo.serving.weight_transfer import BACKENDS, DTYPES

        if (url is None) == (urls is None):
            raise ValueError("ServerEngine needs exactly one of url (one server) and urls (a list of servers)")
        urls = [url] if url is not None else list(urls or [])
        if not urls or len(set(urls)) != len(urls) or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"urls must be a non-empty list of distinct server URLs, got {urls!r}")
        if kind not in KINDS:
            raise ValueError(f"unknown server kind {kind!r}; expected one of {KINDS}")
        for name, value in (("timeout_s", timeout_s), ("generate_timeout_s", generate_timeout_s),
                            ("bucket_mb", bucket_mb)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        if backend is None:
            backend = "nccl" if kind == "vllm" else "gloo"
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        if token is None and token_file is not None:
            with open(os.path.expanduser(token_file)) as f:
                token = f.read().strip()
        if token is None:
            token = os.environ.get(TOKEN_ENV, "").strip() or None
        if token is None and kind == "lit_grpo":
            raise ValueError(f"ServerEngine needs the server's token: engine_options.token, token_file or ${TOKEN_ENV}")
        self.kind = kind
        self.timeout_s = float(timeout_s)
        self.generate_timeout_s = float(generate_timeout_s)
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.backend = backend
        self.transfer_address = transfer_address
        self.rescore = (kind == "lit_grpo") if rescore is None else bool(rescore)
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids}) if stop_token_ids is not None else []
        self._policy = policy
        self.lockstep = bool(lockstep)
        self.packed = bool(packed)
        self.servers = [ServerConnection(u, token, self.timeout_s) for u in urls]
        self.synced_step = 0
        self.reference_version: str | None = None  # the label of the pi_ref pushed to the servers
        #: set by the data module (``data.reference_on_server``): WeightSync pushes pi_ref before the policy
        self.serves_reference = False
        #: called on every rank before each push (the asynchronous producer's ``drain``), see ``load_weights``
        self.before_push: list[Callable[[], None]] = []
        #: rank 0's timing of the last push to the project's servers: begin (pause, start), gather (the
        #: iterator: FSDP gathers and casts), send (pack, announce, broadcast), finish (swap, version, resume)
        self.last_push: dict[str, float] = {}
        self._pack_buffer: torch.Tensor | None = None
        #: rank 0's receive memory for the FSDP2 gather (``rank0_buckets``), kept across pushes
        self._gather_buffer = GatherBuffer()
        self.dtype = self._server_dtype(dtype)

    # ---- servers ------------------------------------------------------------------------------------
    def _server_dtype(self, requested: str | None) -> torch.dtype:
        """Check every server answers (URL and token right) and agree on the dtype weights travel in."""
        from lit_grpo.serving.weight_transfer import dtype_from_name

        if self.kind == "vllm":
            from lit_grpo.serving.vllm_client import vllm_dtype

            return vllm_dtype(self.servers, requested)
        found = set()
        for server in self.servers:
            dtypes = server.client.get("/weight_info").get("dtypes") or []
            if len(dtypes) != 1:
                raise ServerError(f"rollout server {server.url} reports weight dtypes {dtypes}; expected exactly one")
            found.add(dtypes[0])
        if len(found) > 1:
            raise ValueError(f"the rollout servers hold weights in different dtypes {sorted(found)}")
        (served,) = found
        if requested is not None and requested != served:
            raise ValueError(f"dtype {requested!r} was asked for, but the server holds {served!r}")
        return dtype_from_name(served)

    def policy(self) -> nn.Module:
        """The policy module (given, or returned by the given callable)."""
        policy = self._policy() if callable(self._policy) and not isinstance(self._policy, nn.Module) else self._policy
        if policy is None:
            raise ValueError("kind 'vllm' needs the policy module (engine option `policy`) to declare the "
                             "parameters' names and shapes before they are gathered")
        return policy

    def weight_versions(self) -> dict[str, str | None]:
        """The ``weight_version`` each server reports now."""
        return {s.url: version_text(s.client.get("/weight_info").get("weight_version")) for s in self.servers}

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Each server's SHA-256 of every parameter (``POST /weight_checker``), for exact comparisons."""
        return {s.url: s.client.post("/weight_checker", {"action": "checksum"})["checksums"] for s in self.servers}

    def close(self) -> None:
        for server in self.servers:
            server.close_group()

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> list[list[Completion]]:
        """``n`` completions per prompt from the servers; all ranks stop together if one request fails
        (``request_rollouts``, then ``check_lockstep``)."""
        return self.check_lockstep(self.request_rollouts(prompts, n, sampling, seed))

    def request_rollouts(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> Rollouts:
        """This rank's completion requests, HTTP only: no torch.distributed call, so it is safe on a background
        thread. The prompts are spread over the servers in contiguous chunks, one request per chunk, sent in
        parallel. Bad arguments raise ``ValueError`` at once; a failed request (``ServerError``, or an odd answer)
        comes back as ``Rollouts.error``, for ``check_lockstep`` to share with the other ranks."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        try:
            return Rollouts(self._generate(prompts, n, sampling, seed))
        except ServerError as err:
            return Rollouts(None, str(err))
        except Exception as err:  # noqa: BLE001 (an odd answer: still stop every rank together)
            return Rollouts(None, f"rollout request failed: {type(err).__name__}: {err}")

    def check_lockstep(self, rollouts: Rollouts) -> list[list[Completion]]:
        """On the training thread, after this rank's requests: with ``lockstep`` and more than one rank, one
        ``all_reduce`` (a collective every rank must reach) tells every rank whether all requests succeeded; if
        one failed, every rank raises ``ServerError`` (the failing rank with its own message). Returns
        ``rollouts.groups``."""
        error = rollouts.error
        _, world = rank_and_world()
        if self.lockstep and world > 1 and not everyone(error is None) and error is None:
            error = "a rollout request of another rank failed (its log names the server and the error)"
        if error is not None:
            raise ServerError(error)
        return rollouts.groups  # type: ignore[return-value]

    def _requests(self, prompts: list[list[int]], n: int, seed: int) -> list[tuple[ServerConnection, list[int], int]]:
        """``(server, prompt indices, seed)`` per request. The project's server takes one request per server
        (a contiguous chunk of prompts, seeded as one ``TransformersEngine.generate`` call: with one server the
        rollouts equal the in-process engine's). vLLM gets one request per prompt (``vllm_requests``)."""
        if self.kind == "vllm":
            from lit_grpo.serving.vllm_client import vllm_requests

            return vllm_requests(self.servers, prompts, n, seed)
        chunks = min(len(self.servers), len(prompts))
        out = []
        for c in range(chunks):
            indices = list(range(c * len(prompts) // chunks, (c + 1) * len(prompts) // chunks))
            chunk_seed = int(seed) if c == 0 else (int(seed) * CHUNK_SEED_STRIDE + c) % SEED_MODULUS
            out.append((self.servers[c], indices, chunk_seed % 2**63))
        return out

    def _generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                  seed: int) -> list[list[Completion]]:
        if not prompts:
            return []
        requests = self._requests(prompts, n, seed)
        results: list[list[Completion] | None] = [None] * len(prompts)
        with ThreadPoolExecutor(max_workers=min(32, len(requests))) as pool:
            futures = [pool.submit(self._complete, server, [prompts[i] for i in indices], n, sampling, s)
                       for server, indices, s in requests]
            for (_, indices, _), future in zip(requests, futures):
                for i, group in zip(indices, future.result()):
                    results[i] = group
        return results  # type: ignore[return-value]

    def _complete(self, server: ServerConnection, prompts: list[list[int]], n: int, sampling: SamplingConfig,
                  seed: int) -> list[list[Completion]]:
        body = {"prompt": [[int(t) for t in p] for p in prompts], "n": n, "seed": int(seed),
                "temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_new_tokens,
                "logprobs": 0, "return_token_ids": True, "return_weight_versions": True}
        if self.stop_token_ids:
            body["stop_token_ids"] = self.stop_token_ids
        deadline = time.monotonic() + self.generate_timeout_s
        wait = 0.1
        while True:
            try:
                response = server.client.post("/v1/completions", body, timeout_s=self.generate_timeout_s)
                break
            except ServerError as err:
                if err.status != 503 or time.monotonic() + wait > deadline:
                    raise
                time.sleep(wait)  # paused for another trainer's weight update: wait for /resume
                wait = min(2 * wait, 2.0)
        return self._groups(server, response, len(prompts), n)

    def _groups(self, server: ServerConnection, response: dict, num_prompts: int, n: int) -> list[list[Completion]]:
        where = f"rollout server {server.url}"
        choices = response.get("choices")
        if not isinstance(choices, list) or len(choices) != num_prompts * n:
            got = len(choices) if isinstance(choices, list) else choices
            raise ServerError(f"{where} returned {got} completions for {num_prompts} prompts x n={n}")
        choices = sorted(choices, key=lambda c: c.get("index", -1))
        if [c.get("index") for c in choices] != list(range(num_prompts * n)):
            raise ServerError(f"{where} returned completion indices that are not 0..{num_prompts * n - 1}")
        versions, unknown = set(), False
        completions = []
        for c in choices:
            ids, logprobs = c.get("token_ids"), (c.get("logprobs") or {}).get("token_logprobs")
            if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
                raise ServerError(f"{where} returned a completion without token_ids and one log-prob per token")
            if any(v is None for v in logprobs):
                raise ServerError(f"{where} returned a completion with a missing log-prob")
            if c.get("finish_reason") not in ("stop", "length"):
                raise ServerError(f"{where} did not finish a completion (finish_reason={c.get('finish_reason')!r})")
            spans = c.get("weight_versions")
            spans = tuple(version_text(s.get("version")) for s in spans) if spans else ()
            versions.update(spans)
            unknown = unknown or not spans
            completions.append(Completion([int(t) for t in ids], [float(v) for v in logprobs],
                                          truncated=c.get("finish_reason") == "length", versions=spans))
        if unknown:
            version = (version_text(response["weight_version"]) if "weight_version" in response
                       else version_text(server.client.get("/weight_info").get("weight_version")))
            versions.add(version)
            completions = [c if c.versions else replace(c, versions=(version,)) for c in completions]
        expected = server.expected_version
        if expected is None or versions != {expected}:
            if expected is None:
                raise ServerError(f"{where} holds weight version {sorted(map(str, versions))} and this trainer has "
                                  "pushed no weights to it yet: WeightSync (the `sync` section) pushes them when "
                                  "training starts")
            raise ServerError(f"{where} sampled with weight version {sorted(map(str, versions))}, but this trainer "
                              f"pushed version {expected!r} to it: the server restarted or another trainer pushed "
                              "weights. Resume from the last checkpoint; the resumed run pushes the policy again")
        return [completions[p * n : (p + 1) * n] for p in range(num_prompts)]

    # ---- the rest of the interface ------------------------------------------------------------------
    def score(self, batch, temperature: float) -> torch.Tensor | None:  # noqa: ANN001
        """``None``: the server's sampler log-probs are alpha's (and alpha = pi_k when synced, see ``rescore``)."""
        return None

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """``None``: the weights live in the server. A checkpoint taken while the server lags the policy (v > 1,
        between syncs) therefore cannot restore it; the resumed run pushes the current policy instead
        (``WeightSync`` warns) and is not an exact continuation. Checkpoints taken right after a sync resume
        exactly."""
        return None


def check_servers(engine_options: dict[str, Any]) -> None:
    """Before anything loads: the engine options are valid and every server answers with the right token.
    Raises ``ValueError`` (one line, naming the URL) otherwise, so the CLI reports it as a usage error."""
    try:
        ServerEngine(**engine_options).close()
    except ServerError as err:
        raise ValueError(f"the rollout server does not answer: {err}. Start it first (python -m lit_grpo serve) "
                         "or fix data.engine_options") from None
    except TypeError as err:
        raise ValueError(f"bad data.engine_options for a rollout server: {err}") from None
