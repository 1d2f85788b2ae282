"""The bytes of a weight push between a trainer and a rollout server (``lit_grpo serve``).

The two processes form a process group of their own, never the trainer's: a ``TCPStore`` that the trainer's
rank 0 opens (it is rank 0 of the group, the server rank 1), and a ``ProcessGroupGloo`` (CPU) or
``ProcessGroupNCCL`` (GPU) over a ``PrefixStore``. A push announces one bucket of tensors over HTTP
(names, dtypes, shapes) and sends its bytes with one ``broadcast`` from rank 0: the bucket's tensors are packed
back to back into one ``uint8`` buffer (``pack`` / ``unpack``), so a bucket costs one collective.

Nothing here authenticates: torch.distributed traffic is not authenticated, which is why the store listens only
on the address the trainer gives (``open_store``) and the server only joins a group its token-guarded HTTP route
was told about.
"""

from __future__ import annotations

import datetime
import hashlib
import socket
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

#: dtypes that can travel, by the names vLLM's update_info uses (``str(dtype).split(".")[-1]``)
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}
BACKENDS = ("gloo", "nccl")
STORE_PREFIX = "lit_grpo_weights"


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


def transport_device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def open_store(address: str, timeout_s: float) -> tuple[dist.TCPStore, socket.socket]:
    """The trainer's side of the rendezvous: a ``TCPStore`` master listening on ``address`` only, on a port the
    system picks (no race for a free port). Keep the returned socket open as long as the store."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((address, 0))
    listener.listen(16)
    store = dist.TCPStore(address, listener.getsockname()[1], 2, True, datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=listener.fileno())
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
    return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)


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


def pack(tensors: list[torch.Tensor], device: torch.device, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """The tensors' bytes back to back in one ``uint8`` tensor on ``device``: a single tensor as a view of itself,
    several copied once, into ``buffer`` when it is large enough (reusing a buffer spares the page faults of
    fresh memory, which cost as much as the copy on a CPU)."""
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


def buckets(named_tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int,
            convert=lambda t: t) -> Iterator[list[tuple[str, torch.Tensor]]]:  # noqa: ANN001
    """Group consecutive ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a larger tensor travels
    alone). ``convert`` is applied to each tensor as it arrives (a cast to the server's dtype); a bucket is
    handed out as soon as it is full, so at most one bucket is held at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        tensor = convert(tensor)
        tensor_bytes = tensor.numel() * tensor.element_size()
        if bucket and size + tensor_bytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor_bytes
    if bucket:
        yield bucket
