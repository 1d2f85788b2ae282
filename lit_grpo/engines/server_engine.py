"""`ServerEngine`: rollouts from one or more rollout servers over HTTP (the paper's layout: a GPU serves
rollouts, the FSDP ranks train), the policy's weights pushed to them every v batches.

Two kinds of server speak the same protocol (``lit_grpo.server`` documents it):

- ``kind: lit_grpo``: the project's own ``python -m lit_grpo serve`` (transformers, CPU or one GPU). Weights
  travel over a process group of the trainer's rank 0 and the server (``lit_grpo.weight_transfer``), gloo or
  NCCL, in buckets announced over HTTP.
- ``kind: vllm``: a ``VLLM_SERVER_DEV_MODE=1 vllm serve M --weight-transfer-config '{"backend":"nccl"}'
  --logprobs-mode processed_logprobs`` (0.33). The transfer is vLLM's own trainer side
  (``WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...), client=HTTPVLLMWeightSyncClient(url),
  source=...)``, ``send_weights()``), imported only when used.

A push, on either kind: ``/pause?mode=wait`` -> ``/start_weight_update`` -> ``/update_weights`` (per bucket) ->
``/finish_weight_update {"weight_version": "<step>"}`` -> ``GET /weight_info`` -> ``/resume``.

How the ranks take part (``load_weights`` is called on every rank with an iterator whose iteration gathers the
full parameters, a collective):

- every rank takes part in the gathers; only rank 0 talks to the servers. For an FSDP2 policy (the
  ``full_named_parameters`` iterator ``WeightSync`` passes, not yet started) the gather goes to rank 0 only
  (``lit_grpo.distributed.rank0_buckets``): the other ranks send their shards point to point, one bucket at a
  time, into a receive buffer rank 0 keeps across pushes, instead of every rank all-gathering every parameter;
  anything else is iterated on every rank as given. Rank 0 sends a bucket (``bucket_mb``) as soon as its gathers
  are done and before the next gather, so no trainer collective interleaves with a transfer and rank 0 never
  holds more than one bucket beyond its own shards;
- the bytes go out on a daemon thread while the HTTP call, with a timeout, stays on the main thread; every
  response is checked. The broadcast's wait blocks that thread until the bytes are through or the transfer
  group's own timeout (``timeout_s``) has passed, NCCL included (``weight_transfer.wait_work``), and its failure
  is a ``ServerError`` naming the server;
- rank 0 keeps consuming the iterator after a failure (the other ranks are in the gathers), then every rank
  learns the outcome in one ``all_gather_object`` and they raise together: a dead server stops training within
  ``timeout_s`` with its URL in the message, and no rank waits on a collective;
- ``synced_step`` is the ``weight_version`` the server reports after the push (every rank gets rank 0's); each
  completion carries the version it was sampled with, and rollouts from any other version are refused.

Generation: every rank sends its own prompts (no collective while the server generates), spread over the
servers in contiguous chunks; afterwards one ``all_reduce`` of a flag lets all ranks stop together when one
request failed (``lockstep``).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlencode, urlsplit

import torch
from torch import nn

from lit_grpo.distributed import (
    GatherBuffer,
    all_gather_objects,
    everyone,
    fsdp2_source,
    full_named_parameters,
    is_fsdp1,
    rank0_buckets,
    rank_and_world,
)
from lit_grpo.engines.base import Completion, RolloutEngine, SamplingConfig

TOKEN_ENV = "LIT_GRPO_SERVER_TOKEN"
KINDS = ("lit_grpo", "vllm")
#: seeds of the chunks after the first when prompts are spread over several servers
CHUNK_SEED_STRIDE = 1_000_003
SEED_MODULUS = 2**62
#: seconds the main thread waits for a bucket's broadcast beyond ``timeout_s``, so that the transfer group's own
#: timeout (the same ``timeout_s``) is what reports a stuck transfer
SEND_GRACE_S = 5.0


class ServerError(RuntimeError):
    """A rollout server could not be reached or answered with an error; the message names its URL."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


