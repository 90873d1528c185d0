"""cli/memory.py: freed heap that glibc keeps in its arenas, and the compiler's code pages a compile paged
in, go back to the OS at serve's ready."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys

import pytest

from hkserve.cli.memory import (
    MMAP_THRESHOLD,
    _glibc,
    code_mappings,
    fix_mmap_threshold,
    release_code_pages,
    release_freed_heap,
)

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


def resident_kib(path: str) -> int:
    """This process's resident KiB of the mappings of `path` (smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" in parts[3]:
                ours = len(parts) > 5 and parts[5] == path
            elif parts[0] == "Rss:" and ours:
                total += int(parts[1])
    return total


def test_release_code_pages_hands_back_the_resident_pages_of_the_files_under_the_folders(tmp_path):
    """A file of its own (no other process maps its pages, as none maps a server's compiler pages; jaxlib's
    here are shared with the test processes, which keep them resident), mapped read-only and read."""
    code = tmp_path / "lib" / "libcode.so"
    code.parent.mkdir()
    code.write_bytes(os.urandom(32 * MIB))
    other = tmp_path / "other.so"
    other.write_bytes(os.urandom(8 * MIB))
    with code.open("rb") as f, other.open("rb") as g:
        mapped, kept = (
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ),
            mmap.mmap(g.fileno(), 0, access=mmap.ACCESS_READ),
        )
        try:
            assert sum(mapped[i] for i in range(0, len(mapped), 4096)) >= 0  # every page read: resident
            assert sum(kept[i] for i in range(0, len(kept), 4096)) >= 0
            before, other_before = resident_kib(str(code)), resident_kib(str(other))
            released = release_code_pages((str(code.parent) + os.sep,))
            after, other_after = resident_kib(str(code)), resident_kib(str(other))
            assert bytes(mapped[:16]) == code.read_bytes()[:16]  # read again from the file when touched
        finally:
            mapped.close()
            kept.close()
    assert before > 30 * 1024, f"{before} KiB resident after reading it all"  # the test's own control
    assert after < 1024, f"resident {before} -> {after} KiB"
    assert other_after == other_before, "a file outside the folders was paged out"
    assert released > 24 * MIB, f"reported {released / MIB:.1f} MiB of {(before - after) / 1024:.1f} released"


# In a fresh interpreter: compile a program (XLA's compiler code paged in), release the code pages, then
# compile and run another: the compiler reads what it needs again.
COMPILE_AFTER = """
import jax, jax.numpy as jnp
from hkserve.cli.memory import _code_folders, release_code_pages
jax.jit(lambda x: jnp.sin(x) @ x.T + jnp.cumsum(x, 0)).lower(jnp.ones((64, 64))).compile()
assert _code_folders(), "no jaxlib folder found"
release_code_pages()
print(float(jax.jit(lambda x: jnp.tanh(x).sum())(jnp.zeros((8, 8)) + 1.0)))
"""


def test_a_compile_after_the_code_pages_are_released_works():
    result = subprocess.run([sys.executable, "-c", COMPILE_AFTER], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert float(result.stdout) == pytest.approx(64 * 0.7615941559557649, rel=1e-6)


def test_code_mappings_are_the_read_only_ones_under_the_folders():
    maps = "\n".join(
        [
            "7f0000000000-7f0000100000 r--p 00000000 08:01 11 /venv/jaxlib/libjax_common.so",
            "7f0000100000-7f0000900000 r-xp 00100000 08:01 11 /venv/jaxlib/libjax_common.so",
            "7f0000900000-7f0000a00000 rw-p 00900000 08:01 11 /venv/jaxlib/libjax_common.so",
            "7f0000a00000-7f0000b00000 r-xp 00000000 08:01 12 /venv/numpy/core.so",
            "7f0000b00000-7f0000c00000 rw-p 00000000 00:00 0 ",
            "7f0000c00000-7f0000d00000 r-xp 00000000 08:01 13 /venv/jaxlib/cpu/with space.so",
        ]
    )
    assert code_mappings(maps, ("/venv/jaxlib/",)) == [
        (0x7F0000000000, 0x7F0000100000),
        (0x7F0000100000, 0x7F0000900000),
        (0x7F0000C00000, 0x7F0000D00000),
    ]
