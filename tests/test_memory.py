"""cli/memory.py: freed heap that glibc keeps in its arenas goes back to the OS at serve's ready."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from hkserve.cli.memory import MMAP_THRESHOLD, _glibc, fix_mmap_threshold, release_freed_heap

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


# In a fresh interpreter (malloc's state is per process): an 8 MiB block mmapped and freed raises glibc's
# dynamic mmap threshold past 4 MiB; then 16 blocks of 4 MiB are touched and all but the last freed (the
# last, live, keeps free() from trimming the heap's top, as live data among the compiler's temporaries
# does). Prints the MiB of the 60 freed that stayed resident.
HEAP_AFTER_FREE = """
import ctypes, sys
from hkserve.cli.memory import _glibc, fix_mmap_threshold
libc = _glibc()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "fixed":
    print(fix_mmap_threshold({}), file=sys.stderr)
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
libc.free(libc.malloc(8 << 20))
before = rss()
blocks = [libc.malloc(4 << 20) for _ in range(16)]
for b in blocks:
    ctypes.memset(b, 1, 4 << 20)
for b in blocks[:-1]:
    libc.free(b)
print((rss() - before) / 2**20 - 4)
"""


def heap_kept_after_free(mode: str) -> tuple[float, str]:
    result = subprocess.run([sys.executable, "-c", HEAP_AFTER_FREE, mode], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return float(result.stdout), result.stderr


def test_a_fixed_mmap_threshold_returns_large_freed_blocks_that_the_dynamic_one_keeps():
    if _glibc() is None:
        pytest.fail("this test needs glibc (the serving images run on it)")
    dynamic, _ = heap_kept_after_free("dynamic")
    fixed, log = heap_kept_after_free("fixed")
    assert dynamic > 52, f"glibc's dynamic threshold kept {dynamic:.1f} of 60 MiB"  # the test's own control
    assert fixed < 4, f"{fixed:.1f} MiB of 60 freed stayed resident with the threshold fixed"
    assert log.strip() == f"malloc: mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB"


def test_malloc_settings_the_environment_names_are_left_to_it():
    assert fix_mmap_threshold({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == (
        "malloc settings left to GLIBC_TUNABLES"
    )
    assert fix_mmap_threshold({"MALLOC_MMAP_THRESHOLD_": "65536"}) == "malloc settings left to MALLOC_MMAP_THRESHOLD_"
