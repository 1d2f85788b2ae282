"""Host memory that a long update frees goes back to the operating system instead of staying in the process.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap``, unmapped when it
is freed; smaller ones come from the heap, whose freed pages mostly stay in the process (counted in its resident
memory, the number the kernel's out-of-memory killer reads). The threshold starts at 128 KiB, but by default it is
dynamic: each freed mmapped block raises it to that block's size, up to 32 MiB. After the first few freed
activations, every tensor of a micro-batch under 32 MiB is in the heap. At 4,096 tokens those tensors are a
SmolLM2-135M layer's activations (9-24 MiB each). Their freed pages are then retained between layers and
micro-batches, so the process grows by gigabytes above what is alive at any moment: SmolLM2-135M at 4,096 new tokens
with activation checkpointing peaks at 4.7-5.2 GB with glibc's default against 3.3 GB with a fixed 1 MiB threshold
(docs/speed.md, "Freed memory back to the system").

:func:`fix_mmap_threshold` sets the threshold once for the process with ``mallopt`` (which also turns the dynamic
rise off) and trims what the heap already holds. It does nothing where glibc is not the allocator
(macOS, musl, or jemalloc / tcmalloc preloaded) or where the user set ``MALLOC_MMAP_THRESHOLD_`` themselves;
it returns why.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's mallopt parameter number for the threshold (malloc.h: ``#define M_MMAP_THRESHOLD -3``)
M_MMAP_THRESHOLD = -3
#: glibc caps the threshold at HEAP_MAX_SIZE / 2: 32 MiB on 64-bit
MAX_THRESHOLD_BYTES = 32 * 2**20
#: the variable through which glibc reads the same setting at start-up; a user who set it keeps it
ENV_VARIABLE = "MALLOC_MMAP_THRESHOLD_"


def check_threshold_kb(threshold_kb: int | None) -> None:
    """One line for a threshold glibc cannot take: a whole number of KiB from 0 to 32,768, or None."""
    if threshold_kb is None:
        return
    whole = isinstance(threshold_kb, int) and not isinstance(threshold_kb, bool)
    if not whole or not 0 <= threshold_kb * 1024 <= MAX_THRESHOLD_BYTES:
        raise ValueError(f"mmap_threshold_kb={threshold_kb!r}: expected a whole number of KiB from 0 to "
                         f"{MAX_THRESHOLD_BYTES // 1024} (glibc's maximum), or null for glibc's dynamic default")


def glibc() -> ctypes.CDLL | None:
    """glibc, when it is this process's ``malloc`` (not on macOS or musl, nor under a preloaded allocator)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
    except (OSError, AttributeError):
        return None
    # the malloc the process calls is the first in symbol lookup order: a preloaded jemalloc's or tcmalloc's
    process = ctypes.CDLL(None)
    if ctypes.cast(process.malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return None
    return libc


def fix_mmap_threshold(threshold_kb: int) -> str | None:
    """Serve every allocation of at least ``threshold_kb`` KiB with its own mapping, returned when freed, and trim
    the heap; None when done, else why not (the process is left as it was)."""
    check_threshold_kb(threshold_kb)
    if ENV_VARIABLE in os.environ:
        return f"{ENV_VARIABLE} is set in the environment ({os.environ[ENV_VARIABLE]!r}); it is kept"
    libc = glibc()
    if libc is None:
        return "the process's allocator is not glibc's malloc"
    if libc.mallopt(M_MMAP_THRESHOLD, threshold_kb * 1024) != 1:
        return f"glibc refused M_MMAP_THRESHOLD = {threshold_kb * 1024} bytes"
    libc.malloc_trim(0)  # what model loading and earlier work freed into the heap
    return None

