"""What ``ServerEngine`` and its ``WeightPusher`` do differently for ``kind: vllm``: a ``VLLM_SERVER_DEV_MODE=1 vllm
serve M --weight-transfer-config '{"backend":"nccl"}' --logprobs-mode processed_logprobs`` (vLLM 0.32 or 0.33; with
``"backend":"gloo"`` on a CPU, through this package's plugin ``lit_grpo.wire.vllm_gloo``).

- Requests: vLLM gives the prompts of one request the same seeds, so each prompt is a request of its own, seeded
  like ``VLLMEngine`` (``vllm_requests``).
- Weights travel in bfloat16 unless ``dtype`` says otherwise (``vllm_dtype``).
- The push is vLLM's own trainer side (``WeightTransferTrainerFactory.trainer_init(NCCLTrainerInitInfo(...),
  client=HTTPVLLMWeightSyncClient(url), source=...)``, ``send_weights()``) on every rank (``push_vllm``); the
  option ``backend: gloo`` swaps in ``GlooTrainerInitInfo`` and nothing else changes.

This module is imported only for that kind, and vLLM itself only inside the functions that need it (it is an
optional extra).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.core.distributed import all_gather_objects, full_named_parameters, is_fsdp1, rank_and_world
from lit_grpo.engines.options import ServerOptions
from lit_grpo.engines.remote.connection import ServerConnection
from lit_grpo.engines.remote.fleet import Fleet
from lit_grpo.engines.remote.vllm_verify import (
    PushNotApplied,
    SentRecord,
    check_push,
    checksums_of,
    served_digests,
    stale_warning,
)
from lit_grpo.wire.protocol import ServerError, version_text

#: the wire dtype when none is asked for
DEFAULT_DTYPE = "bfloat16"


def vllm_dtype(servers: list[ServerConnection], requested: str | None) -> torch.dtype:
    """Check every server answers (URL and token right) and return the dtype weights travel in."""
    from lit_grpo.wire.weight_transfer import dtype_from_name

    for server in servers:
        server.client.get("/get_world_size")
    return dtype_from_name(requested or DEFAULT_DTYPE)


def vllm_requests(servers: list[ServerConnection], prompts: list[list[int]], n: int, seed: int,
                  chosen: list[int]) -> list[tuple[ServerConnection, list[int], int]]:
    """``(server, [prompt index], seed)`` per prompt, prompt ``p`` sent to server ``chosen[p]`` (contiguous runs,
    or its session's server)."""
    from lit_grpo.engines.vllm_engine import prompt_seed

    return [(servers[chosen[p]], [p], prompt_seed(seed, p, n)) for p in range(len(prompts))]


def vllm_parts(server: ServerConnection, options: ServerOptions, dtype: torch.dtype,
               policy_of: Callable[[], nn.Module], rank: int) -> tuple[Any, Any, Any]:
    """vLLM's trainer side for one server, built once on every rank (rank 0 forms the NCCL group)."""
    if server.vllm is not None:
        return server.vllm
    try:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    except Exception as err:  # a CUDA-built torchvision fails with a RuntimeError, not an ImportError
        from lit_grpo.engines.vllm_install import INSTALL_RECIPE, VLLMInstallError, import_failure

        raise VLLMInstallError(f"kind 'vllm' pushes weights with vLLM's trainer side, so the trainer needs vLLM: "
                               f"{import_failure(err)}; {INSTALL_RECIPE}") from err
    from lit_grpo.wire.weight_transfer import local_address_towards

    policy = policy_of()
    if is_fsdp1(policy):
        raise ValueError("kind 'vllm' cannot declare FSDP1 (FullyShardedDataParallel) parameters; use FSDP2 "
                         "(ModelParallelStrategy) or DDP")
    client = versioned_vllm_client(server.url, options.timeout_s, server.client.token)
    source = policy_source(policy, dtype)
    # the other ranks only iterate the source (vLLM's trainer side returns before it reads the group's size), so
    # only rank 0 asks the server: a dead server then fails rank 0's push, which the ranks learn of together
    world = 1 + int(server.client.get("/get_world_size")["world_size"]) if rank == 0 else 1
    address = options.transfer_address or local_address_towards(server.host)
    info = trainer_init_info(options.transfer_backend, address, world, rank, options.bucket_bytes, options.timeout_s,
                             server.client.token)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    server.vllm = (client, source, trainer)
    return server.vllm


def trainer_init_info(backend: str, address: str, world: int, rank: int, bucket_bytes: int, timeout_s: float,
                      token: str | None = None) -> Any:
    """vLLM's trainer-side init info for the push ``backend``: its own ``nccl`` (GPUs), or this package's ``gloo``
    (``lit_grpo.wire.vllm_gloo``; the server must run with ``--weight-transfer-config '{"backend": "gloo"}'``), which
    carries the shared ``token`` its workers check (vLLM's ``nccl`` engine checks none).
    Either way the rest of the push is the same ``trainer_init`` / ``send_weights``."""
    from lit_grpo.engines.vllm_engine import free_port

    if backend == "gloo":
        from lit_grpo.wire.vllm_gloo import trainer_init_info as gloo_init_info

        return gloo_init_info(address, world, rank, bucket_bytes, timeout_s, token)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(address, free_port() if rank == 0 else 0, world, rank=rank)


def push_vllm(servers: list[ServerConnection], options: ServerOptions, dtype: torch.dtype,
              policy: Callable[[], nn.Module], iterator: Iterator[tuple[str, torch.Tensor]], step: int,
              rank: int, pause_mode: str = "wait", fleet: Fleet | None = None) -> dict:
    """Every rank runs vLLM's ``send_weights`` (the sender broadcasts, the others only gather) for each server the
    push goes to: those of ``fleet`` that are up and the down ones that answer again, as rank 0 finds them (shared
    with the other ranks first: every rank gathers once per server). The first server consumes the given iterator;
    further servers gather the ``policy()`` again. A server whose push fails and that no longer answers is dead: it
    is left out (``Fleet``) and the push goes on; a failure of a server that still answers fails the push. A
    server that restarted since the last push (it reports another version than this trainer pushed to it) gets
    vLLM's trainer side anew, so it ``joined``. ``pause_mode``: ``wait`` for the requests in flight, or ``keep``
    them (vLLM 0.32 freezes them in its scheduler with their KV caches and labels their tokens' versions in
    ``weight_versions`` spans; partial rollouts). Returns ``{"error": message}`` or ``{"error": None, "versions":
    {url: version}, "joined": [url]}`` for the push to share over the ranks."""
    fleet = fleet if fleet is not None else Fleet(servers, options.timeout_s)
    found: dict[str, Any] = {"urls": [], "error": None}
    if rank == 0:
        try:
            found["urls"] = [s.url for s in fleet.push_targets()]
        except ServerError as err:
            found["error"] = str(err)
    found = all_gather_objects(found)[0] if rank_and_world()[1] > 1 else found
    if found["error"]:
        for _ in iterator:  # the other ranks are in the gathers
            pass
        return {"error": f"weight push of step {step} failed: {found['error']}"}
    targets = [s for s in servers if s.url in found["urls"]]
    failed: list[str] = []
    versions: dict[str, str] = {}
    joined: list[str] = []
    for index, server in enumerate(targets):
        tensors = iterator if index == 0 else policy_tensors(policy())
        try:
            if rank == 0:
                held = version_text(server.client.get("/weight_info").get("weight_version"))
                if server.vllm is not None and held != server.expected_version:
                    server.close_group()  # restarted (or pushed by another trainer): its transfer engine is new
                if server.vllm is None:
                    joined.append(server.url)
            client, source, trainer = vllm_parts(server, options, dtype, policy, rank)
            if rank == 0:
                server.client.post("/pause", query={"mode": pause_mode})
                client.next_version = str(step)
            source.current = tensors
            source.record = SentRecord() if rank == 0 and options.verify_pushes else None
            trainer.send_weights()  # start -> update (with the broadcast) -> finish(weight_version)
            if rank == 0:
                versions[server.url] = version_text(server.client.get("/weight_info").get("weight_version"))
                if versions[server.url] != str(step):
                    server.client.post("/resume")
                    raise ServerError(f"rollout server {server.url} reports weight version "
                                      f"{versions[server.url]!r} after a push of {str(step)!r}")
                if source.record is not None:  # checked before any request samples from it
                    checksums = checksums_of(server.url,
                                             server.client.post("/weight_checker", {"action": "checksum"}))
                    server.push_check = check_push(server.url, step, source.record, served_digests(checksums),
                                                   server.push_check)
                    if server.push_check.stale:
                        warnings.warn(stale_warning(server.url, server.push_check.stale), stacklevel=2)
                server.client.post("/resume")
        except PushNotApplied as err:  # the server answers, but does not hold the push: the run stops
            versions.pop(server.url, None)
            server.close_group()
            server.expected_version = None
            failed.append(str(err))
            try:  # not left paused; a server that dies now is named by the next request
                server.client.post("/resume", timeout_s=min(5.0, options.timeout_s))
            except ServerError:
                pass
        except Exception as err:  # noqa: BLE001 (collected, raised on every rank together)
            versions.pop(server.url, None)
            server.close_group()  # shuts the broken group, its store and sockets down; the next push forms a new one
            server.expected_version = None
            for _ in tensors:  # the other ranks are in the gathers
                pass
            if rank == 0 and fleet.probe(server) is None:
                continue  # it died during the push: left out, like a server that was down before it
            failed.append(f"weight push of step {step} to {server.url} failed on rank {rank}: {err}")
            if rank == 0:
                try:
                    server.client.post("/resume", timeout_s=min(5.0, options.timeout_s))
                except ServerError:
                    pass
    if not targets:
        for _ in iterator:
            pass
    if failed:
        return {"error": failed[0]}
    if not versions:
        return {"error": f"weight push of step {step} failed: every rollout server was lost during it "
                         f"({', '.join(s.url for s in targets)})"}
    return {"error": None, "versions": versions, "joined": [url for url in joined if url in versions]}


def policy_tensors(policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What a push sends for ``policy``: its full parameters, or for a LoRA policy its base under the plain model's
    names (``lit_grpo.engines.vllm_lora.base_named_tensors``: vLLM takes the adapters by path)."""
    from lit_grpo.models.lora import is_lora

    if is_lora(policy):
        from lit_grpo.engines.vllm_lora import base_named_tensors

        return base_named_tensors(policy)
    return iter(full_named_parameters(policy))


def pushed_parameters(policy: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of what ``policy_tensors`` sends, under the names vLLM loads, without gathering: a
    LoRA policy's base (the plain model's names), else every parameter."""
    from lit_grpo.core.distributed import strip_wrapper_prefixes
    from lit_grpo.models.lora import is_lora, plain_name

    if is_lora(policy):
        return [(plain_name(name), p) for name, p in policy.named_parameters() if ".lora_" not in name]
    return [(strip_wrapper_prefixes(name), p) for name, p in policy.named_parameters()]


def versioned_vllm_client(url: str, timeout_s: float, token: str | None = None) -> Any:
    """vLLM's ``HTTPVLLMWeightSyncClient`` whose ``finish_weight_update`` carries the version being pushed
    (``send_weights`` calls it without one), whose calls send the bearer ``token`` (vLLM's ``--api-key`` guards only
    ``/v1``, but a proxy in front may guard the rest) and whose errors carry the server's message (a refused init
    says why)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    from lit_grpo.wire.protocol import HTTPClient

    class VersionedClient(HTTPVLLMWeightSyncClient):
        next_version: str | None = None

        def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
            HTTPClient(self.base_url, token, self.timeout).post("/" + path, json)

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            super().finish_weight_update(weight_version if weight_version is not None else self.next_version)

    return VersionedClient(url, timeout=timeout_s)


def policy_source(policy: nn.Module, dtype: torch.dtype) -> Any:
    """A vLLM ``WeightSource`` over the policy: metadata from the parameters' full shapes (no gather), under
    their model names (``pushed_parameters``: a LoRA policy's base), in the wire dtype; each round replays the
    push's iterator (set as ``current``).

    vLLM 0.33 reads ``metadata`` as a cached property and the tensors from ``iter_full()``; 0.32 calls
    ``metadata()`` and iterates the source. The class is built for the installed version."""
    from functools import cached_property

    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    from lit_grpo.wire.push_format import check_round

    def metadata(self: Any) -> list:
        meta = [ParamMeta(name, dtype if p.is_floating_point() else p.dtype, tuple(p.shape))
                for name, p in pushed_parameters(policy)]
        # the round's own check (vLLM's NCCL receiver checks nothing before loading: lit_grpo.wire.push_format)
        check_round((m.name, m.dtype, m.shape) for m in meta)
        return meta

    def tensors(self: Any) -> Iterator[tuple[str, torch.Tensor]]:
        current, self.current = self.current, None
        for name, tensor in current or ():
            sent = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
            if self.record is not None:  # rank 0, verify_pushes (lit_grpo.engines.remote.vllm_verify)
                self.record.add(name, sent)
            yield name, sent

    if hasattr(WeightSource, "iter_full"):  # 0.33
        members = {"metadata": cached_property(metadata), "iter_full": tensors}
    else:  # 0.32
        members = {"metadata": metadata, "__iter__": tensors}
    return type("PolicySource", (WeightSource,), {"current": None, "record": None, **members})()


# ---- LoRA adapters (model.lora) on vllm serve --------------------------------------------------------------
#: what the adapters' names start with on the server; a fit's first push unloads earlier fits' leftovers
ADAPTER_PREFIX = "lit_grpo-v"
#: how ``vllm serve`` must be started to take adapters at run time
LORA_SERVE_HINT = ("start vllm serve with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank R "
                   "(R >= model.lora.r, one of 1, 8, 16, 32, ...) --max-loras N (N >= engine_options.lora_keep)")


class ServeAdapters:
    """The adapter versions of a LoRA policy on ``vllm serve`` (``ServerEngine`` with ``kind: vllm``): the sequence
    both vLLM kinds share (``lit_grpo.engines.adapter_versions.VersionedAdapters``, which also counts the merges the
    servers' bases hold) over HTTP (:class:`ServeAdapterCalls`).

    Rank 0 writes each version in peft's format into a fresh directory inside ``lora_dir`` and loads it on every
    server (``POST /v1/load_lora_adapter {"lora_name", "lora_path"}``: the server reads the path, so ``lora_dir``
    must be on a filesystem it shares with rank 0); the newest ``keep`` stay loaded, older ones are unloaded
    (``/v1/unload_lora_adapter``) and removed. The servers were started from their own checkpoint, whose hash
    cannot be compared with the trainer's base, so the first push of a fit and every push with merges reload the
    trainer's base first (``reload_base(step)``: the full-weight push, a collective every rank runs). Every rank
    counts the versions alike, so each rank's requests name the newest (``model: <name>``), and their completions are
    labelled with the step of the adapter they named: vLLM's own ``weight_versions`` label the base, which an adapter
    push leaves as it is."""

    def __init__(self, lora_dir: str | None, keep: int, rank: int, reload_base: Callable[[int], None]) -> None:
        import tempfile
        from pathlib import Path

        from lit_grpo.engines.adapter_versions import AdapterVersions, VersionedAdapters

        if not isinstance(lora_dir, str) or not lora_dir:
            raise ValueError("model.lora with kind 'vllm' needs data.engine_options.lora_dir: a directory rank 0 "
                             "writes the adapters into and vllm serve reads them from (a filesystem both share)")
        root = Path(lora_dir).expanduser()
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            root = Path(tempfile.mkdtemp(prefix="lit_grpo_lora_", dir=str(root)))
        self.rank = rank
        self.calls = ServeAdapterCalls(rank, reload_base)
        self.sequence = VersionedAdapters(AdapterVersions(root, keep, prefix=ADAPTER_PREFIX), self.calls,
                                          write=rank == 0, base_at_first=True, agree=agree_with_rank_zero)

    @property
    def versions(self) -> Any:
        """The versions written (``AdapterVersions``; on ranks other than 0 only counted)."""
        return self.sequence.versions

    @property
    def merges_applied(self) -> int:
        """How many of the policy's merges the servers' bases hold (``VersionedAdapters.merges_applied``)."""
        return self.sequence.merges_applied

    def close(self) -> None:
        """At the end of the fit (``ServerEngine.close``): rank 0 removes its directory with every version in it.
        Not before: the server reads a version from its path when it loads it, and may read it again after dropping
        it from its CPU cache, so the kept versions must stay readable while the fit runs. After the fit no request
        names them, and the next fit unloads them from the server (``unload_leftovers``). The other ranks wrote
        nothing: their ``root`` is ``lora_dir`` itself, not theirs to remove."""
        self.sequence.close()

    def current(self) -> tuple[str, str] | None:
        """``(adapter name, its step as the completions' weight version)`` of the newest version, or None."""
        version = self.sequence.current
        return None if version is None else (version.name, str(self.sequence.steps[version.id]))

    def push(self, servers: list[ServerConnection], update: Any, step: int) -> None:
        """Reload the base when needed, write and load the next version (rank 0), unload the stale ones; every rank
        counts it. A collective: every rank calls it, and a failure raises ``ServerError`` on every rank (rank 0's
        message there), the previous version still the one requests name."""
        self.calls.servers = list(servers)
        self.sequence.push(update, step)


def agree_with_rank_zero(failure: Exception | None) -> Exception | None:
    """The ``VersionedAdapters`` agreement of a ``vllm serve`` push: only rank 0 talks to the servers, so one
    collective tells every rank whether it went through; rank 0 raises its own error, the others a ``ServerError``
    pointing at rank 0's log."""
    from lit_grpo.core.distributed import everyone

    if everyone(failure is None):
        return None
    if failure is None:
        return ServerError("the adapter push failed on rank 0 (its log names the server and the error)")
    if isinstance(failure, ServerError):
        return failure
    return ServerError(f"the adapter push failed: {type(failure).__name__}: {failure}")


class ServeAdapterCalls:
    """The ``AdapterTransport`` of ``vllm serve``: rank 0 loads and unloads by HTTP on every server of the push
    (``servers``, set by ``ServeAdapters.push``); the other ranks count only. The base reload is the engine's
    full-weight push, which every rank runs."""

    def __init__(self, rank: int, reload_base: Callable[[int], None]) -> None:
        self.rank = rank
        self._reload_base = reload_base
        self.servers: list[ServerConnection] = []
        self._cleared: set[str] = set()  # servers whose earlier fits' adapters are unloaded
        #: the step of the last base push: a server reporting another weight version restarted and lacks that base
        self.base_step: int | None = None
        #: ``(server) -> its weight version, or None when it does not answer`` (``Fleet.probe``): a server whose
        #: call fails and that no longer answers is left out of the push (``lost``) instead of failing it
        self.answers: Callable[[ServerConnection], str | None] | None = None
        self.lost: list[str] = []

    def reload_base(self, step: int) -> None:
        self._reload_base(step)
        self.base_step = int(step)

    def _dead(self, server: ServerConnection) -> bool:
        if self.answers is None or self.answers(server) is not None:
            return False
        self.lost.append(server.url)
        self._cleared.discard(server.url)  # if it comes back it was restarted: nothing of this fit on it
        return True

    def load(self, version: Any) -> None:
        """Load ``version`` on every server (first unloading earlier fits' leftovers: this fit's names restart at
        1); a server that refuses it leaves none of them holding it; one that no longer answers is left out."""
        if self.rank != 0:
            return
        done: list[ServerConnection] = []
        try:
            for server in self.servers:
                try:
                    if server.url not in self._cleared:
                        unload_leftovers(server)
                        self._cleared.add(server.url)
                    load_lora(server, version.name, str(version.path))
                except ServerError:
                    if self._dead(server):
                        continue
                    raise
                done.append(server)
            if not done:
                raise ServerError(f"the adapter push of {version.name} failed: every rollout server was lost during "
                                  f"it ({', '.join(s.url for s in self.servers)})")
        except ServerError:
            for server in done:
                try:
                    unload_lora(server, version.name)
                except ServerError:
                    pass  # the refusal is the error to report; a version left loaded is never named
            raise

    def unload(self, version: Any) -> None:
        if self.rank == 0:
            for server in self.servers:
                if server.url in self.lost:
                    continue
                try:
                    unload_lora(server, version.name)
                except ServerError:
                    if not self._dead(server):
                        raise


def load_lora(server: ServerConnection, name: str, path: str) -> None:
    """``POST /v1/load_lora_adapter``; a refusal becomes one line that says how to start the server."""
    try:
        server.client.text("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    except ServerError as err:
        raise ServerError(f"vllm serve at {server.url} refused the adapter {name} from {path}: {err}; "
                          f"{LORA_SERVE_HINT}, and give it the path rank 0 writes (engine_options.lora_dir on a "
                          "filesystem both share)", status=err.status) from None


def unload_lora(server: ServerConnection, name: str) -> None:
    """``POST /v1/unload_lora_adapter``; an adapter the server does not hold (404) is already unloaded."""
    try:
        server.client.text("POST", "/v1/unload_lora_adapter", {"lora_name": name})
    except ServerError as err:
        if err.status != 404:
            raise


def unload_leftovers(server: ServerConnection) -> None:
    """Unload adapters an earlier fit left on the server (names starting with ``ADAPTER_PREFIX``): this fit's
    names restart at 1."""
    models = server.client.get("/v1/models").get("data") or []
    for model in models:
        name = model.get("id") if isinstance(model, dict) else None
        if isinstance(name, str) and name.startswith(ADAPTER_PREFIX):
            unload_lora(server, name)


def with_adapter_versions(response: dict, version: str) -> dict:
    """The completion ``response`` of a request that named an adapter, its completions labelled with the
    adapter's ``version`` (vLLM's ``weight_versions`` name the base's last push)."""
    for choice in response.get("choices") or []:
        if isinstance(choice, dict):
            choice["weight_versions"] = [{"version": version}]
    response.pop("weight_version", None)
    return response