def transfer_error(url: str, tensors: int, error: BaseException | None, timeout_s: float) -> ServerError:
    """The ``ServerError`` for a bucket whose bytes did not go through: the transfer group's own failure (NCCL's
    ``DistBackendError`` on a timeout or a dead peer, gloo's ``RuntimeError``, ``TimeoutError``), or no end of the
    broadcast thread at all, with the server's URL and the type of the error."""
    reason = (f"{type(error).__name__}: {error}" if error is not None
              else f"not finished within {timeout_s:g} s")
    return ServerError(f"rollout server {url}: sending a bucket of {tensors} tensors failed: {reason}")


class HTTPClient:
    """JSON over HTTP to one server, with a bearer token and a timeout on every call; no proxies."""

    def __init__(self, url: str, token: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def request(self, method: str, path: str, body: dict | None = None, query: dict | None = None,
                timeout_s: float | None = None) -> dict:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        target = self.url + path + (f"?{urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(target, data=data, headers=headers, method=method)
        where = f"rollout server {self.url}: {method} {path}"
        try:
            with self._opener.open(request, timeout=timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{where} returned {err.code}: {_error_message(err)}", status=err.code) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise ServerError(f"{where} failed: {reason} (timeout {timeout:g} s)") from None
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError:
            raise ServerError(f"{where} answered with something that is not JSON: {raw[:200]!r}") from None

    def get(self, path: str, **kwargs: Any) -> dict:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, body: dict | None = None, **kwargs: Any) -> dict:
        return self.request("POST", path, body, **kwargs)


def _error_message(err: urllib.error.HTTPError) -> str:
    try:
        payload = json.loads(err.read() or b"{}")
    except (ValueError, OSError):
        return err.reason
    error = payload.get("error", payload.get("detail", payload)) if isinstance(payload, dict) else payload
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)


def _version_text(version: Any) -> str | None:
    return None if version is None else str(version)


class _Server:
    """One server: its HTTP client and, for the project's server, the weight-transfer group (rank 0 only)."""

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
        from lit_grpo.weight_transfer import close_group

        close_group(self.group)
        if self.listener is not None:
            self.listener.close()
        self.group = self.store = self.listener = None


class ServerEngine(RolloutEngine):
    """Rollouts from rollout servers (``data.engine: server``, ``data.engine_options: {url: ..., ...}``).

    Args:
        url / urls: one server, or several (each step's prompts are spread over them; weights go to all).
        token / token_file: the servers' bearer token; default ``$LIT_GRPO_SERVER_TOKEN``. Prefer the
            environment or a file: a config's values are saved with the run.
        timeout_s: limit of every control call and of each bucket's transfer; keep it below the trainer's
            process-group timeout, since the other ranks wait in a gather while rank 0 sends a bucket.
        generate_timeout_s: limit of one completion request (and of waiting for a paused server).
        kind: ``lit_grpo`` (``python -m lit_grpo serve``) or ``vllm`` (``vllm serve`` 0.33 in dev mode).
        bucket_mb: size of the buckets rank 0 gathers, then sends (lit_grpo kind).
        backend: ``gloo`` (CPU) or ``nccl`` (GPU) for the weight transfer to the project's server.
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
        backend: str = "gloo",
        transfer_address: str | None = None,
        dtype: str | None = None,
        rescore: bool | None = None,
        stop_token_ids: Iterable[int] | None = None,
        policy: nn.Module | Callable[[], nn.Module] | None = None,
        lockstep: bool = True,
        packed: bool = True,
    ) -> None:
        from lit_grpo.weight_transfer import BACKENDS, DTYPES

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
        self.servers = [_Server(u, token, self.timeout_s) for u in urls]
        self.synced_step = 0
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
        from lit_grpo.weight_transfer import dtype_from_name

        if self.kind == "vllm":
            for server in self.servers:
                server.client.get("/get_world_size")
            return dtype_from_name(requested or "bfloat16")
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

    def weight_versions(self) -> dict[str, str | None]:
        """The ``weight_version`` each server reports now."""
        return {s.url: _version_text(s.client.get("/weight_info").get("weight_version")) for s in self.servers}

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        """Each server's SHA-256 of every parameter (``POST /weight_checker``), for exact comparisons."""
        return {s.url: s.client.post("/weight_checker", {"action": "checksum"})["checksums"] for s in self.servers}

    def close(self) -> None:
        for server in self.servers:
            server.close_group()

    # ---- generation ---------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingConfig, seed: int) -> list[list[Completion]]:
        """``n`` completions per prompt from the servers; all ranks stop together if one request fails."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        error, groups = None, None
        try:
            groups = self._generate(prompts, n, sampling, seed)
        except ServerError as err:
            error = str(err)
        except Exception as err:  # noqa: BLE001 (an odd answer: still stop every rank together)
            error = f"rollout request failed: {type(err).__name__}: {err}"
        _, world = rank_and_world()
        if self.lockstep and world > 1 and not everyone(error is None) and error is None:
            error = "a rollout request of another rank failed (its log names the server and the error)"
        if error is not None:
            raise ServerError(error)
        return groups

    def _requests(self, prompts: list[list[int]], n: int, seed: int) -> list[tuple[_Server, list[int], int]]:
        """``(server, prompt indices, seed)`` per request. The project's server takes one request per server
        (a contiguous chunk of prompts, seeded as one ``TransformersEngine.generate`` call: with one server the
        rollouts equal the in-process engine's). vLLM gives the prompts of one request the same seeds, so it gets
        one request per prompt, seeded like ``VLLMEngine``."""
        if self.kind == "vllm":
            from lit_grpo.engines.vllm_engine import prompt_seed

            k = len(self.servers)
            return [(self.servers[p * k // len(prompts)], [p], prompt_seed(seed, p, n)) for p in range(len(prompts))]
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

    def _complete(self, server: _Server, prompts: list[list[int]], n: int, sampling: SamplingConfig,
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

    def _groups(self, server: _Server, response: dict, num_prompts: int, n: int) -> list[list[Completion]]:
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
            if spans:
                versions.update(_version_text(s.get("version")) for s in spans)
            else:
                unknown = True
            completions.append(Completion([int(t) for t in ids], [float(v) for v in logprobs],
                                          truncated=c.get("finish_reason") == "length"))
        if unknown:
            versions.add(_version_text(response["weight_version"]) if "weight_version" in response
                         else _version_text(server.client.get("/weight_info").get("weight_version")))
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

    # ---- weights ------------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], step: int) -> None:
        """Push the full parameters to every server (rank 0 sends, every rank gathers), then record the version
        the servers report. Raises ``ServerError`` on every rank if the push failed on any server; a server left
        behind keeps its previous weights and version.

        Given a ``full_named_parameters`` iterator of an FSDP2 module that has not started (what ``WeightSync``
        passes), the project's server is fed by ``rank0_buckets``: the other ranks send their shards point to
        point to rank 0, one bucket at a time, instead of every rank all-gathering every parameter. Anything
        else (plain, DDP, FSDP1 modules, weights already gathered) is iterated on every rank as given."""
        rank, world = rank_and_world()
        module = fsdp2_source(named_tensors) if self.kind == "lit_grpo" else None
        if self.kind == "vllm":
            outcome = self._push_vllm(iter(named_tensors), int(step), rank)
        elif rank == 0:
            outcome = self._push(named_tensors, module, int(step))
        else:
            for _ in rank0_buckets(module, self.bucket_bytes) if module is not None else named_tensors:
                pass  # sends this rank's shards, or runs the gathers of the iterator
            outcome = {"error": None}
        outcomes = all_gather_objects(outcome) if world > 1 else [outcome]
        errors = [o["error"] for o in outcomes if o["error"]]
        if errors:
            for server in self.servers:  # its version is no longer known on any rank
                server.expected_version = None
            raise ServerError(errors[0])
        versions = outcomes[0]["versions"]
        for server in self.servers:
            server.expected_version = versions[server.url]
        self.synced_step = int(versions[self.servers[0].url])

    def _cast(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        target = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device=device, dtype=target)

    def _buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], module: nn.Module | None,
                 convert: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Rank 0's buckets of full tensors in the wire dtype: gathered to rank 0 by ``rank0_buckets`` (an FSDP2
        ``module``, into a receive buffer kept across pushes), or grouped from the iterator as it is gathered."""
        from lit_grpo.weight_transfer import buckets

        if module is None:
            return buckets(iter(named_tensors), self.bucket_bytes, convert)
        gathered = rank0_buckets(module, self.bucket_bytes, self._gather_buffer)
        return ([(name, convert(tensor)) for name, tensor in bucket] for bucket in gathered)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], module: nn.Module | None, step: int) -> dict:
        """Rank 0's push to the project's servers: the buckets are consumed to the end whatever happens (the other
        ranks are in the gathers)."""
        from lit_grpo.weight_transfer import transport_device

        device = transport_device(self.backend)
        failed: list[Exception] = []
        times = dict(begin_s=0.0, gather_s=0.0, send_s=0.0, finish_s=0.0, bytes=0, buckets=0)
        mark = time.perf_counter()
        try:
            for server in self.servers:
                self._begin(server)
        except Exception as err:  # noqa: BLE001 (reported on every rank after the gathers)
            failed.append(err)
        times["begin_s"] = time.perf_counter() - mark

        def convert(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if failed else self._cast(tensor, device)

        mark = time.perf_counter()
        for bucket in self._buckets(named_tensors, module, convert):  # the gathers run here
            gathered = time.perf_counter()
            times["gather_s"] += gathered - mark
            if not failed:
                try:
                    info, payload = self._payload(bucket, device)
                    for server in self.servers:
                        self._send(server, info, payload)
                except Exception as err:  # noqa: BLE001 (reported on every rank after the gathers)
                    failed.append(err)
                times["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
                times["buckets"] += 1
            mark = time.perf_counter()
            times["send_s"] += mark - gathered
        versions = {}
        if not failed:
            try:
                for server in self.servers:
                    versions[server.url] = self._finish(server, str(step))
            except Exception as err:  # noqa: BLE001 (reported on every rank)
                failed.append(err)
        times["finish_s"] = time.perf_counter() - mark
        self.last_push = times
        if failed:
            for server in self.servers:
                self._abandon(server)
            return {"error": f"weight push of step {step} failed: {failed[0]}"}
        return {"error": None, "versions": versions}

    def _begin(self, server: _Server) -> None:
        info = server.client.get("/weight_info")
        if server.group is None or not info.get("transfer_group"):
            self._init_group(server)
        server.client.post("/pause", query={"mode": "wait"})
        server.client.post("/start_weight_update")

    def _init_group(self, server: _Server) -> None:
        from lit_grpo.weight_transfer import local_address_towards, open_group, open_store

        server.close_group()
        address = self.transfer_address or local_address_towards(server.host)
        try:
            store, listener = open_store(address, self.timeout_s)
        except Exception as err:  # noqa: BLE001
            raise ServerError(f"could not open the weight-transfer store on {address} for {server.url}: {err}") from err
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = open_group(store, 0, 2, self.backend, self.timeout_s, address)
            except Exception as err:  # noqa: BLE001 (reported on the main thread)
                joined["error"] = err

        thread = threading.Thread(target=join, name="lit_grpo-weight-group", daemon=True)
        thread.start()
        init_info = {"master_address": address, "master_port": store.port, "rank_offset": 1, "world_size": 2,
                     "backend": self.backend, "timeout_s": self.timeout_s, "packed": self.packed}
        try:
            server.client.post("/init_weight_transfer_engine", {"init_info": init_info})
        except ServerError:
            listener.close()
            raise
        thread.join(self.timeout_s)
        if thread.is_alive() or "error" in joined:
            listener.close()
            raise ServerError(f"rollout server {server.url}: the weight-transfer group did not form "
                              f"({joined.get('error', f'no answer within {self.timeout_s:g} s')})")
        server.group, server.store, server.listener = joined["group"], store, listener

    def _payload(self, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[dict, list[torch.Tensor]]:
        """A bucket's announcement (``update_info``) and the tensors that carry its bytes: one packed ``uint8``
        tensor (a view when the tensors already lie back to back, as ``rank0_buckets`` leaves them; else written
        into a buffer kept across buckets and pushes), or the tensors themselves."""
        from lit_grpo.weight_transfer import dtype_name, pack, packed_view

        tensors = [t for _, t in bucket]
        info = {"names": [name for name, _ in bucket], "dtype_names": [dtype_name(t.dtype) for t in tensors],
                "shapes": [list(t.shape) for t in tensors]}
        if not self.packed:
            return info, [t.contiguous() for t in tensors]
        view = packed_view(tensors, device)
        if view is not None:
            return info, [view]
        if len(tensors) > 1 and (self._pack_buffer is None or self._pack_buffer.device != device):
            self._pack_buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        return info, [pack(tensors, device, self._pack_buffer)]

    def _send(self, server: _Server, info: dict, payload: list[torch.Tensor]) -> None:
        """Announce a bucket over HTTP (main thread, with a timeout) while its bytes go out on a daemon thread.
        The broadcast's wait blocks that thread until the bytes are through or the transfer group's own timeout
        has passed (also with NCCL, whose plain ``wait()`` does not block the host); its failure, or no end
        within the timeout and a grace, is a ``ServerError`` naming the server."""
        from lit_grpo.weight_transfer import wait_work

        names = info["names"]
        sent: dict[str, Any] = {}
        group = server.group

        def broadcast() -> None:
            try:
                for tensor in payload:
                    wait_work(group.broadcast(tensor, root=0), self.timeout_s)
                sent["done"] = True
            except Exception as err:  # noqa: BLE001 (reported on the main thread)
                sent["error"] = err

        thread = threading.Thread(target=broadcast, name="lit_grpo-weight-broadcast", daemon=True)
        thread.start()
        server.client.post("/update_weights", {"update_info": info})
        thread.join(self.timeout_s + SEND_GRACE_S)  # the group's timeout fires first, with its own message
        if "error" in sent or not sent.get("done"):
            raise transfer_error(server.url, len(names), sent.get("error"), self.timeout_s)

    def _finish(self, server: _Server, version: str) -> str:
        server.client.post("/finish_weight_update", {"weight_version": version})
        got = _version_text(server.client.get("/weight_info").get("weight_version"))
        server.client.post("/resume")
        if got != version:
            raise ServerError(f"rollout server {server.url} reports weight version {got!r} after a push of {version!r}")
        return got

    def _abandon(self, server: _Server) -> None:
        """After a failed push: drop the group (the next push forms a new one) and let the server generate again
        (it kept its previous weights)."""
        server.close_group()
        server.expected_version = None
        try:
            server.client.post("/resume", timeout_s=min(5.0, self.timeout_s))
        except ServerError:
            pass

    # ---- vLLM ---------------------------------------------------------------------------------------
    def policy(self) -> nn.Module:
        policy = self._policy() if callable(self._policy) and not isinstance(self._policy, nn.Module) else self._policy
        if policy is None:
            raise ValueError("kind 'vllm' needs the policy module (engine option `policy`) to declare the "
                             "parameters' names and shapes before they are gathered")
        return policy

    def _vllm_parts(self, server: _Server, rank: int) -> tuple[Any, Any, Any]:
        """vLLM's trainer side for one server, built once on every rank (rank 0 forms the NCCL group)."""
        if server.vllm is not None:
            return server.vllm
        try:
            from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
        except ImportError as err:
            raise ImportError("kind 'vllm' needs vLLM's trainer side: pip install 'lit_grpo[vllm]'") from err
        from lit_grpo.engines.vllm_engine import free_port
        from lit_grpo.weight_transfer import local_address_towards

        policy = self.policy()
        if is_fsdp1(policy):
            raise ValueError("kind 'vllm' cannot declare FSDP1 (FullyShardedDataParallel) parameters; use FSDP2 "
                             "(ModelParallelStrategy) or DDP")
        client = _versioned_vllm_client(server.url, self.timeout_s)
        source = _policy_source(policy, self.dtype)
        world = 1 + int(server.client.get("/get_world_size")["world_size"])
        address = self.transfer_address or local_address_towards(server.host)
        info = NCCLTrainerInitInfo(address, free_port() if rank == 0 else 0, world, rank=rank)
        engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
        server.vllm = (client, source, engine)
        return server.vllm

    def _push_vllm(self, iterator: Iterator[tuple[str, torch.Tensor]], step: int, rank: int) -> dict:
        """Every rank runs vLLM's ``send_weights`` (the sender broadcasts, the others only gather). The first
        server consumes the given iterator; further servers gather the policy again."""
        failed: list[str] = []
        versions: dict[str, str] = {}
        for index, server in enumerate(self.servers):
            tensors = iterator if index == 0 else full_named_parameters(self.policy())
            try:
                client, source, engine = self._vllm_parts(server, rank)
                if rank == 0:
                    server.client.post("/pause", query={"mode": "wait"})
                    client.next_version = str(step)
                source.current = tensors
                engine.send_weights()  # start -> update (with the broadcast) -> finish(weight_version)
                if rank == 0:
                    versions[server.url] = _version_text(server.client.get("/weight_info").get("weight_version"))
                    server.client.post("/resume")
                    if versions[server.url] != str(step):
                        raise ServerError(f"rollout server {server.url} reports weight version "
                                          f"{versions[server.url]!r} after a push of {str(step)!r}")
            except Exception as err:  # noqa: BLE001 (collected, raised on every rank together)
                failed.append(f"weight push of step {step} to {server.url} failed on rank {rank}: {err}")
                server.vllm = None  # a broken NCCL group: the next push forms a new one
                server.expected_version = None
                for _ in tensors:  # the other ranks are in the gathers
                    pass
                if rank == 0:
                    try:
                        server.client.post("/resume", timeout_s=min(5.0, self.timeout_s))
                    except ServerError:
                        pass
        if failed:
            return {"error": failed[0]}
        return {"error": None, "versions": versions}

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


def _versioned_vllm_client(url: str, timeout_s: float) -> Any:
    """vLLM's ``HTTPVLLMWeightSyncClient`` whose ``finish_weight_update`` carries the version being pushed
    (``send_weights`` calls it without one)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    class VersionedClient(HTTPVLLMWeightSyncClient):
        next_version: str | None = None

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            super().finish_weight_update(weight_version if weight_version is not None else self.next_version)

    return VersionedClient(url, timeout=timeout_s)


def _policy_source(policy: nn.Module, dtype: torch.dtype) -> Any:
    """A vLLM ``WeightSource`` over the policy: metadata from the parameters' full shapes (no gather), under
    their model names, in the wire dtype; ``iter_full`` replays the push's iterator (set as ``current``)."""
    from functools import cached_property

    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    from lit_grpo.distributed import strip_wrapper_prefixes

    class PolicySource(WeightSource):
        current: Iterator[tuple[str, torch.Tensor]] | None = None

        @cached_property
        def metadata(self) -> list:
            return [ParamMeta(strip_wrapper_prefixes(name), dtype if p.is_floating_point() else p.dtype,
                              tuple(p.shape)) for name, p in policy.named_parameters()]

        def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
            tensors, self.current = self.current, None
            for name, tensor in tensors or ():
                yield name, tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()

    return PolicySource()
