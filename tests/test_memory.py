"""cli/memory.py: freed heap that glibc keeps in its arenas goes back to the OS at serve's ready."""

from __future__ import annotations

import ctypes

import pytest

from hkserve.cli.memory import _glibc, release_freed_heap

MIB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_release_freed_heap_returns_what_malloc_kept():
    libc = _glibc()
    if libc is None:
        pytest.fail("this test needs glibc (the serving images run on it)")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 64 MiB in 1 KiB blocks (below the mmap threshold: from the arena), touched, then all freed but
    # the last, which pins the heap's top so free() alone cannot shrink it: glibc keeps the 64 MiB.
    blocks = [libc.malloc(1024) for _ in range(64 * 1024)]
    for b in blocks:
        ctypes.memset(b, 1, 1024)
    for b in blocks[:-1]:
        libc.free(b)
    kept = rss_bytes()
    released = release_freed_heap()
    measured = kept - rss_bytes()
    libc.free(blocks[-1])
    assert released == pytest.approx(measured, abs=4 * MIB)  # what it reports is what left RSS
    assert released > 48 * MIB, f"released {released / MIB:.1f} MiB of the 64 MiB freed"
