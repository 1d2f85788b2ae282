"""The trainer's side of a weight push to rollout servers (``WeightPusher``, owned by ``ServerEngine``).

A push, on either kind of server: ``/pause?mode=wait`` -> ``/start_weight_update`` -> ``/update_weights`` (per
bucket) -> ``/finish_weight_update {"weight_version": "<step>"}`` -> ``GET /weight_info`` -> ``/resume``. To the
project's server the bytes travel over a process group of the trainer's rank 0 and the server
(``lit_grpo.wire.weight_transfer``), gloo or NCCL, in buckets announced over HTTP; the vLLM kind uses vLLM's own
trainer side (``lit_grpo.engines.remote.vllm_client``, imported only for that kind).

How the ranks take part (``push`` is called on every rank with an iterator whose iteration gathers the full
parameters, a collective):

- every rank takes part in the gathers; only rank 0 talks to the servers. For an FSDP2 policy (the
  ``full_named_parameters`` iterator ``WeightSync`` passes, not yet started) the gather goes to rank 0 only
  (``weight_gather.rank0_buckets``): the other ranks send their shards point to point, one bucket at a time, into
  a receive buffer rank 0 keeps across pushes, instead of every rank all-gathering every parameter; anything else
  is iterated on every rank as given. Rank 0 sends a bucket (``bucket_mb``) as soon as its gathers
  are done and before the next gather, so no trainer collective interleaves with a transfer and rank 0 never
  holds more than one bucket beyond its own shards;
- the bytes go out on a daemon thread while the HTTP call, with a timeout, stays on the main thread; every
  response is checked. The broadcast's wait blocks that thread until the bytes are through or the transfer
  group's own timeout (``timeout_s``) has passed, NCCL included (``weight_transfer.wait_work``), and its failure
  is a ``ServerError`` naming the server;
- rank 0 keeps consuming the iterator after a failure (the other ranks are in the gathers), then every rank
  learns the outcome in one ``all_gather_object`` and they raise together: a dead server stops training within
  ``timeout_s`` with its URL in the message, and no rank waits on a collective;
- ``push`` returns the ``weight_version`` each server reports after it (every rank gets rank 0's), which
  ``ServerEngine`` records as ``synced_step``; each completion carries the version it was sampled with, and rollouts
  from any other version are refused.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.core.distributed import all_gather_objects, rank_and_world
from lit_grpo.engines.options import ServerOptions
from lit_grpo.engines.remote.connection import ServerConnection
from lit_grpo.engines.remote.fleet import Fleet
from lit_grpo.engines.remote.weight_gather import GatherBuffer, fsdp2_source, rank0_buckets
from lit_grpo.wire.protocol import ServerError, version_text
from lit_grpo.wire.push_digest import PushDigest

#: seconds the main thread waits for a bucket's broadcast beyond ``timeout_s``, so that the transfer group's own
#: timeout (the same ``timeout_s``) is what reports a stuck transfer
SEND_GRACE_S = 5.0


def transfer_error(url: str, tensors: int, error: BaseException | None, timeout_s: float) -> ServerError:
    """The ``ServerError`` for a bucket whose bytes did not go through: the transfer group's own failure (NCCL's
    ``DistBackendError`` on a timeout or a dead peer, gloo's ``RuntimeError``, ``TimeoutError``), or no end of the
    broadcast thread at all, with the server's URL and the type of the error."""
    reason = (f"{type(error).__name__}: {error}" if error is not None
              else f"not finished within {timeout_s:g} s")
    return ServerError(f"rollout server {url}: sending a bucket of {tensors} tensors failed: {reason}")


