"""The one format of a weight-push round, for every receiver: the project's server (gloo or NCCL), the gloo vLLM
plugin (``lit_grpo.wire.vllm_gloo``) and, on the trainer's side, vLLM's own NCCL engine.

A round (or the part of it one ``/update_weights`` announces) is a ``PushManifest``: the tensors' names, dtype names
and shapes, in the order they travel, and its buckets as ``spans``, ``[start, stop, nbytes]`` each: tensors
``start..stop-1`` lie back to back in one ``uint8`` buffer of ``nbytes`` bytes, which travels as one broadcast
(``weight_transfer.pack`` / ``unpack``). Its JSON form is ``asdict`` of it, whose ``names`` / ``dtype_names`` /
``shapes`` are vLLM's ``update_info`` fields; an announcement without ``spans`` is one bucket.

- The packer (trainer side): ``round_manifest`` cuts a round's metadata into buckets of at most ``bucket_bytes``
  (``weight_transfer.bucket_spans``, the one cut of every push; a larger tensor travels alone), ``bucket_manifest``
  announces a bucket already gathered, and ``pack_bucket`` gives a bucket's manifest with its bytes.
- The validator (receiver side): ``validate`` checks a manifest against what the receiver holds (``Expected``:
  every name known and sent once, dtypes and shapes matching, spans covering the tensors in order with bytes that
  add up, no bucket above the receiver's limit) before a byte is received, and raises one ``PushFormatError`` that
  lists the first bad entries. A refused round leaves the receiver's weights and version as they were.
- ``receive_spans`` is the receiver's loop over the buckets of a validated manifest: one broadcast per bucket.

Who checks what:

- the project's server (``lit_grpo.serve.weight_receive``, the same code for gloo and NCCL) validates each
  announcement against the parameters the push writes, with what it was sent earlier in the push;
- the gloo vLLM plugin's worker validates the round against the vLLM model's parameters
  (``vllm_gloo.model_expectations``) before vLLM's layerwise reload sets any layer aside;
- vLLM's own NCCL engine (``--weight-transfer-config '{"backend":"nccl"}'``) is vLLM's receiver, which this project
  cannot change: it takes ``names`` / ``dtype_names`` / ``shapes``, recomputes its own packing and checks nothing
  before ``load_weights``; and ``vllm serve`` reports nothing about its parameters (``/weight_info`` has the version
  only), so no receiver-side check is possible there. The trainer side checks what it can: the round is built by
  the same packer from the source's metadata and validated against that metadata (``check_round``: names sent
  once, dtypes that can travel, sizes that add up), and vLLM's trainer checks each tensor against it as it goes.

Nothing else is on the wire: no checksums travel with a push (``weight_transfer.checksum`` compares weights after
one, through ``/weight_checker``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lit_grpo.wire.weight_transfer import DTYPES, bucket_spans, dtype_name, nbytes, pack, unpack, wait_work

#: how many bad entries a refusal lists
SHOWN_ERRORS = 5


class PushFormatError(ValueError):
    """A malformed round: the manifest does not describe what the receiver holds, or is not a manifest at all."""


@dataclass(frozen=True)
class Expected:
    """What a receiver holds under one name: the dtype it takes and the shape it expects. ``loose_dims`` are the
    dims its loader may cut (a parameter packed from several checkpoint tensors, padded, or split over tensor
    parallel ranks): there the announced size may be up to ``shape[d] * scale``; every other dim must match."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    loose_dims: tuple[int, ...] = ()
    scale: int = 1

    def shape_error(self, shape: list[int]) -> str | None:
        """Why ``shape`` does not fit, or ``None``."""

        def fits(dim: int, size: int, held: int) -> bool:
            return size <= held * self.scale if dim in self.loose_dims else size == held

        if len(shape) != len(self.shape) or not all(fits(d, *sizes) for d, sizes in enumerate(zip(shape, self.shape))):
            loose = "" if not self.loose_dims else f" (dims {list(self.loose_dims)} up to x{self.scale})"
            return f"shape {shape}, expected {list(self.shape)}{loose}"
        return None


