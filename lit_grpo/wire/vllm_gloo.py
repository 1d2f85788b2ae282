"""A gloo weight-transfer backend for vLLM, so a trainer can push weights to ``vllm serve`` without NCCL (on CPU, or
on machines whose GPUs the two sides do not share).

vLLM's own backends (``nccl``, ``ipc``) need GPUs. Its ``WeightTransferEngineFactory`` takes engines registered by
name, and a vLLM *general plugin* (the entry point ``vllm.general_plugins`` -> :func:`register` of this package) runs
in every vLLM process at start-up, so ``vllm serve M --weight-transfer-config '{"backend": "gloo"}'`` finds the
engine below in its workers. The trainer side is the same interface as the NCCL path:

    WeightTransferTrainerFactory.trainer_init(GlooTrainerInitInfo(address, 0, world_size, rank=rank),
                                              client=HTTPVLLMWeightSyncClient(url), source=source)
    trainer.send_weights()

The wire: the trainer (rank 0) opens a ``TCPStore`` and the workers (ranks 1..) join a ``ProcessGroupGloo`` through
it (``weight_transfer.open_store`` / ``open_group``, the same primitives as the project's own server). A round is
announced once, in ``/update_weights``, in the one round format of every receiver (``lit_grpo.wire.push_format``:
names, dtype names, shapes and the buckets' spans, cut by its packer from the source's metadata); each bucket
travels as one ``uint8`` broadcast. Before a byte is received and before vLLM's layerwise reload puts any layer
aside, the worker checks the round against its model (``push_format.validate`` with ``model_expectations``: every
name one of the model's parameters, directly or as a shard of a packed one, dtypes the parameters', shapes that
fit); a malformed round is refused with the first bad entries named, the group is closed (the trainer's broadcast
then fails at once instead of waiting out the timeout) and the model keeps every weight it had.

Authentication: vLLM guards only its ``/v1`` routes (``--api-key``); ``/init_weight_transfer_engine`` and the other
dev routes are open to whoever reaches the port. So the worker joins a group only for an init that carries the shared
token (``LIT_GRPO_SERVER_TOKEN``, or a file named by ``LIT_GRPO_SERVER_TOKEN_FILE``, in ``vllm serve``'s environment;
``lit_grpo.wire.auth``) and whose store is on this machine (unless ``LIT_GRPO_ALLOW_REMOTE_PUSH=1``). A refused init
changes nothing: the group it would have joined is not joined, a group already formed stays, and with no group an
update is refused before any layer is touched.

Written against vLLM 0.32 and 0.33, whose ``WeightSource`` differs (0.32: ``metadata()`` and ``__iter__``; 0.33:
``metadata`` as a cached property and ``iter_full()``): :func:`source_metadata` and :func:`source_tensors` read
either. vLLM is imported only by the functions that need it, so importing this module stays cheap.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lit_grpo.wire.auth import push_refusal
from lit_grpo.wire.push_format import (
    Expected,
    PushFormatError,
    PushManifest,
    receive_spans,
    round_manifest,
    validate,
)
from lit_grpo.wire.weight_transfer import (
    close_group,
    dtype_name,
    local_address_towards,
    open_group,
    open_store,
    pack,
    wait_work,
)

#: the name the engines are registered under (``--weight-transfer-config '{"backend": "gloo"}'``)
BACKEND = "gloo"
#: bytes a bucket holds at most (a larger tensor travels alone)
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 600.0
#: seconds the trainer waits, after a failed broadcast, for the worker's answer that says why (a refused round)
REFUSAL_WAIT_S = 10.0


def answered_error(answer: Future, wait_s: float) -> BaseException | None:
    """The error ``answer`` (a request on a side thread) ended with, if it ends within ``wait_s``; else None."""
    try:
        answer.result(timeout=wait_s)
    except TimeoutError:
        return None
    except Exception as err:  # noqa: BLE001 (the server's answer, whatever it is)
        return err
    return None


def wait_for_peer(store: dist.Store, keys: int, answer: Future, timeout_s: float, poll_s: float = 0.01) -> None:
    """Block until the push group's store holds more than ``keys`` keys (a worker connected to it, so it passed its
    checks and is joining) or ``answer``, the init request, has come back: it comes back before this rank joins
    only when the server refused the init, whose error is raised here. ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while store.num_keys() <= keys:
        if answer.done():
            answer.result()  # the refusal
            raise RuntimeError("the server answered the weight-transfer init without joining the group")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no vLLM worker joined the weight-transfer group within {timeout_s:g} s")
        time.sleep(poll_s)


