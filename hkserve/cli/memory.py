"""Giving memory the server no longer uses back to the OS once `serve` has started: freed heap, and
the compiler's code pages.

Loading, packing and warm-up allocate and free hundreds of MiB on the host (read buffers, conversion
temporaries, the warm-up runs' XLA temp buffers, compiler scratch). glibc's malloc keeps what was freed
in its arenas for reuse, so it stays in the process's resident memory although nothing uses it:
measured on SmolLM2 int8 at 16 slots x 2048 (docs/benchmarks.md, Start-up), `malloc_trim(0)` at ready
took RSS from 2,642 to 2,499 MiB. Nothing changes but where the pages are: the next malloc that needs
them maps them again, so behaviour and outputs are identical.

Before loading, `serve` also fixes glibc's mmap threshold (fix_mmap_threshold), so that the large blocks
compiles and runs free go back to the OS at once instead of staying in the heap.

Compiling pages in the compiler's own machine code: XLA lives in jaxlib's shared library (libjax_common.so,
~100 MiB of text), and a cold start that compiles its programs touches ~27 MiB more of it than a warm
start that only loads them from the compile cache (docs/benchmarks.md, "What a cold start holds"). Those
pages are clean and file-backed, unused until the next compile: release_code_pages hands them back to the
kernel (madvise MADV_PAGEOUT), and whatever runs next reads the pages it touches again from the file.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from pathlib import Path

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


MADV_PAGEOUT = 21  # madvise's advice (Linux 5.4+): reclaim these pages now; clean file pages are dropped
CODE_PACKAGES = ("jaxlib", "jax_plugins", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


def _code_folders() -> tuple[str, ...]:
    """The folders of the loaded packages that carry XLA's compiler (jaxlib, a GPU plugin), as prefixes."""
    folders = []
    for name in CODE_PACKAGES:
        module = sys.modules.get(name)
        for path in getattr(module, "__path__", None) or ():
            folders.append(str(Path(path).resolve()) + os.sep)
    return tuple(folders)


def code_mappings(maps_text: str, folders: tuple[str, ...]) -> list[tuple[int, int]]:
    """(start, end) of the read-only mappings (code and constants, never writable data) of the files
    under `folders`, from /proc/self/maps's text."""
    ranges = []
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or "w" in parts[1] or not parts[5].startswith(folders):
            continue
        start, end = (int(x, 16) for x in parts[0].split("-"))
        ranges.append((start, end))
    return ranges


def release_code_pages(folders: tuple[str, ...] | None = None) -> int:
    """Hand the resident pages of XLA's compiler code (of the files under `folders`; None: jaxlib's and
    a GPU plugin's) back to the kernel (module docstring), once the programs that need it are compiled;
    the bytes by which resident memory shrank (0 off Linux, or on a kernel without MADV_PAGEOUT). A later
    compile reads the pages it needs again: nothing else changes. The kernel reclaims only the pages no
    other process maps."""
    libc = _glibc()
    folders = _code_folders() if folders is None else folders
    if libc is None or not folders or not hasattr(libc, "madvise"):
        return 0
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    process = psutil.Process()
    before = process.memory_info().rss
    try:
        with open("/proc/self/maps") as maps:
            ranges = code_mappings(maps.read(), folders)
    except OSError:
        return 0
    for start, end in ranges:
        if libc.madvise(start, end - start, MADV_PAGEOUT) != 0:
            return max(0, before - process.memory_info().rss)  # EINVAL: a kernel older than 5.4
    return max(0, before - process.memory_info().rss)
