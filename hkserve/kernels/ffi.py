"""Load the compiled kernels, register them with XLA's FFI, and call them from jitted code."""

from __future__ import annotations

import ctypes
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.kernels.build import library_path

log = logging.getLogger("hkserve.kernels")
ISA_NAMES = {2: "avx512vnni", 1: "avx2"}  # the kernels' isa attribute → name; 0: none of them
TARGETS = {"w8a8": ("hk_w8a8", "HkW8A8"), "w8a16": ("hk_w8a16", "HkW8A16"), "w8a32": ("hk_w8a32", "HkW8A32")}
ATTENTION = ("hk_decode_attention", "HkDecodeAttention")  # a float32 KV memory
ATTENTION_BF16 = ("hk_decode_attention_bf16", "HkDecodeAttentionBf16")  # a bfloat16 one (--kv-dtype bf16)
LOGIT_STATS = ("hk_logit_stats", "HkLogitStats")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The kernel library with its targets registered for the CPU platform; None when unavailable."""
    path = library_path()
    if path is None:
        return None
    lib = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in (*TARGETS.values(), ATTENTION, ATTENTION_BF16, LOGIT_STATS):
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return lib


@functools.cache
def cpu_isa() -> int:
    """What this CPU runs: 2 AVX-512 VNNI, 1 AVX2 + FMA, 0 neither (or no library)."""
    lib = library()
    return int(lib.hk_cpu_isa()) if lib is not None else 0


def set_thread_cap(cap: int) -> None:
    """Cap the threads of kernel calls that leave their count to XLA's pool (0: no cap)."""
    lib = library()
    if lib is not None:
        lib.hk_set_thread_cap(ctypes.c_int(cap))


def thread_cap() -> int:
    lib = library()
    return int(lib.hk_thread_cap()) if lib is not None else 0


def matmul(
    x: jax.Array,
    packed: jax.Array,
    scale: jax.Array,
    kind: str,
    isa: int,
    threads: int = 0,
    layer: jax.Array | None = None,
) -> jax.Array:
    """x [..., K] float32 · packed int8 weight (pack.py) [N/64, K/4, 64, 4] → [..., N] float32, scaled
    per output channel. kind "w8a16" quantizes x to int16 per 128 values (the default); "w8a8" to int8
    per 32 values; "w8a32" keeps x float32.

    With `layer` (an int32 scalar, e.g. a layer scan's index) `packed` [L, N/64, K/4, 64, 4] and
    `scale` [L, N] are a whole layer stack, and the kernel reads layer `layer` in place."""
    if library() is None or isa > cpu_isa() or isa not in ISA_NAMES:
        raise RuntimeError(f"kernel isa {isa} is not available on this machine (has {cpu_isa()})")
    if (packed.ndim == 5) != (layer is not None):
        raise ValueError("a layer index goes with a stacked [L, ...] packed weight, and only with one")
    n = scale.shape[-1]
    rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    call = jax.ffi.ffi_call(TARGETS[kind][0], jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))
    y = call(rows, packed, scale.astype(jnp.float32), index, isa=np.int64(isa), threads=np.int64(threads))
    return y.reshape(*x.shape[:-1], n)


def decode_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_memory: jax.Array,
    v_memory: jax.Array,
    layer: jax.Array,
    past_len: jax.Array,
    window: jax.Array,
    cap: float = 0.0,
    threads: int = 0,
    table: jax.Array | None = None,
) -> jax.Array:
    """Attention of one new token per row (kernels/attention.cc): q [B, Hkv, G, D] (rotated and scaled),
    the new token's k_new/v_new [B, Hkv, D] (float32), and the float32 or bfloat16 memory [L, B, S, Hkv, D]
    (bf16 read as stored, widened in registers) of which layer `layer` is read in place, positions
    < past_len [B] (within `window` if > 0) → [B, Hkv, G, D].
    With `table` [B, MB] int32 the memory is a paged pool [L, NB, bs, Hkv, D] and row b's position s
    lies in block table[b, s // bs] (model/paged_memory.py)."""
    if library() is None:
        raise RuntimeError("the kernel library is not available on this machine")
    targets = {jnp.dtype(jnp.float32): ATTENTION[0], jnp.dtype(jnp.bfloat16): ATTENTION_BF16[0]}
    if k_memory.dtype not in targets or v_memory.dtype != k_memory.dtype:
        raise ValueError(
            f"decode attention reads a float32 or bfloat16 KV memory, got {k_memory.dtype}/{v_memory.dtype}"
        )
    call = jax.ffi.ffi_call(targets[k_memory.dtype], jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    blocks = jnp.zeros((q.shape[0], 0), jnp.int32) if table is None else i32(table)  # [B, 0]: the static memory
    return call(
        q.astype(jnp.float32),
        k_new.astype(jnp.float32),
        v_new.astype(jnp.float32),
        k_memory,
        v_memory,
        blocks,
        i32(layer),
        i32(past_len),
        i32(window),
        cap=np.float32(cap),
        threads=np.int64(threads),
    )


def logit_stats(
    x: jax.Array, bias: jax.Array, threads: int = 0, chunk: int = 256
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """What sampling reads of whole vocabulary rows (kernels/logits.cc), x and bias [B, V] float32 →
    (row_max [B] float32, log_total [B] float32: log sum exp(x - row_max), greedy [B] int32: the first
    index of the largest x + bias, chunk_max [B, ceil(V / chunk)] float32: the largest x of each `chunk`
    values, sampling.top_k's first stage); a row with a NaN gives NaN, NaN and V - 1 (and NaN for each
    chunk holding one). chunk: a multiple of 8."""
    if library() is None:
        raise RuntimeError("the kernel library is not available on this machine")
    b, v = x.shape
    call = jax.ffi.ffi_call(
        LOGIT_STATS[0],
        (
            jax.ShapeDtypeStruct((b,), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.float32),
            jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, -(-v // chunk)), jnp.float32),
        ),
    )
    return call(x.astype(jnp.float32), bias.astype(jnp.float32), chunk=np.int64(chunk), threads=np.int64(threads))
