"""Same-process A/B of hk_w5sa16 (signed 5-bit groups, q5a16.h): this tree's kernel against a base
revision's (default f8aa954), over Gemma 3 270M's four 5-bit stacks (q, k, gate, up: 640 x 1024, 256,
2048, 2048; 18 layers read in place, as the model does, so at batch 1 the weights stream from memory).

The base library is compiled from `git show BASE:hkserve/kernels/...` into a temporary folder and its
HkW5SA16 registered as another FFI target, so old and new run in one process on the same operands. Each
round times both sides in turn (order swapped every round); the machine is shared, so only the per-round
ratios base / new mean anything: the script prints their median and spread (max / min) per case. The
default clock is the process's CPU time (with one kernel thread, time spent waiting for a core is not
counted); each side's figure is its minimum over `--calls` calls a round.

`--new w5sa8`: this tree's hk_w5sa8 (int8 activations, q5a8.h) against this tree's hk_w5sa16
instead (no base build); their outputs differ by the activations' quantization, so they are checked
close (relative L2 error < 2%), not equal.
Usage: python scripts/q5_kernel_ab.py [--base REV] [--new w5sa16|w5sa8] [--rounds N] [--calls N]
[--threads N] [--rows 1,16] [--isa avx2,avx512vnni] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels import build, ffi, pack4, q4ffi
from hkserve.model.int4 import Int5Sym, pack_high, pack_nibbles

SHAPES = [(640, 1024), (640, 256), (640, 2048), (640, 2048)]  # q, k, gate, up (K, N)
LAYERS = 18
BASE_TARGET = "hk_w5sa16_base"


def build_base(rev: str, out: Path) -> Path:
    """Compile the kernel library of revision `rev` into `out`; the .so's path."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    src = out / "kernels"
    src.mkdir()
    for f in (*build.SOURCES, *build.HEADERS):
        rel = f.relative_to(root).as_posix()
        (src / f.name).write_bytes(subprocess.check_output(["git", "show", f"{rev}:{rel}"], cwd=root))
    lib = out / "libbase.so"
    cmd = [build.compiler(), *build.FLAGS, f"-I{jax.ffi.include_dir()}", *(str(src / f.name) for f in build.SOURCES)]
    subprocess.run([*cmd, "-o", str(lib)], check=True)
    return lib


def stacks() -> list[tuple]:
    """Per stack, pack5's layer stack (random q over 0..31, float16 scales)."""
    rng = np.random.default_rng(0)
    out = []
    for k, n in SHAPES:
        layers = []
        for _ in range(LAYERS):
            q = rng.integers(0, 32, (k, n), dtype=np.uint8)
            scale = (rng.uniform(1e-4, 4e-3, (k // 32, n))).astype(np.float16)
            layers.append(pack4.pack5(*map(jnp.asarray, Int5Sym(pack_nibbles(q & 15), pack_high(q), scale))))
        out.append(tuple(jnp.stack(p) for p in zip(*layers)))
    return out


def step_fn(target: str, isa: int, threads: int):
    """One jitted call: every layer's four products on x [rows, 640]."""

    def body(layer, carry):
        x, acc, parts = carry
        for (_, n), (w, h, s) in zip(SHAPES, parts):
            call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
            y = call(x, w, h, s, layer, isa=np.int64(isa), threads=np.int64(threads))
            acc = acc + y[:, :1]
        return x, acc, parts

    @jax.jit
    def run(x, parts):
        return jax.lax.fori_loop(0, LAYERS, body, (x, jnp.zeros((x.shape[0], 1), jnp.float32), parts))[1]

    return run


def alternate(fns: dict, operands: tuple, rounds: int, calls: int, clock) -> tuple[dict, list]:
    """Time fns["base"] and fns["new"] on the same operands in turn, order swapped every round; each side's
    figure a round is its minimum over `calls` calls. → (each side's minimum over all rounds, the rounds'
    base / new ratios)"""
    best, ratios = dict.fromkeys(fns, float("inf")), []
    for r in range(rounds):
        this = {}
        for side in sorted(fns, reverse=r % 2 == 1):
            t = float("inf")
            for _ in range(calls):
                t0 = clock()
                jax.block_until_ready(fns[side](*operands))
                t = min(t, clock() - t0)
            this[side] = t
            best[side] = min(best[side], t)
        ratios.append(this["base"] / this["new"])
    return best, ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="f8aa954")
    ap.add_argument("--new", choices=sorted(q4ffi.INT5), default="w5sa16", help="w5sa8: against this tree's w5sa16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--isa", default="avx2,avx512vnni")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="cpu: the process's CPU time (1 thread)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    q4ffi.available()
    if args.new == "w5sa8":
        sides, what = {"base": q4ffi.SYM5[0], "new": q4ffi.INT5["w5sa8"][0]}, "base hk_w5sa16, new hk_w5sa8"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            lib = ctypes.cdll.LoadLibrary(str(build_base(args.base, Path(tmp))))
        jax.ffi.register_ffi_target(BASE_TARGET, jax.ffi.pycapsule(lib.HkW5SA16), platform="cpu")
        sides, what = {"base": BASE_TARGET, "new": q4ffi.SYM5[0]}, f"base {args.base}"
    names = {v: k for k, v in ffi.ISA_NAMES.items()}
    parts = stacks()
    print(f"{what}, {args.threads} thread(s), {args.clock} clock, load average before: {os.getloadavg()}")
    print("| ISA | rows | base ms (min) | new ms (min) | base / new: median | spread (max / min) | rounds |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for isa in (names[s] for s in args.isa.split(",")):
        if isa > ffi.cpu_isa():
            continue
        for rows in map(int, args.rows.split(",")):
            x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, 640), np.float32))
            fns = {side: step_fn(t, isa, args.threads) for side, t in sides.items()}
            outs = {side: np.asarray(fn(x, parts)) for side, fn in fns.items()}
            if args.new == "w5sa8":
                err = np.linalg.norm(outs["new"] - outs["base"]) / np.linalg.norm(outs["base"])
                assert err < 0.02, f"hk_w5sa8 is {err:.3g} off hk_w5sa16"
            else:
                assert np.array_equal(outs["base"], outs["new"]), "base and new differ"
            best, ratios = alternate(fns, (x, parts), args.rounds, args.calls, clock)
            print(
                f"| {ffi.ISA_NAMES[isa]} | {rows} | {best['base'] * 1e3:.3f} | {best['new'] * 1e3:.3f} | "
                f"{statistics.median(ratios):.3f} | {max(ratios) / min(ratios):.3f} | {len(ratios)} |",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