class WeightPusher:
    """The push of full weights to the servers of one ``ServerEngine``: the gathers on every rank, rank 0's buckets
    and transfers, the outcome shared over the ranks. It owns rank 0's buffers, kept across pushes (the FSDP2
    gather's receive memory, the packing buffer), and the timing of the last push.

    Args:
        servers: the engine's connections (their groups and versions are the push's to update).
        options: the engine's options (kind, timeouts, bucket size, backend, transfer address, packing).
        dtype: the dtype weights travel in (the servers').
        policy: the policy module, or a callable returning it (vLLM's transfer declares its parameters first).
    """

    def __init__(self, servers: list[ServerConnection], options: ServerOptions, dtype: torch.dtype,
                 policy: nn.Module | Callable[[], nn.Module] | None = None, fleet: Fleet | None = None) -> None:
        self.servers = servers
        #: which servers are up: a push goes to those and to the down ones that answer again (``fleet``)
        self.fleet = fleet if fleet is not None else Fleet(servers, options.timeout_s)
        self.options = options
        self.kind = options.kind
        self.timeout_s = float(options.timeout_s)
        self.bucket_bytes = options.bucket_bytes
        self.backend = options.transfer_backend
        self.transfer_address = options.transfer_address
        self.packed = bool(options.packed)
        self.dtype = dtype
        self._policy = policy
        #: how a policy push pauses the servers: ``wait`` for the generations in flight to end, or ``keep`` them at a
        #: token boundary, swap, and let them go on under the new weights (partial rollouts)
        self.pause_mode = "wait"
        #: rank 0's timing of the last push to the project's servers: begin (pause, start), gather (the
        #: iterator: FSDP gathers and casts), send (pack, announce, broadcast), finish (swap, version, resume)
        self.last_push: dict[str, float] = {}
        self._pack_buffer: torch.Tensor | None = None
        #: rank 0's receive memory for the FSDP2 gather (``rank0_buckets``), kept across pushes
        self._gather_buffer = GatherBuffer()
        #: the servers the last push formed a new transfer group with and reached (every rank gets rank 0's): all at
        #: the first push; later, a server that restarted (or whose group broke) and got the weights anew, whose
        #: first batch the sampler check takes again (``lit_grpo.data.sampler_check``)
        self.joined: list[str] = []

    def policy(self) -> nn.Module:
        """The policy module (given, or returned by the given callable)."""
        policy = self._policy() if callable(self._policy) and not isinstance(self._policy, nn.Module) else self._policy
        if policy is None:
            raise ValueError("kind 'vllm' needs the policy module (engine option `policy`) to declare the "
                             "parameters' names and shapes before they are gathered")
        return policy

    @torch.no_grad()
    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str, target: str,
             start: dict[str, Any] | None = None) -> dict[str, str]:
        """One push of ``target`` (``policy``, the servers' copy of pi_ref: ``reference``, or the policy's LoRA
        adapter: ``adapter``, whose header ``start`` goes with ``/start_weight_update``) on every rank, labelled
        ``version``; the servers' versions after it, or ``ServerError`` on every rank.

        Given a ``full_named_parameters`` iterator of an FSDP2 module that has not started (what ``WeightSync``
        passes), the project's server is fed by ``rank0_buckets``: the other ranks send their shards point to
        point to rank 0, one bucket at a time, instead of every rank all-gathering every parameter. Anything
        else (plain, DDP, FSDP1 modules, weights already gathered) is iterated on every rank as given."""
        rank, world = rank_and_world()
        module = fsdp2_source(named_tensors) if self.kind == "lit_grpo" else None
        if self.kind == "vllm":
            from lit_grpo.engines.remote.vllm_client import push_vllm

            outcome = push_vllm(self.servers, self.options, self.dtype, self.policy, iter(named_tensors),
                                int(version), rank, self.pause_mode, self.fleet)
        elif rank == 0:
            outcome = self._push(named_tensors, module, version, target, start)
        else:
            for _ in rank0_buckets(module, self.bucket_bytes) if module is not None else named_tensors:
                pass  # sends this rank's shards, or runs the gathers of the iterator
            outcome = {"error": None}
        outcomes = all_gather_objects(outcome) if world > 1 else [outcome]
        errors = [o["error"] for o in outcomes if o["error"]]
        if errors:
            raise ServerError(errors[0])
        versions = outcomes[0]["versions"]
        self.joined = list(outcomes[0].get("joined", []))
        # rank 0's outcome on every rank: the servers the push reached are the ones up (a pi_ref push puts none back)
        self.fleet.apply([s.url for s in self.servers if s.url not in versions], rejoin=target != "reference")
        return versions

    def _cast(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        target = self.dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device=device, dtype=target)

    def _buckets(self, named_tensors: Iterable[tuple[str, torch.Tensor]], module: nn.Module | None,
                 convert: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Rank 0's buckets of full tensors in the wire dtype: gathered to rank 0 by ``rank0_buckets`` (an FSDP2
        ``module``, into a receive buffer kept across pushes), or grouped from the iterator as it is gathered."""
        from lit_grpo.wire.weight_transfer import buckets

        if module is None:
            return buckets(iter(named_tensors), self.bucket_bytes, convert)
        gathered = rank0_buckets(module, self.bucket_bytes, self._gather_buffer)
        return ([(name, convert(tensor)) for name, tensor in bucket] for bucket in gathered)

    def _push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], module: nn.Module | None, version: str,
              target: str = "policy", start: dict[str, Any] | None = None) -> dict:
        """Rank 0's push to the project's servers: the buckets are consumed to the end whatever happens (the other
        ranks are in the gathers)."""
        from lit_grpo.wire.weight_transfer import transport_device

        device = transport_device(self.backend)
        failed: list[Exception] = []
        times = dict(begin_s=0.0, gather_s=0.0, send_s=0.0, finish_s=0.0, bytes=0, buckets=0)
        mark = time.perf_counter()
        # the servers up, and those down that answer again (a restarted one gets the current weights now); a server
        # whose connection is lost during the push is left out of the rest of it (``Fleet``)
        joined: list[str] = []
        try:
            targets = self.fleet.push_targets(rejoin=target != "reference")
            for server in list(targets):
                if self._on_target(targets, server, lambda s: self._begin(s, target, start)):
                    joined.append(server.url)
            if not targets:  # every one answered the probe, then lost its connection
                raise self.fleet.none_up()
        except Exception as err:  # noqa: BLE001 (reported on every rank after the gathers)
            failed.append(err)
        times["begin_s"] = time.perf_counter() - mark

        def convert(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if failed else self._cast(tensor, device)

        mark = time.perf_counter()
        digest = PushDigest()  # of what is sent, in its order: each server's digest after the swap must equal it
        for bucket in self._buckets(named_tensors, module, convert):  # the gathers run here
            gathered = time.perf_counter()
            times["gather_s"] += gathered - mark
            if not failed:
                try:
                    for name, tensor in bucket:
                        digest.add(name, tensor)
                    info, payload = self._payload(bucket, device)
                    for server in targets:
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
                for server in list(targets):
                    got = self._on_target(targets, server, lambda s: self._finish(s, version, target, digest.value))
                    if got is not None:
                        versions[server.url] = got
                if not versions:
                    raise ServerError(f"every rollout server was lost during the push of {version!r}")
            except Exception as err:  # noqa: BLE001 (reported on every rank)
                failed.append(err)
        times["finish_s"] = time.perf_counter() - mark
        self.last_push = times
        if failed:
            for server in self.servers:
                self._abandon(server)
            what = {"policy": f"weight push of step {version}", "adapter": f"adapter push of step {version}"}.get(
                target, f"push of pi_ref version {version}")
            return {"error": f"{what} failed: {failed[0]}"}
        return {"error": None, "versions": versions, "joined": [url for url in joined if url in versions]}

    def _on_target(self, targets: list[ServerConnection], server: ServerConnection,
                   step: Callable[[ServerConnection], Any]) -> Any:
        """``step(server)`` of a push; a server whose connection is lost is dropped from ``targets`` (and its
        group closed), the push going on without it; any other error is raised."""
        try:
            return step(server)
        except ServerError as err:
            if not err.lost:
                raise
            targets.remove(server)
            self._abandon(server)
            return None

    def _begin(self, server: ServerConnection, target: str = "policy", start: dict[str, Any] | None = None) -> bool:
        """Pause ``server`` (a pi_ref push lets it generate) and start its update; whether a new transfer group was
        formed with it (a first push, a restarted server, a group that broke)."""
        info = server.client.get("/weight_info")
        joined = server.group is None or not info.get("transfer_group")
        if joined:
            self._init_group(server)
        if target == "policy":
            server.client.post("/pause", query={"mode": self.pause_mode})
            server.client.post("/start_weight_update")
        elif target == "adapter":  # generation reads the adapter, which may change the served model: always waits
            server.client.post("/pause", query={"mode": "wait"})
            server.client.post("/start_weight_update", {"target": target, **(start or {})})
        else:  # generation goes on: it does not read pi_ref
            server.client.post("/start_weight_update", {"target": target})
        return joined

    def _init_group(self, server: ServerConnection) -> None:
        from lit_grpo.wire.weight_transfer import local_address_towards, open_group, open_store

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
        server.attach_group(joined["group"], store, listener)

    def _payload(self, bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[dict, list[torch.Tensor]]:
        """A bucket's announcement (``update_info``: the round format of ``lit_grpo.wire.push_format``, one span)
        and the tensors that carry its bytes: one packed ``uint8`` tensor (a view when the tensors already lie back
        to back, as ``rank0_buckets`` leaves them; else written into a buffer kept across buckets and pushes), or
        the tensors themselves."""
        from lit_grpo.wire.push_format import bucket_manifest, pack_bucket
        from lit_grpo.wire.weight_transfer import packed_view

        if not self.packed:
            return bucket_manifest(bucket).to_json(), [t.contiguous() for _, t in bucket]
        # the packing buffer only for a bucket that is not already one view (no memory held for nothing)
        if len(bucket) > 1 and packed_view([t for _, t in bucket], device) is None and (
                self._pack_buffer is None or self._pack_buffer.device != device):
            self._pack_buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
        manifest, packed = pack_bucket(bucket, device, self._pack_buffer)
        return manifest.to_json(), [packed]

    def _send(self, server: ServerConnection, info: dict, payload: list[torch.Tensor]) -> None:
        """Announce a bucket over HTTP (main thread, with a timeout) while its bytes go out on a daemon thread.
        The broadcast's wait blocks that thread until the bytes are through or the transfer group's own timeout
        has passed (also with NCCL, whose plain ``wait()`` does not block the host); its failure, or no end
        within the timeout and a grace, is a ``ServerError`` naming the server."""
        from lit_grpo.wire.weight_transfer import wait_work

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

    def _finish(self, server: ServerConnection, version: str, target: str = "policy", digest: int | None = None) -> str:
        finished = server.client.post("/finish_weight_update", {"weight_version": version})
        held = finished.get("digest")
        if target == "policy" and digest is not None and held is not None and str(held) != str(digest):
            server.client.post("/resume")
            raise ServerError(f"rollout server {server.url}: the weight push of {version!r} did not take effect: the "
                              f"served weights' digest {held} is not the pushed {digest}; expected the server to hold "
                              f"what was sent (a server of another model or a broken load path)")
        key = "reference_version" if target == "reference" else "weight_version"
        got = version_text(server.client.get("/weight_info").get(key))
        if target != "reference":
            server.client.post("/resume")
        if got != version:
            raise ServerError(f"rollout server {server.url} reports {key} {got!r} after a push of {version!r}")
        return got

    def _abandon(self, server: ServerConnection) -> None:
        """After a failed push: drop the group (the next push forms a new one) and let the server generate again
        (it kept its previous weights)."""
        server.close_group()
        server.expected_version = None
        try:
            server.client.post("/resume", timeout_s=min(5.0, self.timeout_s))
        except ServerError:
            pass
