"""x · an int4 weight as a Pallas kernel: the GPU path that reads the nibbles and group params once, in the
product's inner loop (on an H200, XLA ran the nibble-packed form at ~200 GB/s, 3.2x slower than bf16
weights: docs/benchmarks.md, "fourth GPU run").

One program per (column tile, share of the groups): it walks its groups of 32 inputs, unpacks each
group's 16 bytes [16, BN] into the low and high nibbles (inputs 32g + i and 32g + 16 + i: int4.py's
order), dequantizes them with the group's scale and min, and adds the two [Mp, 16] x [16, BN] products
(Triton's dot takes at least 16 rows, so the rows are padded to 16). The shares' partial sums are added
in plain JAX: at batch 1 the column tiles alone are too few programs for a GPU's SMs. The same kernel
runs under Triton on a GPU and in Pallas's interpreter on a CPU (`interpret=True`, the tests).
"""

from __future__ import annotations

import functools
import logging
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

log = logging.getLogger("hkserve.model")
KERNEL_ENV = "HKSERVE_INT4_MATMUL"
KERNEL_CHOICES = ("auto", "pallas", "xla", "interpret")
F32 = jnp.float32
GROUP = 32  # int4.py's group of inputs
MIN_ROWS = 16  # Triton's dot takes at least 16 rows
TILES = (128, 64, 32, 16)  # column tiles tried, widest first: Triton's blocks are powers of two
PROGRAMS = 512  # aim: column tiles x shares of the groups, enough programs for a GPU's SMs at batch 1


def column_tile(n: int) -> int | None:
    """The widest tile of TILES that divides the weight's N, or None (the kernel cannot take it)."""
    return next((t for t in TILES if n % t == 0), None)


def unsupported(nibbles_shape: tuple[int, ...]) -> str | None:
    """Why the kernel cannot take an int4 weight of this nibbles shape [K_pad/2, N], or None."""
    if len(nibbles_shape) != 2:
        return f"a stacked weight {nibbles_shape} (the kernel takes one [K/2, N] matrix)"
    if column_tile(nibbles_shape[1]) is None:
        return f"N = {nibbles_shape[1]} is not a multiple of {TILES[-1]}"
    return None


def kernel_choice(nibbles_shape: tuple[int, ...]) -> str | None:
    """How an int4 linear runs when the CPU kernels do not: "pallas" (this kernel under Triton),
    "interpret" (in Pallas's interpreter: the tests' way on a CPU) or None, XLA's dequantizing dot
    (int4.grouped_dot). HKSERVE_INT4_MATMUL=auto|pallas|xla|interpret chooses, read when traced. auto is
    XLA's dot until the device check (stage quant-weights) has timed the kernel on a GPU; a weight the
    kernel cannot take, or a mesh of several devices (no sharding rule), falls back with a log line."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    if choice in ("auto", "xla"):
        return None
    if choice == "pallas" and jax.default_backend() != "gpu":
        raise ValueError(f"{KERNEL_ENV}=pallas needs a GPU backend, this is {jax.default_backend()}")
    reason = unsupported(nibbles_shape)
    if reason is None and jax.device_count() > 1:
        reason = f"a mesh of {jax.device_count()} devices (it runs on one)"
    if reason is not None:
        log.warning("int4 linear: XLA's dot, not the Pallas kernel: %s", reason)
        return None
    return choice


def _kernel(x_ref, w_ref, scale_ref, min_ref, out_ref, *, per: int, groups: int, tile: int, dtype):
    """One (column tile, share): x_ref [Mp, K_pad], w_ref [K_pad/2, N] uint8 and scale/min [G, N] whole
    (their K sides need not be powers of two), read at the tile's columns; out_ref [Mp, tile]."""
    cols = pl.ds(pl.program_id(0) * tile, tile)
    share = pl.program_id(1)
    lo, hi = share * per, jnp.minimum((share + 1) * per, groups)

    def group(g, acc):
        nibbles = w_ref[pl.ds(g * (GROUP // 2), GROUP // 2), cols].astype(jnp.int32)  # [16, tile]
        scale, low = scale_ref[pl.ds(g, 1), cols], min_ref[pl.ds(g, 1), cols]  # [1, tile]
        first = ((nibbles & 15).astype(F32) * scale + low).astype(dtype)  # inputs 32g .. 32g + 15
        second = ((nibbles >> 4).astype(F32) * scale + low).astype(dtype)  # inputs 32g + 16 .. 32g + 31
        x_first = x_ref[:, pl.ds(g * GROUP, GROUP // 2)].astype(dtype)  # [Mp, 16]
        x_second = x_ref[:, pl.ds(g * GROUP + GROUP // 2, GROUP // 2)].astype(dtype)
        return acc + plgpu.dot(x_first, first) + plgpu.dot(x_second, second)

    out_ref[...] = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), group, jnp.zeros(out_ref.shape, F32))


@functools.partial(jax.jit, static_argnames=("dtype", "interpret"))
def int4_matmul(
    x: jax.Array, nibbles: jax.Array, scale: jax.Array, low: jax.Array, *, dtype=jnp.bfloat16, interpret=False
):
    """x [..., K] · the int4 weight (nibbles [K_pad/2, N] uint8, scale and min [K_pad/32, N] float32) →
    [..., N] float32; the dequantized weights and x meet in the dot as `dtype`, accumulated in float32."""
    k_pad, n = 2 * nibbles.shape[0], nibbles.shape[1]
    groups, tile = k_pad // GROUP, column_tile(n)
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).astype(F32)
    rows = flat.shape[0]
    padded_rows = max(MIN_ROWS, 1 << (rows - 1).bit_length())
    flat = jnp.pad(flat, ((0, padded_rows - rows), (0, k_pad - flat.shape[1])))
    shares = max(1, min(groups, PROGRAMS // (n // tile)))
    per = -(-groups // shares)
    shares = -(-groups // per)  # no share left empty
    parts = pl.pallas_call(
        functools.partial(_kernel, per=per, groups=groups, tile=tile, dtype=dtype),
        grid=(n // tile, shares),
        in_specs=[pl.BlockSpec()] * 4,  # whole: the kernel reads its tile's columns group by group
        out_specs=pl.BlockSpec((None, padded_rows, tile), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((shares, padded_rows, n), F32),
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="hk_int4_matmul",
    )(flat, nibbles, scale, low)
    return parts.sum(axis=0)[:rows].reshape(*lead, n)
