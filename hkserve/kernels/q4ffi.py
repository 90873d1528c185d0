"""The int4 kernels (q4matmul.cc) from jitted code: hk_w4a16 (activations int16 per 128 values) and
hk_w4a8 (int8 per 32), registered with XLA's FFI next to the int8 targets, from the same library
(ffi.library)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels import ffi

TARGETS = {"w4a16": ("hk_w4a16", "HkW4A16"), "w4a8": ("hk_w4a8", "HkW4A8"), "w8ga16": ("hk_w8ga16", "HkW8GA16")}
EIGHT_BIT = "w8ga16"  # 8-bit groups (pack4.pack8) times int16 activations: the packed weight's last dim 2048
SYM = ("hk_w8sa16", "HkW8SA16")  # signed 8-bit groups, float16 scale, no min (pack4.pack8_sym)
SYM5 = ("hk_w5sa16", "HkW5SA16")  # signed 5-bit groups, float16 scale, no min (pack4.pack5)
INT5 = {"w5sa16": SYM5, "w5sa8": ("hk_w5sa8", "HkW5SA8")}  # the 5-bit kernels: int16 or int8 activations


@functools.cache
def available() -> bool:
    lib = ffi.library()
    if lib is None:
        return False
    for target, symbol in (*TARGETS.values(), SYM, *INT5.values()):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True


def kind_for(packed: jax.Array, int4_kind: str) -> str:
    """The kernel of a packed grouped weight: hk_w8ga16 for 8-bit groups, else the int4 kind chosen."""
    return EIGHT_BIT if packed.shape[-1] == 2048 else int4_kind


def matmul_int4(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    mins: jax.Array,
    n: int,
    kind: str,
    isa: int,
    threads: int = 0,
    layer: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] float32 · packed int4 weight (pack4.py) → [..., n] float32; kind "w4a16" quantizes x
    per row to int16 in blocks of 128, "w4a8" to int8 in blocks of 32 (the weight's groups); "w8ga16":
    a packed 8-bit group weight (pack4.pack8), x as "w4a16" quantizes it; `kind_for` picks it. With
    `layer`, `packed`, `scale` and `mins` are a layer stack [L, ...] and the kernel reads layer `layer`
    in place."""
    if kind not in TARGETS:
        raise ValueError(f"int4 kernel must be one of {sorted(TARGETS)}, got {kind!r}")
    return _call(TARGETS[kind][0], x, (packed, scale, mins), n, isa, threads, layer)


def matmul_int8_sym(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    n: int,
    isa: int,
    threads: int = 0,
    layer: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] float32 · a packed signed 8-bit group weight (pack4.pack8_sym: uint8 [(L,) N/64, K/32,
    2048], float16 scale [(L,) N/64, K/32, 64]) → [..., n] float32 through hk_w8sa16, x quantized per row
    to int16 in blocks of 128 (as "w4a16"); with `layer`, a layer stack read at that layer in place."""
    return _call(SYM[0], x, (packed, scale.astype(jnp.float16)), n, isa, threads, layer)


def matmul_int5_sym(
    x: jax.Array,
    packed: jax.Array,
    high: jax.Array,
    scale: jax.Array,
    n: int,
    isa: int,
    threads: int = 0,
    layer: jax.Array | None = None,
    kind: str = "w5sa16",
) -> jax.Array:
    """x [..., K] float32 · a packed signed 5-bit group weight (pack4.pack5: nibbles uint8 [(L,) N/64, K/32,
    1024], high bits uint8 [(L,) N/64, K/32, 256], float16 scale [(L,) N/64, K/32, 64]) → [..., n] float32
    through hk_w5sa16, x quantized per row to int16 in blocks of 128 (as "w4a16"), or kind "w5sa8":
    hk_w5sa8, x quantized to int8 per 32 (as "w4a8"); with `layer`, a layer stack read at that
    layer in place."""
    if kind not in INT5:
        raise ValueError(f"5-bit kernel must be one of {sorted(INT5)}, got {kind!r}")
    return _call(INT5[kind][0], x, (packed, high, scale.astype(jnp.float16)), n, isa, threads, layer)


def _call(target: str, x: jax.Array, weight: tuple, n: int, isa: int, threads: int, layer) -> jax.Array:
    """One grouped kernel's FFI call on x's rows; `weight`: the packed weight's operands."""
    if not available() or isa > ffi.cpu_isa() or isa not in ffi.ISA_NAMES:
        raise RuntimeError(f"kernel isa {isa} is not available on this machine (has {ffi.cpu_isa()})")
    if (weight[0].ndim == 4) != (layer is not None):
        raise ValueError("a layer index goes with a stacked [L, ...] packed weight, and only with one")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    y = call(rows, *weight, index, isa=np.int64(isa), threads=np.int64(threads))
    return y.reshape(*x.shape[:-1], n)