@dataclass
class PushManifest:
    """One round's (or one announcement's) tensors in the order they travel, and its buckets (``spans``:
    ``[start, stop, nbytes]``; ``None``: the whole announcement is one bucket). Built, it is well formed: equal
    lengths, names and dtype names strings, shapes lists of sizes >= 0, spans lists of three integers; whether it
    fits a receiver is ``validate``'s to say."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    spans: list[list[int]] | None = field(default=None)

    def __post_init__(self) -> None:
        for key in ("names", "dtype_names", "shapes"):
            if not isinstance(getattr(self, key), list):
                raise PushFormatError(f"malformed weight-push round: {key} must be a list, got "
                                      f"{type(getattr(self, key)).__name__}")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise PushFormatError(f"malformed weight-push round: names, dtype_names and shapes differ in length: "
                                  f"{len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)}")
        if not self.names:
            raise PushFormatError("malformed weight-push round: no tensors announced")
        for index, (name, dtype, shape) in enumerate(zip(self.names, self.dtype_names, self.shapes)):
            if not isinstance(name, str) or not isinstance(dtype, str) or not is_int_list(shape) or any(
                    size < 0 for size in shape):
                raise PushFormatError(f"malformed weight-push round: entry {index} ({name!r}, {dtype!r}, {shape!r}) "
                                      "is not (name, dtype name, list of sizes >= 0)")
        if self.spans is None:
            self.spans = [[0, len(self.names), self.bytes_between(0, len(self.names))]]
        if not isinstance(self.spans, list) or not all(is_int_list(s) and len(s) == 3 for s in self.spans):
            raise PushFormatError(f"malformed weight-push round: spans must be a list of [start, stop, nbytes], got "
                                  f"{self.spans!r:.200}")

    @classmethod
    def from_json(cls, info: Any) -> PushManifest:
        """A manifest from its JSON form (an ``update_info``), or ``PushFormatError``."""
        if not isinstance(info, Mapping):
            raise PushFormatError(f"malformed weight-push round: expected an object with names, dtype_names, shapes "
                                  f"and spans, got {type(info).__name__}")
        unknown = sorted(set(info) - {"names", "dtype_names", "shapes", "spans"})
        if unknown:
            raise PushFormatError(f"malformed weight-push round: unknown fields {unknown}")
        return cls(info.get("names"), info.get("dtype_names"), info.get("shapes"), info.get("spans"))

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "dtype_names": list(self.dtype_names),
                "shapes": [list(s) for s in self.shapes], "spans": [list(s) for s in self.spans or ()]}

    def sizes(self) -> list[int | None]:
        """Each tensor's bytes (``None`` where its dtype name is unknown)."""
        return [math.prod(s) * DTYPES[d].itemsize if d in DTYPES else None for d, s in zip(self.dtype_names,
                                                                                              self.shapes)]

    def bytes_between(self, start: int, stop: int) -> int:
        return sum(size or 0 for size in self.sizes()[start:stop])


def is_int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


# ---- the packer (trainer side) ------------------------------------------------------------------------------------
def round_manifest(entries: Iterable[tuple[str, torch.dtype, Iterable[int]]], bucket_bytes: int) -> PushManifest:
    """The manifest of a whole round from its metadata, ``(name, dtype, shape)`` in the order the tensors travel,
    cut into buckets of at most ``bucket_bytes``."""
    entries = [(name, dtype, [int(s) for s in shape]) for name, dtype, shape in entries]
    sizes = [nbytes(dtype, shape) for _, dtype, shape in entries]
    spans = [[start, stop, sum(sizes[start:stop])] for start, stop in bucket_spans(sizes, bucket_bytes)]
    return PushManifest([e[0] for e in entries], [dtype_name(e[1]) for e in entries], [e[2] for e in entries], spans)


def bucket_manifest(bucket: list[tuple[str, torch.Tensor]]) -> PushManifest:
    """The manifest of one bucket already in hand (an announcement of the project's server: one span)."""
    size = sum(t.numel() * t.element_size() for _, t in bucket)
    return PushManifest([name for name, _ in bucket], [dtype_name(t.dtype) for _, t in bucket],
                        [list(t.shape) for _, t in bucket], [[0, len(bucket), size]])


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device,
                buffer: torch.Tensor | None = None) -> tuple[PushManifest, torch.Tensor]:
    """A bucket's manifest and its bytes as one ``uint8`` tensor on ``device`` (``weight_transfer.pack``: a view
    when the tensors already lie back to back, else one copy, into ``buffer`` when it is large enough)."""
    return bucket_manifest(bucket), pack([t for _, t in bucket], device, buffer)


