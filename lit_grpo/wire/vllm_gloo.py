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
it (``weight_transfer.open_store`` / ``open_group``, the same primitives as the project's own server). A round
announces every tensor's name, dtype and shape in ``/update_weights``; both sides then cut the same list into
buckets of at most ``bucket_bytes`` (``bucket_spans``), and each bucket travels as one ``uint8`` broadcast.

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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from lit_grpo.wire.auth import push_refusal
from lit_grpo.wire.weight_transfer import (
    close_group,
    dtype_from_name,
    dtype_name,
    local_address_towards,
    nbytes,
    open_group,
    open_store,
    pack,
    unpack,
    wait_work,
)

#: the name the engines are registered under (``--weight-transfer-config '{"backend": "gloo"}'``)
BACKEND = "gloo"
#: bytes a bucket holds at most (a larger tensor travels alone)
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 600.0


def bucket_spans(sizes: list[int], bucket_bytes: int) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of consecutive tensors whose bytes add up to at most ``bucket_bytes`` (a
    larger tensor alone). Both sides compute it from the announced metadata, so they cut the stream alike."""
    spans: list[tuple[int, int]] = []
    start, total = 0, 0
    for index, size in enumerate(sizes):
        if index > start and total + size > bucket_bytes:
            spans.append((start, index))
            start, total = index, 0
        total += size
    if start < len(sizes):
        spans.append((start, len(sizes)))
    return spans


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
class GlooWeightTransferInitInfo:
    """What a vLLM worker needs to join the push group: the trainer's store, the worker's place in the group
    (``rank_offset`` + its global worker rank) and the shared token, which the worker checks before anything else."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    timeout_s: float = DEFAULT_TIMEOUT_S
    token: str | None = field(default=None, repr=False)


@dataclass
class GlooWeightTransferUpdateInfo:
    """One round's tensors, in the order they travel."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                             f"{len(self.dtype_names)}, {len(self.shapes)}")


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
        vLLM's layerwise reload (started in ``start_weight_update``, finished in ``finish_weight_update``), as
        the NCCL backend does."""

        init_info_cls = GlooWeightTransferInitInfo
        update_info_cls = GlooWeightTransferUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
            super().__init__(config, vllm_config, device, model)
            self.group: dist.ProcessGroup | None = None
            self.store: dist.Store | None = None
            self.bucket_bytes = DEFAULT_BUCKET_BYTES
            self.timeout_s = DEFAULT_TIMEOUT_S

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
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            # the route is open: without a group an authenticated init formed, leave the layers where they are
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised: an init with the server's token must "
                                   "come first")
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # the base class ends with torch.accelerator.synchronize(), which has nothing to wait for on a CPU
            # and whose CPU behaviour differs between torch releases; gloo's wait below already blocks
            self.receive_weights(self.parse_update_info(update_info))

        def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError("gloo weight transfer not initialised: call init_weight_transfer_engine first")
            dtypes = [dtype_from_name(name) for name in update_info.dtype_names]
            sizes = [nbytes(dtype, shape) for dtype, shape in zip(dtypes, update_info.shapes)]
            for start, stop in bucket_spans(sizes, self.bucket_bytes):
                buffer = torch.empty(sum(sizes[start:stop]), dtype=torch.uint8)
                wait_work(self.group.broadcast(buffer, root=0), self.timeout_s)
                tensors = unpack(buffer, dtypes[start:stop], update_info.shapes[start:stop])
                self.model.load_weights(list(zip(update_info.names[start:stop], tensors)))

        def shutdown(self) -> None:
            close_group(self.group)
            self.group, self.store = None, None

    return GlooWeightTransferEngine


def make_trainer_engine_class() -> type:
    """The trainer side, built on vLLM's ``TrainerWeightTransferEngine``."""
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """Trainer-side init info: where rank 0 opens the store (``master_port`` 0: a port the system picks),
        the whole group's size (1 + the server's workers), the bucket size, the timeout and the token the server's
        workers check."""

        backend: ClassVar[str] = BACKEND

        master_address: str
        master_port: int
        world_size: int
        bucket_bytes: int = DEFAULT_BUCKET_BYTES
        timeout_s: float = DEFAULT_TIMEOUT_S
        token: str | None = field(default=None, repr=False)

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
                init_info.master_address, engine.store.port, 1, init_info.world_size, engine.bucket_bytes,
                engine.timeout_s, init_info.token)
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
            info = GlooWeightTransferUpdateInfo([m.name for m in meta], [dtype_name(m.dtype) for m in meta],
                                                [list(m.shape) for m in meta])
            sizes = [nbytes(m.dtype, m.shape) for m in meta]
            self.client.start_weight_update()
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                future = pool.submit(self.client.update_weights, asdict(info))
                self._broadcast(meta, sizes)
                future.result()
            finally:
                # a failed broadcast leaves the worker blocked in its receive: do not wait for that thread
                pool.shutdown(wait=False)
            self.client.finish_weight_update()

        def _broadcast(self, meta: list[Any], sizes: list[int]) -> None:
            tensors = source_tensors(self.source)
            for start, stop in bucket_spans(sizes, self.bucket_bytes):
                bucket = []
                for expected in meta[start:stop]:
                    name, tensor = next(tensors, (None, None))
                    if name != expected.name or tensor is None or tensor.dtype != expected.dtype \
                            or tuple(tensor.shape) != tuple(expected.shape):
                        got = None if tensor is None else (name, tensor.dtype, tuple(tensor.shape))
                        raise ValueError(f"the weight source yielded {got} where its metadata announced "
                                         f"{(expected.name, expected.dtype, tuple(expected.shape))}")
                    bucket.append(tensor)
                wait_work(self.group.broadcast(pack(bucket, torch.device("cpu")), root=0), self.timeout_s)
            extra = next(tensors, None)
            if extra is not None:
                raise ValueError(f"the weight source yielded {extra[0]!r} beyond the {len(meta)} tensors its "
                                 "metadata announced")

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


