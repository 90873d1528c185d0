"""Same-process A/B of hk_w8a16 on Gemma 3 270M's tied head at batch 1 (issue 36): [rows, 640] times the
262,144 x 640 int8 weight (168 MB, streamed from memory every call), this tree's kernel against a base
revision's (default b1b386d), on XLA's thread pool as the engine calls it (threads 0: the pool's).

The base library is compiled from `git show BASE:...` (q5_kernel_ab.build_base; its alternating rounds
too) and its HkW8A16 registered as another FFI target; both sides read the same packed weight. Each round
times both sides in turn, order swapped every round; the machine is shared, so only the per-round ratios
base / new mean anything: their median and spread (max / min) per case, and each side's minimum wall time
(with GB/s of weight read). Outputs are checked equal bit for bit (the change must only move where the
work runs).
Usage: python scripts/head_ab.py [--base REV] [--rounds N] [--calls N] [--rows 1] [--isa avx2,avx512vnni]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from q5_kernel_ab import alternate, build_base

from hkserve.kernels import ffi

K, N = 640, 262144  # Gemma 3 270M's tied embedding / head
BASE_TARGET = "hk_w8a16_base"


def head_fn(target: str, isa: int, n: int):
    """One jitted head product: x [rows, K] · w → [rows, n], as the engine's step calls it."""

    @jax.jit
    def run(x, w, scale):
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
        return call(x, w, scale, jnp.int32(0), isa=np.int64(isa), threads=np.int64(0))

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="b1b386d")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--rows", default="1")
    ap.add_argument("--n", type=int, default=N, help="output columns (a multiple of 64)")
    ap.add_argument("--isa", default="avx2,avx512vnni")
    args = ap.parse_args()
    ffi.library()
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.cdll.LoadLibrary(str(build_base(args.base, Path(tmp))))
    jax.ffi.register_ffi_target(BASE_TARGET, jax.ffi.pycapsule(lib.HkW8A16), platform="cpu")
    sides = {"base": BASE_TARGET, "new": ffi.TARGETS["w8a16"][0]}
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.integers(0, 256, (args.n // 64, K // 4, 64, 4), dtype=np.uint8))
    scale = jnp.asarray(rng.uniform(1e-3, 2e-2, args.n).astype(np.float32))
    names = {v: k for k, v in ffi.ISA_NAMES.items()}
    print(f"base {args.base}, head {args.n} x {K}, load average before: {os.getloadavg()}")
    print("| ISA | rows | base ms (min) | new ms (min) | GB/s base / new | base / new: median | spread | rounds |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    isas = [names[s] for s in args.isa.split(",") if names[s] <= ffi.cpu_isa()]
    for isa, rows in ((isa, rows) for isa in isas for rows in map(int, args.rows.split(","))):
        x = jnp.asarray(rng.standard_normal((rows, K), np.float32))
        fns = {side: head_fn(t, isa, args.n) for side, t in sides.items()}
        base, new = (np.asarray(fn(x, w, scale)) for fn in fns.values())
        assert np.array_equal(base, new), "base and new differ"
        best, ratios = alternate(fns, (x, w, scale), args.rounds, args.calls, time.perf_counter)
        gbs = " / ".join(f"{w.size / best[s] / 1e9:.1f}" for s in ("base", "new"))
        print(
            f"| {ffi.ISA_NAMES[isa]} | {rows} | {best['base'] * 1e3:.3f} | {best['new'] * 1e3:.3f} | {gbs} | "
            f"{statistics.median(ratios):.3f} | {max(ratios) / min(ratios):.3f} | {len(ratios)} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
