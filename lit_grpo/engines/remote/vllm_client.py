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

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.distributed import full_named_parameters, is_fsdp1
from lit_grpo.engines.options import ServerOptions
from lit_grpo.engines.remote.connection import ServerConnection
from lit_grpo.wire.protocol import ServerError, version_text

#: the wire dtype when none is asked for
DEFAULT_DTYPE = "bfloat16"


def vllm_dtype(servers: list[ServerConnection], requested: str | None) -> torch.dtype:
    """Check every server answers (URL and token right) and return the dtype weights travel in."""
    from lit_grpo.wire.weight_transfer import dtype_from_name

    for server in servers:
        server.client.get("/get_world_size")
    return dtype_from_name(requested or DEFAULT_DTYPE)


def vllm_requests(servers: list[ServerConnection], prompts: list[list[int]], n: int,
                  seed: int) -> list[tuple[ServerConnection, list[int], int]]:
    """``(server, [prompt index], seed)`` per prompt, the prompts spread over the servers in contiguous runs."""
    from lit_grpo.engines.vllm_engine import prompt_seed

    k = len(servers)
    return [(servers[p * k // len(prompts)], [p], prompt_seed(seed, p, n)) for p in range(len(prompts))]


def vllm_parts(server: ServerConnection, options: ServerOptions, dtype: torch.dtype,
               policy_of: Callable[[], nn.Module], rank: int) -> tuple[Any, Any, Any]:
    """vLLM's trainer side for one server, built once on every rank (rank 0 forms the NCCL group)."""
    if server.vllm is not None:
        return server.vllm
    try:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    except ImportError as err:
        raise ImportError("kind 'vllm' needs vLLM's trainer side: pip install 'lit_grpo[vllm]'") from err
    from lit_grpo.wire.weight_transfer import local_address_towards

    policy = policy_of()
    if is_fsdp1(policy):
        raise ValueError("kind 'vllm' cannot declare FSDP1 (FullyShardedDataParallel) parameters; use FSDP2 "
                         "(ModelParallelStrategy) or DDP")
    client = versioned_vllm_client(server.url, options.timeout_s)
    source = policy_source(policy, dtype)
    world = 1 + int(server.client.get("/get_world_size")["world_size"])
    address = options.transfer_address or local_address_towards(server.host)
    info = trainer_init_info(options.transfer_backend, address, world, rank, options.bucket_bytes, options.timeout_s)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    server.vllm = (client, source, trainer)
    return server.vllm


def trainer_init_info(backend: str, address: str, world: int, rank: int, bucket_bytes: int, timeout_s: float) -> Any:
    """vLLM's trainer-side init info for the push ``backend``: its own ``nccl`` (GPUs), or this package's ``gloo``
    (``lit_grpo.wire.vllm_gloo``; the server must run with ``--weight-transfer-config '{"backend": "gloo"}'``).
    Either way the rest of the push is the same ``trainer_init`` / ``send_weights``."""
    from lit_grpo.engines.vllm_engine import free_port

    if backend == "gloo":
        from lit_grpo.wire.vllm_gloo import trainer_init_info as gloo_init_info

        return gloo_init_info(address, world, rank, bucket_bytes, timeout_s)
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    return NCCLTrainerInitInfo(address, free_port() if rank == 0 else 0, world, rank=rank)


def push_vllm(servers: list[ServerConnection], options: ServerOptions, dtype: torch.dtype,
              policy: Callable[[], nn.Module], iterator: Iterator[tuple[str, torch.Tensor]], step: int,
              rank: int) -> dict:
    """Every rank runs vLLM's ``send_weights`` (the sender broadcasts, the others only gather). The first
    server consumes the given iterator; further servers gather the ``policy()`` again. Returns
    ``{"error": message}`` or ``{"error": None, "versions": {url: version}}`` for the push to share over the
    ranks."""
    failed: list[str] = []
    versions: dict[str, str] = {}
    for index, server in enumerate(servers):
        tensors = iterator if index == 0 else full_named_parameters(policy())
        try:
            client, source, trainer = vllm_parts(server, options, dtype, policy, rank)
            if rank == 0:
                server.client.post("/pause", query={"mode": "wait"})
                client.next_version = str(step)
            source.current = tensors
            trainer.send_weights()  # start -> update (with the broadcast) -> finish(weight_version)
            if rank == 0:
                versions[server.url] = version_text(server.client.get("/weight_info").get("weight_version"))
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
                    server.client.post("/resume", timeout_s=min(5.0, options.timeout_s))
                except ServerError:
                    pass
    if failed:
        return {"error": failed[0]}
    return {"error": None, "versions": versions}


def versioned_vllm_client(url: str, timeout_s: float) -> Any:
    """vLLM's ``HTTPVLLMWeightSyncClient`` whose ``finish_weight_update`` carries the version being pushed
    (``send_weights`` calls it without one)."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient

    class VersionedClient(HTTPVLLMWeightSyncClient):
        next_version: str | None = None

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            super().finish_weight_update(weight_version if weight_version is not None else self.next_version)

    return VersionedClient(url, timeout=timeout_s)


def policy_source(policy: nn.Module, dtype: torch.dtype) -> Any:
    """A vLLM ``WeightSource`` over the policy: metadata from the parameters' full shapes (no gather), under
    their model names, in the wire dtype; each round replays the push's iterator (set as ``current``).

    vLLM 0.33 reads ``metadata`` as a cached property and the tensors from ``iter_full()``; 0.32 calls
    ``metadata()`` and iterates the source. The class is built for the installed version."""
    from functools import cached_property

    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    from lit_grpo.distributed import strip_wrapper_prefixes

    def metadata(self: Any) -> list:
        return [ParamMeta(strip_wrapper_prefixes(name), dtype if p.is_floating_point() else p.dtype,
                          tuple(p.shape)) for name, p in policy.named_parameters()]

    def tensors(self: Any) -> Iterator[tuple[str, torch.Tensor]]:
        current, self.current = self.current, None
        for name, tensor in current or ():
            yield name, tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()

    if hasattr(WeightSource, "iter_full"):  # 0.33
        members = {"metadata": cached_property(metadata), "iter_full": tensors}
    else:  # 0.32
        members = {"metadata": metadata, "__iter__": tensors}
    return type("PolicySource", (WeightSource,), {"current": None, **members})()
