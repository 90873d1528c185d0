"""Giving freed heap back to the OS once `serve` has started.

Loading, packing and warm-up allocate and free hundreds of MiB on the host (read buffers, conversion
temporaries, the warm-up runs' XLA temp buffers, compiler scratch). glibc's malloc keeps what was freed
in its arenas for reuse, so it stays in the process's resident memory although nothing uses it:
measured on SmolLM2 int8 at 16 slots x 2048 (docs/benchmarks.md, Start-up), `malloc_trim(0)` at ready
took RSS from 2,642 to 2,499 MiB. Nothing changes but where the pages are: the next malloc that needs
them maps them again, so behaviour and outputs are identical.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

import psutil


@functools.cache
def _glibc():
    """glibc's handle when this process runs on it (malloc_trim is a glibc extension; musl and macOS
    have none), else None."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "gnu_get_libc_version") else None


def release_freed_heap() -> int:
    """Return the free pages of every malloc arena to the OS (glibc's malloc_trim(0)); the bytes by
    which resident memory shrank (0 where the C library has no malloc_trim)."""
    libc = _glibc()
    if libc is None:
        return 0
    process = psutil.Process()
    before = process.memory_info().rss
    libc.malloc_trim(0)
    return max(0, before - process.memory_info().rss)
