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


@functools.cache
def available() -> bool:
    lib = ffi.library()
    if lib is None:
        return False
    for target, symbol in TARGETS.values():
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
    if not available() or isa > ffi.cpu_isa() or isa not in ffi.ISA_NAMES:
        raise RuntimeError(f"kernel isa {isa} is not available on this machine (has {ffi.cpu_isa()})")
    if (packed.ndim == 4) != (layer is not None):
        raise ValueError("a layer index goes with a stacked [L, ...] packed weight, and only with one")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    call = jax.ffi.ffi_call(TARGETS[kind][0], jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    y = call(rows, packed, scale, mins, index, isa=np.int64(isa), threads=np.int64(threads))
    return y.reshape(*x.shape[:-1], n)
