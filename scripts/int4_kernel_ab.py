"""Kernel-only A/B of the int4 and int8 matrix products at 1 and 16 rows (issue 36: int4 at 16 rows
>= 1.2x int8): hk_w4a16 vs hk_w4a8 vs hk_w8a16 over a model's decoder layers (fused q/k/v, o, fused
gate/up, down; random weights of the packed formats, layer stacks read in place as the model does).

One jitted call runs every layer's products; each kernel is timed in turn within a round (the machine
is shared: alternate, take the minimum, read ratios). Usage:
  python scripts/int4_kernel_ab.py [--rounds N] [--calls N] [--threads N] [--isa avx512vnni,avx2]
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels import ffi, pack, pack4, q4ffi
from hkserve.model.int4 import quantize_int4

# (K, N) of one decoder layer's products (q/k/v and gate/up fused as the model runs them), and layers.
MODELS = {
    "smollm2-135m": ([(576, 960), (576, 576), (576, 3072), (1536, 576)], 30),
    "gemma3-270m": ([(640, 1536), (1024, 640), (640, 4096), (2048, 640)], 18),
}
KERNELS = ("w8a16", "w4a16", "w4a8")


def stacks(shapes, layers: int, kernel: str) -> list[tuple]:
    """Per product, the packed layer stack of `kernel`'s weight format (random values)."""
    rng = np.random.default_rng(0)
    out = []
    for k, n in shapes:
        if kernel == "w8a16":
            q = rng.integers(-127, 128, (layers, k, n), dtype=np.int8)
            out.append((pack.pack(jnp.asarray(q)), jnp.asarray(rng.random((layers, n), np.float32) * 1e-3)))
        else:
            w = rng.standard_normal((layers, k, n)).astype(np.float32) * 0.05
            out.append(pack4.pack4(*map(jnp.asarray, quantize_int4(w))))
    return out


def step_fn(shapes, layers: int, kernel: str, isa: int, threads: int):
    """One jitted call: every layer's products on x [rows, K_max], layer `layer` read in place."""

    def body(layer, carry):
        x, acc, parts = carry
        for (k, n), part in zip(shapes, parts):
            if kernel == "w8a16":
                y = ffi.matmul(x[:, :k], *part, "w8a16", isa, threads, layer=layer)
            else:
                y = q4ffi.matmul_int4(x[:, :k], *part, n, kernel, isa, threads, layer=layer)
            acc = acc + y[:, :1]
        return x, acc, parts

    @jax.jit
    def run(x, parts):
        return jax.lax.fori_loop(0, layers, body, (x, jnp.zeros((x.shape[0], 1), jnp.float32), parts))[1]

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--isa", default="avx512vnni,avx2")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="cpu: the process's CPU time (one thread)")
    args = ap.parse_args()
    q4ffi.available()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    names = {v: k for k, v in ffi.ISA_NAMES.items()}
    isas = [names[s] for s in args.isa.split(",") if names[s] <= ffi.cpu_isa()]
    print(f"load average before: {os.getloadavg()}")
    print("| model | ISA | rows | w8a16 ms | w4a16 ms | w4a8 ms | w8a16 / w4a16 | w8a16 / w4a8 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        shapes, layers = MODELS[model]
        weights = {kernel: stacks(shapes, layers, kernel) for kernel in KERNELS}
        for isa in isas:
            for rows in map(int, args.rows.split(",")):
                x = jnp.asarray(np.random.default_rng(1).standard_normal((rows, max(k for k, _ in shapes)), np.float32))
                fns = {kernel: step_fn(shapes, layers, kernel, isa, args.threads) for kernel in KERNELS}
                for kernel in KERNELS:
                    jax.block_until_ready(fns[kernel](x, weights[kernel]))
                best = dict.fromkeys(KERNELS, float("inf"))
                for _ in range(args.rounds):
                    for kernel in KERNELS:
                        for _ in range(args.calls):
                            t0 = clock()
                            jax.block_until_ready(fns[kernel](x, weights[kernel]))
                            best[kernel] = min(best[kernel], clock() - t0)
                ms = {kernel: best[kernel] * 1e3 for kernel in KERNELS}
                print(
                    f"| {model} | {ffi.ISA_NAMES[isa]} | {rows} | {ms['w8a16']:.2f} | {ms['w4a16']:.2f} | "
                    f"{ms['w4a8']:.2f} | {ms['w8a16'] / ms['w4a16']:.2f} | {ms['w8a16'] / ms['w4a8']:.2f} |",
                    flush=True,
                )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
