"""The rollout server's side of a weight push: the weight-transfer routes (``/init_weight_transfer_engine`` ...
``/finish_weight_update``), the receive buffers, ``/weight_info`` and ``/weight_checker``.

A push goes to the rollout policy (``target`` ``policy``, the default and vLLM's only one), to the server's copy
of pi_ref (``{"target": "reference"}`` in ``/start_weight_update``, ``lit_grpo.serve.reference_routes``), which is
made at its first push, or to the policy's LoRA adapter (``{"target": "adapter", "lora": {...}}``,
``lit_grpo.serve.served_adapter``: the adapter tensors and the merges the base lacks, nothing else).
A push is all or nothing: buckets are received into staging tensors and the model's
parameters are switched to them only at ``/finish_weight_update``, once every parameter has arrived, while no
generation runs. A push cut off anywhere before that (sender killed, bad bucket, timeout) is discarded and the
server keeps its previous weights and ``weight_version``; the next push starts from ``/init_weight_transfer_engine``
again.

``WeightReceiver`` is one of ``RolloutServer``'s route handlers (``lit_grpo.serve.server``): it holds the transfer's
state (the group, the push in progress, the receive buffers) and writes into the ``ServedPolicy`` and the copy of
pi_ref (``ReferenceRoutes``) it is given; torch is imported only when a push comes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

from lit_grpo.serve.reference_routes import ReferenceRoutes
from lit_grpo.serve.served_adapter import ServedAdapter
from lit_grpo.serve.served_policy import ServedPolicy
from lit_grpo.wire.protocol import HTTPFailure, number_field

#: what a push may write: the rollout policy, the server's copy of pi_ref, or the policy's LoRA adapter
PUSH_TARGETS = ("policy", "reference", "adapter")


class WeightReceiver:
    """The weight-transfer routes of ``RolloutServer``: one transfer call at a time (``transfer_lock``); the
    swap at ``/finish_weight_update`` waits for the generations in flight and holds new ones back.

    Args:
        policy: the served policy, whose weights and version a policy push replaces.
        reference: the server's copy of pi_ref, which a reference push fills.
        model_name: the served model's name (in error messages and ``/weight_info``).
        reuse_buffers: keep receive buffers across pushes (CPU only: fresh memory costs page faults as slow as the
            transfer; the CUDA caching allocator reuses memory by itself).
    """

    def __init__(self, policy: ServedPolicy, reference: ReferenceRoutes, model_name: str,
                 reuse_buffers: bool = True, adapter: ServedAdapter | None = None) -> None:
        self.policy = policy
        self.reference = reference
        self.adapter = adapter if adapter is not None else ServedAdapter(policy)
        self.model_name = model_name
        self.transfer_lock = threading.Lock()  # one weight-transfer call at a time
        self.group = None
        self.store = None
        self.backend = "gloo"
        self.packed = True
        self.transfer_timeout_s = 300.0  # the group's timeout, from /init_weight_transfer_engine
        self.staging: dict[str, Any] | None = None
        self.receiving = False  # inside a bucket's broadcast
        # Bucket k of a push lands in a buffer of the same announcement that does not back the parameters now, so a
        # model has at most two sets of buffers.
        self.reuse_buffers = reuse_buffers
        self._pool: dict[tuple[str, ...], list[Any]] = {}
        self._live: set[int] = set()  # data pointers of the buffers the parameters point into
        self._push_buffers: list[tuple[tuple[str, ...], Any]] = []
        self.push_target = "policy"
        self.adapter_params: dict[str, Any] = {}
        self.policy_params: dict[str, Any] | None = None  # what the policy push in progress writes, by plain name

    def handlers(self) -> dict[str, Callable[[dict, dict], dict]]:
        """Its routes' handlers by the names ``lit_grpo.wire.protocol.ROUTES`` gives them."""
        return {"get_world_size": self.get_world_size, "init_weight_transfer_engine": self.init_weight_transfer_engine,
                "shutdown_weight_transfer_engine": self.shutdown_weight_transfer_engine,
                "start_weight_update": self.start_weight_update, "update_weights": self.update_weights,
                "finish_weight_update": self.finish_weight_update,
                "update_weight_version": self.update_weight_version, "weight_info": self.weight_info,
                "weight_checker": self.weight_checker}

    def target_params(self) -> dict[str, Any]:
        """The parameters the push in progress writes: the rollout policy's, pi_ref's or the adapter's (with the
        merges the push carries)."""
        if self.push_target == "adapter":
            return self.adapter_params
        if self.push_target == "reference":
            return self.reference.params
        return self.policy_params if self.policy_params is not None else self.policy.params

    @contextmanager
    def _transfer(self):  # noqa: ANN202
        if not self.transfer_lock.acquire(blocking=False):
            raise HTTPFailure(409, "another weight-transfer call is in progress")
        try:
            yield
        finally:
            self.transfer_lock.release()

    def _drop_transfer(self) -> None:
        from lit_grpo.wire.weight_transfer import close_group

        close_group(self.group)
        self.group, self.store, self.staging = None, None, None

    def get_world_size(self, body: dict, query: dict) -> dict:
        return {"world_size": 1}

    def init_weight_transfer_engine(self, body: dict, query: dict) -> dict:
        import torch

        from lit_grpo.wire.weight_transfer import BACKENDS, local_address_towards, open_group

        info = body.get("init_info")
        if not isinstance(info, dict):
            raise HTTPFailure(400, 'expected {"init_info": {...}}')
        address, port = info.get("master_address"), info.get("master_port")
        if not isinstance(address, str) or not address or isinstance(port, bool) or not isinstance(port, int):
            raise HTTPFailure(400, "init_info needs master_address (string) and master_port (integer)")
        if info.get("rank_offset", 1) != 1 or info.get("world_size") != 2:
            raise HTTPFailure(400, "this server is one process: init_info must have rank_offset 1 and world_size 2 "
                                   f"(got {info.get('rank_offset')}, {info.get('world_size')})")
        backend = info.get("backend", "gloo")
        device = self.policy.device
        if backend not in BACKENDS or (backend == "nccl" and device.type != "cuda"):
            raise HTTPFailure(400, f"backend {backend!r} is not available here; expected 'gloo'"
                                   + (" or 'nccl'" if device.type == "cuda" else " (the model is on the CPU)"))
        timeout_s = number_field(info, "timeout_s", 300.0)
        if not 0 < timeout_s <= 3600:
            raise HTTPFailure(400, f"timeout_s must lie in (0, 3600], got {timeout_s}")
        packed = info.get("packed", True)
        if not isinstance(packed, bool):
            raise HTTPFailure(400, f"packed must be true or false, got {packed!r}")
        with self._transfer():
            self._drop_transfer()
            import datetime

            try:
                store = torch.distributed.TCPStore(address, port, 2, False, datetime.timedelta(seconds=timeout_s))
                with self._on_device():
                    group = open_group(store, 1, 2, backend, timeout_s, local_address_towards(address))
            except Exception as err:  # noqa: BLE001 (any failure to join is reported, the server stays up)
                raise HTTPFailure(502, f"could not join the weight-transfer group at {address}:{port}: {err}") from err
            self.group, self.store, self.backend, self.packed = group, store, backend, packed
            self.transfer_timeout_s = timeout_s
            from lit_grpo.core.distributed import close_at_exit

            close_at_exit(self._drop_transfer)  # the group's worker threads are joined before the interpreter finalizes
        return {"message": "Weight transfer initialized"}

    def shutdown_weight_transfer_engine(self, body: dict, query: dict) -> dict:
        with self._transfer():
            self._drop_transfer()
        return {"message": "Weight transfer shut down"}

    def start_weight_update(self, body: dict, query: dict) -> dict:
        with self._transfer():
            if self.group is None:
                raise HTTPFailure(409, "no weight-transfer group: POST /init_weight_transfer_engine first")
            target = body.get("target", "policy")
            if target not in PUSH_TARGETS:
                raise HTTPFailure(400, f"target must be one of {list(PUSH_TARGETS)}, got {target!r}")
            if target == "reference":
                self.reference.ensure()
            if target == "adapter":
                self.adapter.start(body.get("lora"))
                self.adapter_params = self.adapter.params()
            if target == "policy":  # the plain names, also while the served model carries a LoRA fit's adapter
                self.policy_params = self.adapter.full_push_params()
            self.push_target = target
            self.staging = {}
            self._push_buffers = []
        return {"message": "Weight update started", "target": target}

    def _announced(self, body: dict) -> tuple[Any, list]:
        """The announcement as the one round format (``lit_grpo.wire.push_format``), validated against the
        parameters the push in progress writes: every name known and not sent before in this push, dtypes and
        shapes the server's, spans that add up; ``PushFormatError`` listing the first bad entries otherwise."""
        from lit_grpo.wire.push_format import Expected, PushManifest, validate

        info = body.get("update_info")
        if not isinstance(info, dict):
            raise HTTPFailure(400, 'expected {"update_info": {"names": [...], "dtype_names": [...], "shapes": [...], '
                                   '"spans": [[start, stop, nbytes], ...]}}')
        manifest = PushManifest.from_json(info)
        params = self.target_params()

        def held(name: str) -> Expected | None:
            param = params.get(name)
            return None if param is None else Expected(param.dtype, tuple(param.shape))

        dtypes = validate(manifest, held, seen=self.staging, receiver=f"this server ({self.model_name})")
        return manifest, dtypes

    def update_weights(self, body: dict, query: dict) -> dict:
        import torch

        from lit_grpo.wire.push_format import PushFormatError, receive_spans
        from lit_grpo.wire.weight_transfer import wait_work

        with self._transfer():
            if self.staging is None or self.group is None:
                raise HTTPFailure(409, "no weight update in progress: POST /start_weight_update first")
            try:
                manifest, dtypes = self._announced(body)
            except (HTTPFailure, PushFormatError) as err:
                # the sender's broadcast of this bucket is already under way and will never be read: the group
                # is out of step, so it goes, and with it the partial update
                self._drop_transfer()
                kept = self.policy.weight_version
                status, message = (err.status, err.message) if isinstance(err, HTTPFailure) else (400, str(err))
                raise HTTPFailure(status, f"{message}; the update is discarded (weight version stays "
                                          f"{kept!r}) and the transfer group is closed") from None
            device = self.transfer_device()
            received: list[tuple[str, Any]] = []
            self.receiving = True
            try:
                with self._on_device():
                    if self.packed:
                        def buffer_for(index: int, size: int) -> Any:
                            start, stop, _ = manifest.spans[index]
                            return self._receive_buffer(tuple(manifest.names[start:stop]), size, device)

                        for names, tensors in receive_spans(manifest, dtypes, self.group, self.transfer_timeout_s,
                                                            buffer_for):
                            received += zip(names, tensors)
                    else:
                        for name, dtype, shape in zip(manifest.names, dtypes, manifest.shapes):
                            received.append((name, torch.empty(shape, dtype=dtype, device=device)))
                            wait_work(self.group.broadcast(received[-1][1], root=0), self.transfer_timeout_s)
            except Exception as err:  # noqa: BLE001 (sender gone, timeout: the update is dropped, the server lives)
                self._drop_transfer()
                kept = self.policy.weight_version
                raise HTTPFailure(500, f"receiving the bucket failed ({err}); the update is discarded (weight version "
                                       f"stays {kept!r}) and the transfer group is closed") from err
            finally:
                self.receiving = False
            for name, tensor in received:
                self.staging[name] = tensor.to(self.policy.device)
        return {"message": "Weights updated"}

    def transfer_device(self) -> Any:
        """Where the bytes of a push arrive: the CPU over gloo, this server's own CUDA device over NCCL (not the
        handler thread's current device, which is cuda:0 whatever ``--device`` says)."""
        from lit_grpo.wire.weight_transfer import transport_device

        return transport_device(self.backend, self.policy.device)

    @contextmanager
    def _on_device(self) -> Any:
        """Make the server's CUDA device current in this handler thread (NCCL and the caching allocator use the
        current device for what is not given one); nothing on the CPU."""
        if self.policy.device.type != "cuda":
            yield
            return
        import torch

        with torch.cuda.device(self.policy.device):
            yield

    def _receive_buffer(self, key: tuple[str, ...], total: int, device: Any) -> Any:
        import torch

        if not self.reuse_buffers or device.type != "cpu" or self.push_target != "policy":
            # pi_ref is pushed once per stage: fresh memory, and the policy's pool stays as it is
            return torch.empty(total, dtype=torch.uint8, device=device)
        pool = self._pool.setdefault(key, [])
        free = [b for b in pool if b.numel() == total and b.data_ptr() not in self._live]
        if free:
            buffer = free[0]
        else:
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            pool.append(buffer)
        self._push_buffers.append((key, buffer))
        return buffer

    def finish_weight_update(self, body: dict, query: dict) -> dict:
        version = body.get("weight_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise HTTPFailure(400, f"weight_version must be a string, got {version!r}")
        with self._transfer():
            if self.staging is None:
                raise HTTPFailure(409, "no weight update in progress: POST /start_weight_update first")
            params = self.target_params()
            missing = sorted(set(params) - set(self.staging))
            if missing:
                got = len(self.staging)
                self.staging = None
                raise HTTPFailure(400, f"the update covered {got} of {len(params)} parameters (missing e.g. "
                                       f"{missing[:3]}); it is discarded and the weight version stays "
                                       f"{self.policy.weight_version!r}")
            staged, self.staging = self.staging, None
            if self.push_target == "adapter":
                self.adapter.install(staged, version)
                return {"message": "Weight update finished", "target": "adapter",
                        "weight_version": self.policy.weight_version, "lora": self.adapter.info()}
            if self.push_target == "reference":
                self.reference.install(staged, version)
                return {"message": "Weight update finished", "target": "reference",
                        "reference_version": self.reference.version}
            with self.policy.swapped():
                for name, tensor in staged.items():
                    params[name].data = tensor
                # a full push after a LoRA fit: the weights are all new, the adapter goes (ServedAdapter.drop says
                # why); here, once every tensor has arrived, so that a push cut off leaves the LoRA model as it was
                self.adapter.drop()
                self._live = {buffer.data_ptr() for _, buffer in self._push_buffers}
                used = {key for key, _ in self._push_buffers}
                self._pool = {key: buffers for key, buffers in self._pool.items() if key in used}
                if version is not None:
                    self.policy.weight_version = str(version)
                # what the served model holds now, in the order the names came: the trainer checks it against
                # what it sent (imported here: the module is read before torch is)
                from lit_grpo.wire.push_digest import PushDigest

                digest = PushDigest().add_all((name, params[name].data) for name in staged).value
        return {"message": "Weight update finished", "weight_version": self.policy.weight_version,
                "digest": str(digest)}

    def update_weight_version(self, body: dict, query: dict) -> dict:
        version = body.get("new_version")
        if isinstance(version, bool) or not isinstance(version, (str, int)):
            raise HTTPFailure(400, f"new_version must be a string, got {version!r}")
        self.policy.set_version(str(version))
        return {"success": True, "new_version": self.policy.weight_version}

    def weight_info(self, body: dict, query: dict) -> dict:
        staging, policy = self.staging, self.policy
        return {"weight_version": policy.weight_version, "model": self.model_name, "dtypes": policy.dtypes,
                "device": str(policy.device), "num_parameters": len(policy.params), "updating": staging is not None,
                "staged_parameters": len(staging) if staging is not None else 0, "receiving": self.receiving,
                "paused": policy.paused, "in_flight": policy.in_flight, "parked": policy.parked,
                "reference_version": self.reference.version,
                "transfer_group": self.group is not None, "lora": self.adapter.info()}

    def weight_checker(self, body: dict, query: dict) -> dict:
        from lit_grpo.wire.weight_transfer import checksum

        action = body.get("action")
        if action not in ("checksum", "compare"):
            raise HTTPFailure(400, f"action must be 'checksum' or 'compare', got {action!r}")
        with self.policy.settled():  # not while a swap runs
            sums = {name: checksum(p) for name, p in self.policy.params.items()}
        if action == "checksum":
            return {"checksums": sums}
        baseline = body.get("baseline")
        if not isinstance(baseline, dict):
            raise HTTPFailure(400, "action='compare' requires a 'baseline' object")
        mismatches = sorted(k for k in sums.keys() | baseline.keys() if sums.get(k) != baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches}