def source_metadata(source: Any) -> list[Any]:
    """``ParamMeta`` of a vLLM ``WeightSource``: a method in 0.32, a cached property in 0.33."""
    meta = source.metadata
    return list(meta() if callable(meta) else meta)


def source_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """One pass over a ``WeightSource``'s full tensors: ``iter_full()`` in 0.33, iteration in 0.32."""
    iter_full = getattr(source, "iter_full", None)
    return iter(iter_full()) if callable(iter_full) else iter(source)


@dataclass
class GlooGroupInfo:
    """Where the push group meets and how it sends, what both sides' init infos hold: the trainer's store, the
    group's size (1 + the server's workers), the bucket size, the timeout and the shared token (never printed)."""

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    token: str | None = field(default=None, repr=False)


@dataclass
class GlooWeightTransferInitInfo(GlooGroupInfo):
    """What a vLLM worker needs to join the push group: the group's :class:`GlooGroupInfo` and the worker's place in
    it (``rank_offset`` + its global worker rank). The worker checks the token before anything else."""

    rank_offset: int = field(kw_only=True)


#: one round's tensors in the order they travel and its buckets: the round format of every receiver
#: (``lit_grpo.wire.push_format.PushManifest``), under the name the engines declare it by
GlooWeightTransferUpdateInfo = PushManifest


def model_format_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters by name in the format its loader takes them. vLLM records each layer's tensors in
    that format (``record_metadata_for_reloading``, as meta tensors with their loader attributes) before it processes
    them into its kernels' format, where a parameter may change shape (on a CPU a linear layer's weight becomes an
    empty placeholder once repacked); the record is what a reload restores, so it is what a round must match. A
    layer without a record (none made, or a module vLLM never moves) counts with its live parameters.

    With ``--enable-lora`` vLLM wraps each target layer after loading and the layer moves under ``base_layer``
    (``qkv_proj.base_layer.weight``); its loader still takes the checkpoint's name, so the base layer's parameters
    also count under the name without ``base_layer``."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except (ImportError, AttributeError):  # not inside vLLM (or a release without the record): the live parameters
        LAYERWISE_INFO = {}
    params: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        own: dict[str, torch.Tensor] = dict(module.named_parameters(recurse=False))
        info = LAYERWISE_INFO.get(module)
        if info is not None:
            own.update(info.restore_metadata[0])
        params.update({f"{prefix}.{name}" if prefix else name: tensor for name, tensor in own.items()})
    for name in [n for n in params if ".base_layer." in n or n.startswith("base_layer.")]:
        params.setdefault(name.replace("base_layer.", ""), params[name])
    return params