def check_round(entries: Iterable[tuple[str, torch.dtype, Iterable[int]]],
                bucket_bytes: int | None = None) -> PushManifest:
    """The trainer's own check of a round it is about to send where the receiver checks nothing (vLLM's NCCL
    engine): its manifest (``round_manifest``, in buckets of ``bucket_bytes``; ``None``: one) validated against its
    metadata, so that a name declared twice or a dtype that cannot travel is refused before anything is sent."""
    entries = [(name, dtype, tuple(int(s) for s in shape)) for name, dtype, shape in entries]
    if bucket_bytes is None:
        bucket_bytes = max(1, sum(nbytes(dtype, shape) for _, dtype, shape in entries))
    manifest = round_manifest(entries, bucket_bytes) if all(dtype_name(d) in DTYPES for _, d, _ in entries) else None
    declared = {name: Expected(dtype, shape) for name, dtype, shape in entries}
    if manifest is None:
        bad = [f"{name!r}: dtype {dtype_name(dtype)} cannot travel (one of {sorted(DTYPES)})"
               for name, dtype, _ in entries if dtype_name(dtype) not in DTYPES]
        raise PushFormatError(f"malformed weight-push round refused by the trainer, nothing sent: "
                              f"{'; '.join(bad[:SHOWN_ERRORS])}")
    validate(manifest, declared, max_bucket_bytes=bucket_bytes, receiver="the trainer")
    return manifest


# ---- the validator (receiver side) --------------------------------------------------------------------------------
def validate(manifest: PushManifest, expected: Mapping[str, Expected] | Callable[[str], Expected | None], *,
             seen: Iterable[str] = (), max_bucket_bytes: int | None = None,
             receiver: str = "the receiver") -> list[torch.dtype]:
    """Check ``manifest`` against what the receiver holds (``expected``: by name, or a lookup) before anything is
    received: names known and not sent before in this round (``seen``) nor twice in it, dtypes and shapes as
    expected, spans covering the tensors in order without gaps, each span's ``nbytes`` the sum of its tensors', and
    no bucket of several tensors above ``max_bucket_bytes``. Returns the tensors' dtypes; ``PushFormatError``
    listing the first bad entries otherwise."""
    lookup = expected.get if isinstance(expected, Mapping) else expected
    seen = set(seen)
    errors: list[str] = []
    dtypes: list[torch.dtype] = []
    for name, dtype, shape in zip(manifest.names, manifest.dtype_names, manifest.shapes):
        held = lookup(name)
        problem = None
        if held is None:
            problem = "unknown parameter"
        elif name in seen:
            problem = "sent twice in this round"
        elif dtype not in DTYPES:
            problem = f"unknown dtype {dtype!r}"
        elif DTYPES[dtype] != held.dtype:
            problem = f"dtype {dtype}, expected {dtype_name(held.dtype)} (cast before sending)"
        else:
            problem = held.shape_error(shape)
        if problem is not None:
            errors.append(f"{name!r}: {problem}")
        seen.add(name)
        dtypes.append(DTYPES.get(dtype, torch.uint8))
    errors += span_errors(manifest, max_bucket_bytes)
    if errors:
        shown = "; ".join(errors[:SHOWN_ERRORS])
        more = f" (and {len(errors) - SHOWN_ERRORS} more)" if len(errors) > SHOWN_ERRORS else ""
        raise PushFormatError(f"malformed weight-push round refused by {receiver}, nothing loaded: {shown}{more}")
    return dtypes


def span_errors(manifest: PushManifest, max_bucket_bytes: int | None = None) -> list[str]:
    """What is wrong with the manifest's spans: not consecutive from 0 to the last tensor, empty, bytes that do not
    add up to their tensors', or a bucket of several tensors above ``max_bucket_bytes``."""
    errors, position = [], 0
    sizes = manifest.sizes()
    for index, (start, stop, size) in enumerate(manifest.spans or ()):
        if start != position or not start < stop <= len(sizes):
            errors.append(f"span {index} [{start}, {stop}) does not follow on from tensor {position} "
                          f"(of {len(sizes)})")
            break
        total = sum(s or 0 for s in sizes[start:stop])
        if size != total:
            errors.append(f"span {index} [{start}, {stop}) announces {size} bytes, its tensors hold {total}")
        elif max_bucket_bytes is not None and stop - start > 1 and size > max_bucket_bytes:
            errors.append(f"span {index} [{start}, {stop}) holds {size} bytes, above the bucket limit "
                          f"{max_bucket_bytes}")
        position = stop
    else:
        if position != len(sizes):
            errors.append(f"the spans cover tensors 0..{position - 1} of {len(sizes)}")
    return errors


def receive_spans(manifest: PushManifest, dtypes: list[torch.dtype], group: dist.ProcessGroup, timeout_s: float,
                  buffer_for: Callable[[int, int], torch.Tensor]) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
    """The receiver's side of a validated manifest: per span, one broadcast from rank 0 into
    ``buffer_for(span index, nbytes)`` (a ``uint8`` tensor on the transfer device), then the span's names and its
    tensors as views of that buffer."""
    for index, (start, stop, size) in enumerate(manifest.spans or ()):
        buffer = buffer_for(index, size)
        wait_work(group.broadcast(buffer, root=0), timeout_s)
        yield manifest.names[start:stop], unpack(buffer, dtypes[start:stop], manifest.shapes[start:stop])
