"""Kernel-only time per token of Gemma 3 270M Q4_K_M's matrix products at batch 1, per tensor kind, on one
thread, both ISA paths: the int4 stack (attn_output), each 8-bit group stack and the tied head (int8 per
row, hk_w8a16), beside the bytes hkserve reads per token and the GGUF's own bytes for the same tensors.

Shapes and GGUF types come from the file; the weights are random values of the same packed formats (a
kernel's time does not depend on them). The machine is shared, so each figure is the minimum of many
calls. `--form min` times every 8-bit stack as Int8Group (hk_w8ga16, the store before issue 36's signed
groups); `--form sym` the Q4_0/Q5_0/Q8_0 stacks as Int8Sym (hk_w8sa16, `gemma3-270m-mix2`); the default,
`five`, as the import stores them now: stacks of Q5_0 only as Int5Sym (hk_w5sa16), the other Q4_0/Q5_0/Q8_0
ones as Int8Sym. Several forms (`--form sym,five --rounds 2`) alternate in one process, a table each.
Usage: python scripts/gemma3_kernel_profile.py [GGUF] [--repeats N] [--form F[,F...]] [--rounds N]
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from hkserve.checkpoint.gguf_quant import SYM8
from hkserve.kernels import ffi, pack, pack4, q4ffi
from hkserve.model.int4 import Int5Sym, Int8Sym, pack_high, pack_nibbles, quantize_int4, quantize_int8_groups

DEFAULT = "/root/.cache/hkserve-gemma3-270m/gemma-3-270m-q4_k_m.gguf"
INT4 = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q4_K}


def stacks(path: str) -> dict[str, dict]:
    """GGUF stack name → {shape (in, out), layers, gguf bytes, types} of the 2-D tensors."""
    out: dict[str, dict] = defaultdict(lambda: {"layers": 0, "gguf_bytes": 0, "types": set()})
    for t in gguf.GGUFReader(path).tensors:
        if len(t.shape) != 2:
            continue
        s = out[re.sub(r"^blk\.\d+\.", "", t.name)]
        s["shape"] = (int(t.shape[0]), int(t.shape[1]))  # GGUF dims: (in, out)
        s["layers"] += 1
        s["gguf_bytes"] += int(t.n_bytes)
        s["types"].add(t.tensor_type)
    return dict(out)


def timed(fn, args, repeats: int) -> float:
    """Minimum seconds of one call over `repeats` calls (after a warm-up)."""
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def operands(name: str, info: dict, form: str) -> tuple[str, tuple, int]:
    """(kernel, packed operands, bytes read per call) of one stack's layer (or the head)."""
    k, n = info["shape"]
    w = np.random.default_rng(0).standard_normal((k, n)).astype(np.float32) * 0.05
    if name == "token_embd.weight":  # the tied head [K=640, N=V]: int8 per row
        q = np.random.default_rng(1).integers(-127, 128, (n, k), dtype=np.int8)
        packed = pack.pack(jnp.asarray(q.T))
        return "w8a16", (packed, jnp.ones(n, jnp.float32)), packed.size + 4 * n
    if info["types"] <= INT4:
        parts = pack4.pack4(*map(jnp.asarray, quantize_int4(w)))
        kind = "w4a16"
    elif form == "five" and info["types"] == {gguf.GGMLQuantizationType.Q5_0}:
        q = np.random.default_rng(1).integers(0, 32, (k, n), dtype=np.uint8)
        w5 = Int5Sym(pack_nibbles(q & 15), pack_high(q), np.full((k // 32, n), 1e-3, np.float16))
        parts = pack4.pack5(*map(jnp.asarray, w5))
        kind = "w5sa16"
    elif form in ("sym", "five") and info["types"] <= set(SYM8):
        q = np.random.default_rng(1).integers(-128, 128, (k, n), dtype=np.int8)
        parts = pack4.pack8_sym(*map(jnp.asarray, Int8Sym(q, np.full((k // 32, n), 1e-3, np.float16))))
        kind = "w8sa16"
    else:
        parts = pack4.pack8(*map(jnp.asarray, quantize_int8_groups(w)))
        kind = q4ffi.EIGHT_BIT
    return kind, parts, sum(int(p.size * p.dtype.itemsize) for p in parts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", nargs="?", default=DEFAULT)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--form", default="five", help="five | sym | min, or several, comma-separated (alternated)")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    q4ffi.available()
    forms = args.form.split(",")
    if not set(forms) <= {"five", "sym", "min"}:
        ap.error("--form takes five, sym, min")
    for r in range(args.rounds):
        for form in forms:
            print(f"\nround {r + 1}, --form {form}")
            table(args.gguf, form, args.repeats)


def table(path: str, form: str, repeats: int) -> None:
    """One form's table: per stack its kernel, bytes a token and kernel-only ms a token per ISA path."""
    isas = [i for i in (2, 1) if i <= ffi.cpu_isa()]
    print(
        "| tensor (GGUF types) | K x N | layers | kernel | GGUF MB/token | hkserve MB/token | "
        + " | ".join(f"{ffi.ISA_NAMES[i]} ms/token" for i in isas)
        + " |"
    )
    print("|---|---|---|---|---|---|" + "---|" * len(isas))
    totals = defaultdict(float)
    for name, info in sorted(stacks(path).items(), key=lambda kv: kv[0]):
        kind, parts, nbytes = operands(name, info, form)
        k, n = info["shape"]
        x = jnp.asarray(np.random.default_rng(2).standard_normal((1, k)).astype(np.float32))
        times = []
        for isa in isas:
            if kind == "w8a16":
                fn = jax.jit(lambda x, w, s, isa=isa: ffi.matmul(x, w, s, "w8a16", isa, threads=1))
            elif kind == "w5sa16":
                fn = jax.jit(lambda x, w, h, s, isa=isa, n=n: q4ffi.matmul_int5_sym(x, w, h, s, n, isa, 1))
            elif kind == "w8sa16":
                fn = jax.jit(lambda x, w, s, isa=isa, n=n: q4ffi.matmul_int8_sym(x, w, s, n, isa, 1))
            else:
                fn = jax.jit(lambda x, w, s, m, isa=isa, kind=kind, n=n: q4ffi.matmul_int4(x, w, s, m, n, kind, isa, 1))
            sec = timed(fn, (x, *parts), repeats) * info["layers"]
            times.append(sec * 1e3)
            totals[isa] += sec * 1e3
        hk_mb, gguf_mb = nbytes * info["layers"] / 1e6, info["gguf_bytes"] / 1e6
        totals["hk"] += hk_mb
        totals["gguf"] += gguf_mb
        types = "/".join(sorted(t.name for t in info["types"]))
        cells = " | ".join(f"{t:.3f}" for t in times)
        print(f"| {name} ({types}) | {k} x {n} | {info['layers']} | {kind} | {gguf_mb:.1f} | {hk_mb:.1f} | {cells} |")
    cells = " | ".join(f"{totals[i]:.3f}" for i in isas)
    print(f"| total | | | | {totals['gguf']:.1f} | {totals['hk']:.1f} | {cells} |")


if __name__ == "__main__":
    main()