def model_expectations(model: torch.nn.Module, tensor_parallel_size: int = 1,
                       params: dict[str, torch.Tensor] | None = None) -> Callable[[str], Expected | None]:
    """What a vLLM model takes under a pushed (checkpoint) name: the parameter of that name, or the packed
    parameter a shard belongs to (``packed_modules_mapping``: ``q_proj`` -> ``qkv_proj``), after the model's own
    name mapping (``hf_to_vllm_mapper``) where it has one. Tied and aliased parameters count under every name.

    The dtype must be the parameter's. The shape must equal the parameter's where the model loads it by a plain
    copy; a parameter with a loader of its own (vLLM's parallel and packed layers: split over tensor-parallel
    ranks, padded, or packed from several tensors) takes a shape of the same rank whose sizes along its
    ``output_dim`` / ``input_dim`` (a packed shard without them: dim 0) are at most the parameter's times the
    tensor-parallel size, and equal elsewhere. ``params``: the parameters to check against (by default the live
    ones, aliases included; the worker passes ``model_format_parameters``)."""
    params = dict(model.named_parameters(remove_duplicate=False)) if params is None else params
    packed = dict(getattr(model, "packed_modules_mapping", None) or {})
    shard_of = {shard: whole for whole, shards in packed.items() for shard in shards}
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    map_name = getattr(mapper, "map_name", None) or getattr(mapper, "_map_name", None)

    def resolve(name: str) -> tuple[torch.Tensor | None, bool]:
        """The parameter ``name`` loads into, and whether it is one shard of it."""
        mapped = map_name(name) if map_name is not None else name
        if mapped is None:  # the model's mapping drops it: its loader would skip it, nothing here takes it
            return None, False
        if mapped in params:
            return params[mapped], mapped != name and name not in params
        parts = mapped.split(".")
        for i, part in enumerate(parts):
            if part in shard_of:
                whole = ".".join([*parts[:i], shard_of[part], *parts[i + 1:]])
                if whole in params:
                    return params[whole], True
        return None, False

    def lookup(name: str) -> Expected | None:
        param, shard = resolve(name)
        if param is None:
            return None
        loader = getattr(param, "weight_loader", None)
        if not shard and (loader is None or getattr(loader, "__name__", "") == "default_weight_loader"):
            return Expected(param.dtype, tuple(param.shape))
        dims = {d for d in (getattr(param, "output_dim", None), getattr(param, "input_dim", None)) if d is not None}
        if shard and getattr(param, "output_dim", None) is None:
            dims.add(0)  # shards are packed along the output rows
        return Expected(param.dtype, tuple(param.shape), tuple(sorted(dims)), max(1, int(tensor_parallel_size)))

    return lookup


def worker_rank(parallel_config: Any, rank_offset: int) -> int:
    """The worker's rank in the push group: its global rank across data-parallel replicas, after the trainer's
    (as vLLM's NCCL backend counts, ``nccl_common.worker_init_process_group``)."""
    per_replica = int(parallel_config.world_size)
    return int(parallel_config.data_parallel_index) * per_replica + int(parallel_config.rank) + rank_offset


