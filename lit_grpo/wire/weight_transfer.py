"""The bytes of a weight push between a trainer and a rollout server (``lit_grpo serve``): the primitives both
sides use (``weight_push`` is the trainer's side of a push, ``weight_receive`` the server's).

The two processes form a process group of their own, never the trainer's: a ``TCPStore`` that the trainer's
rank 0 opens (it is rank 0 of the group, the server rank 1), and a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (GPU) over a ``PrefixStore``. A push announces its tensors over HTTP in the one round format
of every receiver (``lit_grpo.wire.push_format``: names, dtypes, shapes and the buckets' spans, checked by the
receiver before a byte arrives) and sends each bucket's bytes with one ``broadcast`` from rank 0: the bucket's
tensors are packed back to back into one ``uint8`` buffer (``pack`` / ``unpack``), so a bucket costs one
collective.

A transfer that does not finish raises instead of hanging: each side waits on the broadcast's work with the
group's timeout (``wait_work``), and an NCCL group is built with blocking wait and with a timeout that aborts the
group instead of ending the process (``NCCL_GROUP_ENV``). With NCCL the bytes live on the device each side names
(``transport_device``: the server's own ``--device``).

Nothing here authenticates: torch.distributed traffic is not authenticated, which is why the store listens only
on the address the trainer gives (``open_store``) and the server only joins a group its token-guarded HTTP route
was told about.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

#: dtypes that can travel, by the names vLLM's update_info uses (``str(dtype).split(".")[-1]``)
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
BACKENDS = ("gloo", "nccl")
STORE_PREFIX = "lit_grpo_weights"
#: how the push group's NCCL work fails (read by ``ProcessGroupNCCL`` when it is built, so they apply to this group
#: only): ``wait()`` blocks the host and raises once the group's timeout has passed (blocking wait), and a timeout
#: aborts the group's communicators without ending the process (2 = CleanUpOnly; the default, 3, ends the process
#: from the watchdog thread with a message that names no server)
NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).split(".")[-1]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype name {name!r}; expected one of {sorted(DTYPES)}")
    return DTYPES[name]


def nbytes(dtype: torch.dtype, shape: Iterable[int]) -> int:
    numel = 1
    for size in shape:
        numel *= int(size)
    return numel * torch.empty((), dtype=dtype).element_size()


def checksum(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes (dtype and shape included), to compare weights across processes exactly."""
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.sha256(f"{dtype_name(data.dtype)}{tuple(data.shape)}".encode())
    digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def local_address_towards(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP ``connect`` only picks the route; nothing is sent)."""
    if host in ("localhost", "127.0.0.1", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))
        return sock.getsockname()[0]


def transport_device(backend: str, device: torch.device | str | None = None) -> torch.device:
    """Where a bucket's bytes live for ``backend``: the CPU for gloo; for NCCL the CUDA device given (the server's
    own ``--device``: its HTTP handler threads would otherwise see cuda:0 as the current device), else this
    thread's current CUDA device (the trainer's rank, set by Lightning on the main thread)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-transfer backend {backend!r}; expected one of {BACKENDS}")
    if backend == "gloo":
        return torch.device("cpu")
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the nccl weight transfer needs a CUDA device, got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def open_store(address: str, timeout_s: float) -> tuple[dist.TCPStore, socket.socket]:
    """The trainer's side of the rendezvous: a ``TCPStore`` master listening on ``address`` only, on a port the
    system picks (no race for a free port). The store owns the listening socket from then on and closes it when it
    is destroyed, so the returned socket is detached: closing it does nothing, where closing the descriptor itself
    would close it twice (``[Errno 9] Bad file descriptor``, or another file that reused the number)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(16)
    store = dist.TCPStore(address, listener.getsockname()[1], 2, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.fileno())
    listener.detach()
    return store, listener


def open_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float,
               local_address: str) -> dist.ProcessGroup:
    """Join the push group (blocks until every rank has joined, at most ``timeout_s``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-transfer backend {backend!r}; expected one of {BACKENDS}")
    prefixed = dist.PrefixStore(STORE_PREFIX, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address)]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    with environment(NCCL_GROUP_ENV):
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them (the push group's NCCL settings
    must not leak into process groups made later)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def wait_work(work: dist.Work, timeout_s: float) -> None:
    """Block this thread until ``work`` is done, at most ``timeout_s``. A bare ``wait()`` on NCCL work only makes
    the current CUDA stream wait: the host went on, and a dead peer was noticed only by the NCCL watchdog, which
    ended the process. With a timeout the wait blocks the host and raises the backend's error
    (``DistBackendError`` for NCCL, ``RuntimeError`` for gloo) when the work fails or times out; a ``False``
    answer (not completed) is raised as ``TimeoutError``."""
    if work.wait(datetime.timedelta(seconds=timeout_s)) is False:
        raise TimeoutError(f"the transfer did not complete within {timeout_s:g} s")


