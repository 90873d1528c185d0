"""Quantized weights on an accelerator: how XLA runs x · W for int8 and int4 weights, in one run
(scripts/device-check.sh, stage quant-weights). Today's formulation (hkserve.model: int8 widened to
float32 in the dot, the scale after it; int4 groups dequantized to float32 in the dot's prologue) beside
the same weights dequantized to bfloat16, jnp.int4 weights and the Pallas kernel (model/int4_pallas.py;
interpreted on a CPU), against bf16 dense weights, at 1, 16
and 64 rows. `--layers` different matrices per call, so the weights stream from memory rather than sit
in the L2 cache; each call sums the products so that none is dropped. Prints ms per matrix and the
bytes of weights read per second, each form's error against the float32 product of the unquantized
weights (quantization included), and writes them as JSON.

usage: python scripts/device_quant_dot.py --out JSON [--k 2048 --n 8192 --layers 16 --rows 1,16,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.model.int4 import GROUP, grouped_dot, quantize_int4
from hkserve.model.int4_pallas import int4_matmul
from hkserve.model.layers import qdot

BF16, F32 = jnp.bfloat16, jnp.float32


def _per_input(a: jax.Array) -> jax.Array:  # [G, N] → [G * 32, N]
    return jnp.repeat(a, GROUP, axis=0)


def int4_bf16(x, w):
    """int4 groups dequantized to bfloat16 in the dot's prologue."""
    n = w.nibbles.shape[-1]
    nib = w.nibbles.reshape(-1, GROUP // 2, n)  # [K/32, 16, N]: byte i of group g holds inputs 32g + i, 32g + 16 + i
    q = jnp.stack([nib & 15, nib >> 4], axis=1).reshape(-1, n).astype(BF16)  # [K, N]
    dense = q * _per_input(w.scale.astype(BF16)) + _per_input(w.min.astype(BF16))
    return jnp.dot(x.astype(BF16), dense, preferred_element_type=F32)


def s4_bf16(x, w):
    """jnp.int4 weights [K, N] (q - 8) with a bfloat16 scale per group and no min: XLA's own int4 type."""
    q, scale = w
    return jnp.dot(x.astype(BF16), q.astype(BF16) * _per_input(scale), preferred_element_type=F32)


MAKERS = {  # weight format → maker from a float32 [K, N] numpy matrix
    "bf16": lambda w: jnp.asarray(w, BF16),
    "int8": lambda w: _int8(w),
    "int4": lambda w: jax.tree.map(jnp.asarray, quantize_int4(w)),
    "s4": lambda w: _s4(w),
}
FORMS = {  # name → (weight format, product)
    "bf16 dense": ("bf16", lambda x, w: jnp.dot(x.astype(BF16), w, preferred_element_type=F32)),
    "int8 as today (f32 dot)": ("int8", lambda x, w: qdot(x, *w)),
    "int8 bf16 dot": (
        "int8",
        lambda x, w: jnp.dot(x.astype(BF16), w[0].astype(BF16), preferred_element_type=F32) * w[1],
    ),
    "int4 as today (f32 prologue)": ("int4", grouped_dot),
    "int4 bf16 prologue": ("int4", int4_bf16),
    "jnp.int4 bf16 prologue": ("s4", s4_bf16),
    "int4 groups, Pallas kernel": ("int4", lambda x, w: int4_matmul(x, *w, interpret=jax.default_backend() == "cpu")),
}


def _int8(w: np.ndarray):
    scale = np.abs(w).max(axis=0) / 127
    return jnp.asarray(np.rint(w / scale).astype(np.int8)), jnp.asarray(scale, F32)


def _s4(w: np.ndarray):
    g = w.reshape(-1, GROUP, w.shape[-1])
    scale = np.abs(g).max(axis=1) / 7
    q = np.clip(np.rint(g / scale[:, None]), -8, 7).reshape(w.shape)
    return jnp.asarray(q, jnp.int4), jnp.asarray(scale, BF16)


def nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize if a.dtype != jnp.int4 else a.size // 2 for a in jax.tree.leaves(tree))


def time_form(product, weights, x, iters: int, repeats: int) -> float:
    """Median seconds of one call over all matrices."""
    fn = jax.jit(lambda x, ws: sum(product(x, w) for w in ws))
    fn(x, weights).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            y = fn(x, weights)
        y.block_until_ready()
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=2048)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    floats = [rng.standard_normal((args.k, args.n), np.float32) * 0.02 for _ in range(args.layers)]
    report = {"device": str(jax.devices()[0].device_kind), "k": args.k, "n": args.n, "layers": args.layers, "forms": {}}
    print(f"quantized x·W on {report['device']}: {args.layers} matrices [{args.k}, {args.n}] a call", flush=True)
    made = {}
    for name, (form, product) in FORMS.items():
        try:
            if form not in made:
                made.clear()  # one format on the device at a time
                made[form] = [MAKERS[form](w) for w in floats]
            weights = made[form]
            size = nbytes(weights)
            x = rng.standard_normal((4, args.k)).astype(np.float32)
            exact = x @ floats[0]
            error = float(np.abs(np.asarray(product(jnp.asarray(x), weights[0])) - exact).max() / np.abs(exact).max())
            entry = {"weight_bytes": size, "error_vs_float32": error, "rows": {}}
            print(f"  {name:<30} |x·W - float32 x·W| <= {error:.2e} of the largest", flush=True)
            for rows in (int(r) for r in args.rows.split(",")):
                x = jnp.asarray(rng.standard_normal((rows, args.k)), F32)
                seconds = time_form(product, weights, x, args.iters, args.repeats)
                ms, gb_s = 1e3 * seconds / args.layers, size / seconds / 1e9
                entry["rows"][str(rows)] = {"ms_per_matrix": ms, "gb_s": gb_s}
                print(f"  {name:<30} {rows:>3} rows: {ms:.4f} ms a matrix, {gb_s:.0f} GB/s of weights", flush=True)
        except Exception as e:  # one formulation XLA cannot compile here must not hide the others
            entry = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(f"  {name}: FAILED {entry['error']}", flush=True)
        report["forms"][name] = entry
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