def make_worker_engine_class() -> type:
    """The worker side, built on vLLM's ``WeightTransferEngine`` (imported here, inside a vLLM process)."""
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class GlooWeightTransferEngine(WeightTransferEngine):
        """Receives a round's buckets by gloo broadcast and loads them with the model's ``load_weights`` inside
        vLLM's layerwise reload, as the NCCL backend does; the reload starts once the round's manifest has been
        checked against the model (the first ``update_weights`` of the round), since it puts the layers aside, and
        is finished in ``finish_weight_update``."""

        init_info_cls = GlooWeightTransferInitInfo
        update_info_cls = GlooWeightTransferUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group: dist.ProcessGroup | None = None
            self.store: dist.Store | None = None
            self.bucket_bytes = DEFAULT_BUCKET_BYTES
            self.timeout_s = DEFAULT_TIMEOUT_S
            self.reloading = False  # inside vLLM's layerwise reload: layers set aside until finish_weight_update

        def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
            # checked before the current group is dropped: a refused init leaves the engine as it was
            refusal = push_refusal(str(init_info.master_address), init_info.token)
            if refusal is not None:
                raise PermissionError(f"gloo weight transfer refused: {refusal}")
            self.shutdown()
            self.bucket_bytes = int(init_info.bucket_bytes)
            self.timeout_s = float(init_info.timeout_s)
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self.store = dist.TCPStore(init_info.master_address, int(init_info.master_port), int(init_info.world_size),
                                       False, timeout)
            self.group = open_group(self.store, worker_rank(self.parallel_config, int(init_info.rank_offset)),
                                    int(init_info.world_size), "gloo", self.timeout_s,
                                    local_address_towards(init_info.master_address))

        def start_weight_update(self) -> None:
            # the route is open: without a group an authenticated init formed, leave the layers where they are
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised: an init with the server's token must "
                                   "come first")

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            if self.reloading:
                self.reloading = False
                finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class ends with torch.accelerator.synchronize(), which has nothing to wait for on a CPU
            # and whose CPU behaviour differs between torch releases; gloo's wait below already blocks
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
            try:
                info = self.parse_update_info(update_info)
            except (TypeError, ValueError) as err:  # unknown fields, or not a manifest at all
                self.refuse()
                detail = str(err).removeprefix("malformed weight-push round: ")
                raise PushFormatError(f"malformed weight-push round refused by the vLLM worker, nothing loaded: "
                                      f"{detail}") from None
            self.receive_weights(info)

        def expectations(self) -> Callable[[str], Expected | None]:
            """What the model takes under each pushed name (``model_expectations``)."""
            return model_expectations(self.model, getattr(self.parallel_config, "tensor_parallel_size", 1),
                                      model_format_parameters(self.model))

        def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
            try:
                dtypes = validate(update_info, self.expectations(), max_bucket_bytes=self.bucket_bytes,
                                  receiver="the vLLM worker")
            except PushFormatError:
                self.refuse()
                raise
            if not self.reloading:
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                self.reloading = True
            for names, tensors in receive_spans(update_info, dtypes, self.group, self.timeout_s,
                                                lambda index, size: torch.empty(size, dtype=torch.uint8)):
                self.model.load_weights(list(zip(names, tensors)))

        def refuse(self) -> None:
            """After a refused round: the trainer is already broadcasting its first bucket, which nothing will read,
            so the group goes (its broadcast fails at once instead of after the timeout); the next push forms a
            new one."""
            self.shutdown()

        def shutdown(self) -> None:
            close_group(self.group)
            self.group, self.store = None, None

    return GlooWeightTransferEngine


