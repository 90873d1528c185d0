"""hk_w4a8 (q4matmul.cc) from jitted code: registered with XLA's FFI next to the int8 targets, from the
same library (ffi.library)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels import ffi

TARGET = ("hk_w4a8", "HkW4A8")


@functools.cache
def available() -> bool:
    lib = ffi.library()
    if lib is None:
        return False
    jax.ffi.register_ffi_target(TARGET[0], jax.ffi.pycapsule(getattr(lib, TARGET[1])), platform="cpu")
    return True


def matmul_w4a8(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    mins: jax.Array,
    n: int,
    isa: int,
    threads: int = 0,
    layer: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] float32 · packed int4 weight (pack4.py) → [..., n] float32; x is quantized per row
    to int8 in blocks of 32 (the weight's groups). With `layer`, `packed`, `scale` and `mins` are a
    layer stack [L, ...] and the kernel reads layer `layer` in place."""
    if not available() or isa > ffi.cpu_isa() or isa not in ffi.ISA_NAMES:
        raise RuntimeError(f"kernel isa {isa} is not available on this machine (has {ffi.cpu_isa()})")
    if (packed.ndim == 4) != (layer is not None):
        raise ValueError("a layer index goes with a stacked [L, ...] packed weight, and only with one")
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    call = jax.ffi.ffi_call(TARGET[0], jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    y = call(rows, packed, scale, mins, index, isa=np.int64(isa), threads=np.int64(threads))
    return y.reshape(*x.shape[:-1], n)
