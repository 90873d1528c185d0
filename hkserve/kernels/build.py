"""Compile the kernels (qmatmul.cc, attention.cc, logits.cc) on first use into a cache keyed by sources, compiler,
JAX headers and CPU.

Compiling on first use (not at install) keeps `pip install -e .` a pure-Python install that works
without a compiler: a machine with no g++ (or a failing build) logs why and runs XLA's dots instead.
The library is built once per (source, compiler, jaxlib, CPU features) and reused by every process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger("hkserve.kernels")
HERE = Path(__file__).parent
SOURCES = (HERE / "qmatmul.cc", HERE / "attention.cc", HERE / "logits.cc", HERE / "q4matmul.cc")  # one library
HEADERS = (
    HERE / "threads.h",
    HERE / "problem.h",
    HERE / "w8a16.h",
    HERE / "vexp.h",
    HERE / "quant8.h",
    HERE / "q4.h",
    HERE / "q4a16.h",
    HERE / "q8a16.h",
    HERE / "q5a16.h",
    HERE / "q5a8.h",
)
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-ffp-contract=off")


CACHE_ENV = (
    "HKSERVE_KERNEL_CACHE"  # the library cache's folder, default $HKSERVE_HOME/kernels: one several stores share
)


def cache_root() -> Path:
    shared = os.environ.get(CACHE_ENV)
    if shared:
        return Path(shared).expanduser().absolute()
    return Path(os.environ.get("HKSERVE_HOME", "~/.cache/hkserve")).expanduser().absolute() / "kernels"


def cpu_flags() -> str:
    """The CPU's feature flags (Linux), part of the cache key: a copied cache never runs on a CPU it
    was not built for."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [
        *(f.read_bytes() for f in SOURCES + HEADERS),
        version.encode(),
        " ".join(FLAGS).encode(),
        jaxlib.__version__.encode(),
    ]
    parts.append(cpu_flags().encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def library_path() -> Path | None:
    """Path of the compiled library, building it if needed; None (logged) when it cannot be built."""
    cxx = compiler()
    if cxx is None:
        log.warning("kernels: no C++ compiler found (set CXX): using XLA's dots")
        return None
    try:
        target = cache_root() / _key(cxx) / "libhkqmatmul.so"
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
        names = ", ".join(f.name for f in SOURCES)
        log.warning("kernels: compiling %s with %s into %s (once per source and CPU)", names, cxx, target.parent)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            out = Path(tmp) / target.name
            cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(out)]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode != 0:
                log.warning("kernels: compile failed, using XLA's dots:\n%s", done.stderr[-4000:])
                return None
            os.replace(out, target)  # atomic: concurrent builders each install a whole library
        return target
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("kernels: cannot build (%s): using XLA's dots", e)
        return None