def close_group(group: dist.ProcessGroup | None) -> None:
    """Best effort: unblock and drop a group whose peer may be gone."""
    if group is None:
        return
    for method in ("abort", "shutdown"):
        try:
            getattr(group, method)()
            return
        except Exception:  # noqa: BLE001 (a broken group may refuse either; it is dropped anyway)
            continue


def packed_view(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """The tensors' bytes as one ``uint8`` view, without a copy, when they already lie back to back in one storage
    on ``device`` (a bucket the push's gather rebuilt in place, ``rank0_buckets``, or a single tensor); else
    ``None``."""
    if not tensors or any(t.device != device or not t.is_contiguous() for t in tensors):
        return None
    first = tensors[0].detach()
    storage = first.untyped_storage()
    position = first.data_ptr()
    for tensor in tensors:
        if tensor.untyped_storage().data_ptr() != storage.data_ptr() or tensor.data_ptr() != position:
            return None
        position += tensor.numel() * tensor.element_size()
    view = torch.empty(0, dtype=torch.uint8, device=device)
    return view.set_(storage, first.data_ptr() - storage.data_ptr(), (position - first.data_ptr(),))


def pack(tensors: list[torch.Tensor], device: torch.device, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back in one ``uint8`` tensor on ``device``: a view when they already lie so
    (``packed_view``), else copied once, into ``buffer`` when it is large enough (reusing a buffer spares the page
    faults of fresh memory, which cost as much as the copy on a CPU)."""
    view = packed_view(tensors, device)
    if view is not None:
        return view
    flat = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    if len(flat) == 1:
        return flat[0]
    total = sum(f.numel() for f in flat)
    if buffer is not None and buffer.numel() >= total and buffer.device == device:
        return torch.cat(flat, out=buffer[:total])
    return torch.cat(flat)


def unpack(buffer: torch.Tensor, dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """Views of ``buffer`` (``uint8``) as the announced tensors; a tensor whose offset is not a multiple of its
    element size is copied out (views need aligned storage)."""
    out, offset = [], 0
    for dtype, shape in zip(dtypes, shapes, strict=True):
        size = nbytes(dtype, shape)
        piece = buffer[offset : offset + size]
        if offset % torch.empty((), dtype=dtype).element_size():
            piece = piece.clone()
        out.append(piece.view(dtype).reshape(shape))
        offset += size
    if offset != buffer.numel():
        raise ValueError(f"a bucket of {buffer.numel()} bytes was announced as {offset} bytes of tensors")
    return out


def bucket_spans(sizes: Iterable[int], bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """The one cut of a weight push into buckets: ``[start, stop)`` index ranges of consecutive items whose bytes
    (``sizes``, in the order they travel) add up to at most ``bucket_bytes``; an item larger than that travels alone.
    An item joins the open bucket when the sum stays within the cap, else it opens the next one.

    Every cut of a push is this one, so the same tensors make the same buckets whoever cuts them: the manifest of a
    round (``push_format.round_manifest``), rank 0's gather of FSDP2 shards (``rank0_buckets``, planned up front so
    every rank agrees) and the stream of a push (``buckets``). The cap is checked here, at the call; the spans are
    lazy: a span comes out as soon as the item after it is seen (or ``sizes`` ends), so a stream is never read more
    than one item ahead of its buckets."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes!r}")
    return _spans(iter(sizes), bucket_bytes)


def _spans(sizes: Iterator[int], bucket_bytes: int) -> Iterator[tuple[int, int]]:
    """``bucket_spans`` past its check of the cap (a generator checks nothing until it is first read)."""
    start = total = count = 0
    for index, size in enumerate(sizes):
        count = index + 1
        if index > start and total + size > bucket_bytes:
            yield start, index
            start, total = index, 0
        total += size
    if start < count:
        yield start, count


def buckets(named_tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int,
            convert=lambda t: t) -> Iterator[list[tuple[str, torch.Tensor]]]:  # noqa: ANN001
    """Group consecutive ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a larger tensor travels
    alone), cut by ``bucket_spans`` on the converted tensors' bytes. ``convert`` is applied to each tensor as it
    arrives (a cast to the server's dtype); a bucket is handed out as soon as it is full, so at most one bucket
    (and the tensor after it) is held at a time."""
    held: list[tuple[str, torch.Tensor]] = []  # the open bucket, then the tensor that closed it

    def sizes() -> Iterator[int]:
        for name, tensor in named_tensors:
            tensor = convert(tensor)
            held.append((name, tensor))
            yield tensor.numel() * tensor.element_size()

    for start, stop in bucket_spans(sizes(), bucket_bytes):
        yield held[: stop - start]
        del held[: stop - start]