def make_trainer_engine_class() -> type:
    """The trainer side, built on vLLM's ``TrainerWeightTransferEngine``."""
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclass
    class GlooTrainerInitInfo(GlooGroupInfo, TrainerInitInfo):
        """Trainer-side init info: the group's :class:`GlooGroupInfo` (``master_port`` 0: rank 0 opens the store
        on a port the system picks) and vLLM's keyword-only ``rank``."""

        backend: ClassVar[str] = BACKEND

    class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine):
        """Rank 0 sends: it announces the round (``/update_weights`` on a side thread, which blocks in the
        worker's receive) and broadcasts the buckets. The other ranks only iterate the source, which keeps them in
        the gathers of a sharded policy."""

        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client: Any, source: Any, is_sender: bool, bucket_bytes: int,
                     timeout_s: float) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.bucket_bytes = bucket_bytes
            self.timeout_s = timeout_s
            self.group: dist.ProcessGroup | None = None
            self.store: dist.Store | None = None
            self.listener: Any = None

        @classmethod
        def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                         source: Any = None) -> GlooTrainerWeightTransferEngine:
            if source is None:
                raise ValueError("the gloo weight transfer needs a WeightSource")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                         bucket_bytes=int(init_info.bucket_bytes), timeout_s=float(init_info.timeout_s))
            if not engine.is_sender:
                return engine
            engine.store, engine.listener = open_store(init_info.master_address, engine.timeout_s)
            worker_info = GlooWeightTransferInitInfo(
                init_info.master_address, engine.store.port, init_info.world_size, engine.bucket_bytes,
                engine.timeout_s, init_info.token, rank_offset=1)
            # the workers answer the init once every rank has joined the group, this one included, so the init runs
            # on a thread; this rank joins only once a worker has written to the store (it passed its checks), so a
            # refused init leaves no join waiting out its timeout (gloo ends the process when one does)
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                keys = engine.store.num_keys()
                answer = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
                wait_for_peer(engine.store, keys, answer, engine.timeout_s)
                engine.group = open_group(engine.store, 0, init_info.world_size, "gloo", engine.timeout_s,
                                          init_info.master_address)
                answer.result()
            except BaseException:
                engine.shutdown()
                raise
            finally:
                pool.shutdown(wait=False)
            # in the trainer's process only (not imported at the top: vLLM's own processes load this module too)
            from lit_grpo.core.distributed import close_at_exit

            close_at_exit(engine.shutdown)  # the group's worker threads are joined before the interpreter finalizes
            return engine

        def send_weights(self) -> None:
            meta = source_metadata(self.source)
            if not self.is_sender:
                for _ in source_tensors(self.source):
                    pass
                return
            if self.group is None:
                raise RuntimeError("trainer_init must open the group before send_weights")
            manifest = round_manifest(((m.name, m.dtype, m.shape) for m in meta), self.bucket_bytes)
            self.client.start_weight_update()
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                future = pool.submit(self.client.update_weights, manifest.to_json())
                try:
                    self._broadcast(manifest)
                except Exception:
                    # a worker that refused the round closed the group, which is what failed the broadcast: its
                    # answer says why
                    refusal = answered_error(future, REFUSAL_WAIT_S)
                    if refusal is not None:
                        raise refusal from None
                    raise
                future.result()
            finally:
                # a failed broadcast leaves the worker blocked in its receive: do not wait for that thread
                pool.shutdown(wait=False)
            self.client.finish_weight_update()

        def _broadcast(self, manifest: PushManifest) -> None:
            tensors = source_tensors(self.source)
            for start, stop, _ in manifest.spans:
                bucket = []
                for name, dtype, shape in zip(manifest.names[start:stop], manifest.dtype_names[start:stop],
                                              manifest.shapes[start:stop]):
                    got, tensor = next(tensors, (None, None))
                    if got != name or tensor is None or dtype_name(tensor.dtype) != dtype \
                            or list(tensor.shape) != shape:
                        seen = None if tensor is None else (got, dtype_name(tensor.dtype), list(tensor.shape))
                        raise ValueError(f"the weight source yielded {seen} where its metadata announced "
                                         f"{(name, dtype, shape)}")
                    bucket.append(tensor)
                wait_work(self.group.broadcast(pack(bucket, torch.device("cpu")), root=0), self.timeout_s)
            extra = next(tensors, None)
            if extra is not None:
                raise ValueError(f"the weight source yielded {extra[0]!r} beyond the {len(manifest.names)} tensors "
                                 "its metadata announced")

        def shutdown(self) -> None:
            # runs after a failed push, at ServerEngine.close and again at exit: a second call finds nothing left.
            # The store closes its own listening socket when it goes (weight_transfer.open_store); closing the
            # listener here too closed that descriptor twice ("[Errno 9] Bad file descriptor" at exit)
            group, self.group, self.store, self.listener = self.group, None, None, None
            close_group(group)

    return GlooTrainerWeightTransferEngine


_registered: dict[str, type] = {}


def register() -> None:
    """The vLLM general plugin: register the gloo engines with vLLM's factories (once per process; vLLM may call
    plugins several times)."""
    if _registered:
        return
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory, WeightTransferTrainerFactory

    worker, trainer = make_worker_engine_class(), make_trainer_engine_class()
    for factory, engine in ((WeightTransferEngineFactory, worker), (WeightTransferTrainerFactory, trainer)):
        if BACKEND not in factory._registry:  # registering twice raises; another copy may have done it
            factory.register_engine(BACKEND, engine)
    _registered.update(worker=worker, trainer=trainer, init_info=trainer.init_info_cls)


def trainer_init_info(master_address: str, world_size: int, rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                      timeout_s: float = DEFAULT_TIMEOUT_S, token: str | None = None) -> Any:
    """The trainer's init info for this backend (registers it first); ``token``: the one ``vllm serve`` was started
    with, which its workers check."""
    register()
    return _registered["init_info"](master_address, 0, world_size, bucket_bytes, timeout_s, token, rank=rank)


