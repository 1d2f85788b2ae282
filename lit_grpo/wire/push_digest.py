"""A digest of a weight push both sides compute (``PushDigest``): the trainer over the tensors it sends, in the order
it sends them; the project's server over its own parameters of the same names, after the swap. Equal digests say
the served model holds every pushed byte; a push that did not take effect (weights that never reach the sampler:
the field's most reported "training does nothing" bug) differs, and the trainer stops with one line naming the
server (``lit_grpo.engines.remote.weight_push``).

Exact on any device and cheap: a tensor's bytes are read as 16-bit integers (a byte tensor as 8-bit ones), each
weighted by its position modulo a prime so that a permutation changes the sum, and summed in int64 chunks small
enough never to overflow; no float arithmetic, so the trainer's GPU and the server's agree bit for bit whatever
their reduction order. Chunk sums and tensors combine modulo the Mersenne prime 2^61 - 1.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

MODULUS = 2**61 - 1
#: position weights cycle modulo this prime (1..65521): an element's weight is below 2^16
POSITION_PRIME = 65521
#: elements per int64 chunk: 2^20 x (2^15 x 2^16) < 2^52, far from int64's limit
CHUNK = 2**20


def tensor_digest(tensor: torch.Tensor) -> int:
    """The digest of one tensor's bytes (see the module's docstring)."""
    flat = tensor.detach().contiguous().reshape(-1)
    ints = flat.view(torch.uint8) if flat.element_size() % 2 else flat.view(torch.int16)
    total = 0
    for start in range(0, ints.numel(), CHUNK):
        part = ints[start:start + CHUNK].to(torch.int64)
        weights = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64)
        total = (total + int((part * (weights % POSITION_PRIME + 1)).sum())) % MODULUS
    return total


class PushDigest:
    """The running digest of one push: ``add`` each tensor in the order sent, ``value`` at the end."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        header = zlib.crc32(f"{name}|{str(tensor.dtype)}|{tuple(tensor.shape)}".encode())
        self.value = (self.value * 1_000_003 + header * 65_537 + tensor_digest(tensor)) % MODULUS

    def add_all(self, named: Iterable[tuple[str, torch.Tensor]]) -> PushDigest:
        for name, tensor in named:
            self.add(name, tensor)
        return self


__all__ = ["PushDigest", "tensor_digest"]
