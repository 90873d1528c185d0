"""Giving freed heap back to the OS once `serve` has started.

Loading, packing and warm-up allocate and free hundreds of MiB on the host (read buffers, conversion
temporaries, the warm-up runs' XLA temp buffers, compiler scratch). glibc's malloc keeps what was freed
in its arenas for reuse, so it stays in the process's resident memory although nothing uses it:
measured on SmolLM2 int8 at 16 slots x 2048 (docs/benchmarks.md, Start-up), `malloc_trim(0)` at ready
took RSS from 2,642 to 2,499 MiB. Nothing changes but where the pages are: the next malloc that needs
them maps them again, so behaviour and outputs are identical.

Before loading, `serve` also fixes glibc's mmap threshold (fix_mmap_threshold), so that the large blocks
compiles and runs free go back to the OS at once instead of staying in the heap.
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


M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: larger blocks get pages of their own, returned to the OS on free
TUNABLES = ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # a user's own malloc settings


def fix_mmap_threshold(environ=os.environ) -> str:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD; what was done, for the log.

    glibc raises the threshold each time an mmapped block is freed (up to 32 MiB), so after the first
    compile the compiler's and the programs' large temporaries come from the heap, and what they free
    stays resident, interleaved with live data that keeps the heap from being trimmed. A fixed value turns
    that off: each large block is mapped and unmapped by itself (docs/benchmarks.md, "glibc's mmap
    threshold"). Call before JAX starts its threads; malloc settings the environment names win."""
    libc = _glibc()
    if libc is None:
        return "malloc settings left as they are (not glibc)"
    named = [name for name in TUNABLES if name in environ and (name != "GLIBC_TUNABLES" or "malloc" in environ[name])]
    if named:
        return f"malloc settings left to {', '.join(named)}"
    if not libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        return "malloc settings left as they are (mallopt refused the mmap threshold)"
    return f"malloc: mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB"
