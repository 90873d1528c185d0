"""Grouped low-bit weights: int4 with a float32 scale and min per group of 32 inputs (what GGUF's 4-bit
blocks map into exactly), 8-bit groups of the same form (what every other GGUF block type of up to 8
bits maps into: Q5_0/Q5_1/Q5_K/Q8_0 exactly, Q6_K by a documented requantization), and signed 8-bit
groups without a min (`Int8Sym`: what GGUF's min-less Q4_0/Q5_0/Q8_0 blocks map into exactly, at 1.0625
bytes a weight instead of 1.25), and signed 5-bit groups (`Int5Sym`: GGUF's Q5_0 blocks exactly, at their own
0.6875 bytes a weight).

A weight [K, N] (stored [in, out], like every linear weight) is, per output column and group of 32
consecutive inputs g, w[k, n] = scale[g, n] * q[k, n] + min[g, n], q in 0..15. The store keeps q as
nibbles, two inputs a byte: byte 16g + i holds input 32g + i in its low nibble and 32g + 16 + i in its
high one (llama.cpp's order inside a Q4 block). K is padded to whole groups with zero weights.

The XLA path (the CPU fallback and the accelerators' path) dequantizes in the product's prologue,
which XLA fuses into the dot: the step reads 4-bit bytes and float32 group params, never a float copy.
kernels/pack4.py lays the same weight out for the CPU kernels (hk_w4a8).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32  # inputs per group: GGUF's Q4_0/Q4_1/Q8_0 block, a Q4_K/Q5_K sub-block


class Int4Weight(NamedTuple):
    nibbles: np.ndarray | jax.Array  # [..., K_pad/2, N] uint8, two inputs a byte (module docstring)
    scale: np.ndarray | jax.Array  # [..., K_pad/32, N] float32
    min: np.ndarray | jax.Array  # [..., K_pad/32, N] float32


class Int8Group(NamedTuple):
    """w[k, n] = scale[g, n] * q[k, n] + min[g, n], q in 0..255: the int4 form with 8-bit q, so the
    kernels' float step (scale, min, the activations' group sums) is the same for both."""

    q: np.ndarray | jax.Array  # [..., K_pad, N] uint8
    scale: np.ndarray | jax.Array  # [..., K_pad/32, N] float32
    min: np.ndarray | jax.Array  # [..., K_pad/32, N] float32


class Int8Sym(NamedTuple):
    """w[k, n] = scale[g, n] * q[k, n], q in -128..127, scale float16: GGUF's d * (q - offset) blocks
    (Q4_0, Q5_0, Q8_0; d a float16) as they are, so no min to store, read or add."""

    q: np.ndarray | jax.Array  # [..., K_pad, N] int8
    scale: np.ndarray | jax.Array  # [..., K_pad/32, N] float16


class Int5Sym(NamedTuple):
    """w[k, n] = scale[g, n] * (q[k, n] - 16), q in 0..31 held as a low nibble and a high bit, scale float16:
    GGUF's Q5_0 blocks exactly as the file holds them (0.6875 bytes a weight; Int8Sym holds them in 1.0625)."""

    nibbles: np.ndarray | jax.Array  # [..., K_pad/2, N] uint8: q's low 4 bits, pack_nibbles' order
    high: np.ndarray | jax.Array  # [..., K_pad/8, N] uint8: bit i of byte 4g + b is q's bit 4 at input 32g + 8b + i
    scale: np.ndarray | jax.Array  # [..., K_pad/32, N] float16


def is_int8_group(names: dict) -> bool:
    """Whether a module's params {w, scale, min} hold 8-bit groups (w [..., K_pad, N]) rather than
    int4 nibbles (w [..., K_pad/2, N]): the two are told apart by w's rows per group."""
    return {"w", "scale", "min"} <= set(names) and names["w"].shape[-2] == GROUP * names["scale"].shape[-2]


def is_int8_sym(names: dict) -> bool:
    """Whether a module's params hold signed 8-bit groups {w, scale float16} (stored or packed): the
    linear params with a float16 scale and no min that are not 5-bit groups."""
    return _f16_scale(names) and not is_int5_sym(names)


def is_int5_sym(names: dict) -> bool:
    """Whether a module's params hold signed 5-bit groups {w nibbles, high, scale float16}, stored or
    packed (kernels/pack4.pack5): the only linear params with a `high`."""
    return "high" in names


def _f16_scale(names: dict) -> bool:
    return "min" not in names and "scale" in names and names["scale"].dtype == np.float16


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """q [..., K_pad, N] (values 0..15) → nibbles [..., K_pad/2, N]."""
    *lead, k, n = q.shape
    g = q.astype(np.uint8).reshape(*lead, k // GROUP, 2, GROUP // 2, n)
    return (g[..., 0, :, :] | (g[..., 1, :, :] << np.uint8(4))).reshape(*lead, k // 2, n)


def unpack_nibbles(nibbles, xp=np):
    """nibbles [..., K_pad/2, N] → q [..., K_pad, N] uint8 (xp: numpy or jax.numpy)."""
    *lead, half, n = nibbles.shape
    g = nibbles.reshape(*lead, half // (GROUP // 2), 1, GROUP // 2, n)
    q = xp.concatenate([g & 0x0F, g >> 4], axis=-3)  # [..., G, 2, 16, N]
    return q.reshape(*lead, half * 2, n)


def unpack_high(high, xp=np):
    """high [..., K_pad/8, N] → q's bit 4 [..., K_pad, N] uint8 in 0..1 (xp: numpy or jax.numpy)."""
    *lead, eighth, n = high.shape
    bits = (high[..., :, None, :] >> xp.arange(8, dtype=xp.uint8)[:, None]) & 1  # [..., K/8, 8, N]
    return bits.reshape(*lead, eighth * 8, n).astype(xp.uint8)


def pack_high(q: np.ndarray) -> np.ndarray:
    """q [..., K_pad, N] (values 0..31) → high [..., K_pad/8, N]: bit 4 of each, 8 inputs a byte."""
    *lead, k, n = q.shape
    bits = ((q.astype(np.uint8) >> np.uint8(4)) & np.uint8(1)).reshape(*lead, k // 8, 8, n)
    return (bits << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)


def _per_input(group_param, xp=np):
    """[..., G, N] → [..., G * 32, N]: each group's value at each of its inputs."""
    return xp.repeat(group_param, GROUP, axis=-2)


def dequantize(w: Int4Weight | Int8Group | Int8Sym | Int5Sym, xp=np):
    """→ float32 [..., K_pad, N]: scale * q + min in float32, one rounding (scale * q is exact for
    GGUF's scales: 11-17 significant bits times 4), as gguf's own dequantization computes it; Int8Sym:
    scale * q, the float16 scale widened exactly; Int5Sym: scale * (q - 16), as gguf computes Q5_0."""
    if isinstance(w, Int5Sym):
        q = unpack_nibbles(w.nibbles, xp) | (unpack_high(w.high, xp) << 4)
        return (q.astype(xp.int16) - 16).astype(xp.float32) * _per_input(w.scale.astype(xp.float32), xp)
    if isinstance(w, Int8Sym):
        return w.q.astype(xp.float32) * _per_input(w.scale.astype(xp.float32), xp)
    q = (w.q if isinstance(w, Int8Group) else unpack_nibbles(w.nibbles, xp)).astype(xp.float32)
    return q * _per_input(w.scale, xp) + _per_input(w.min, xp)


def _minmax_groups(w: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float [..., K, N] → (q [..., K_pad, N] uint8 in 0..levels, scale and min [..., K_pad/32, N]) with
    min/max per group: scale (max - min) / levels, q = round((w - min) / scale). Each value is within
    scale / 2 of the input, plus float32 rounding; K is padded with zeros to whole groups."""
    w = np.asarray(w, np.float32)
    *lead, k, n = w.shape
    kp = -(-k // GROUP) * GROUP
    w = np.pad(w, [(0, 0)] * len(lead) + [(0, kp - k), (0, 0)])
    g = w.reshape(*lead, kp // GROUP, GROUP, n)
    lo, hi = g.min(axis=-2), g.max(axis=-2)  # [..., G, N]
    scale = ((hi - lo) / np.float32(levels)).astype(np.float32)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.clip(np.rint((g - lo[..., None, :]) * inv[..., None, :]), 0, levels).astype(np.uint8)
    return q.reshape(*lead, kp, n), scale, lo.astype(np.float32)


def quantize_int4(w: np.ndarray) -> Int4Weight:
    """float [..., K, N] → int4, min/max per group: each value within (max - min) / 30 of the input."""
    q, scale, lo = _minmax_groups(w, 15)
    return Int4Weight(pack_nibbles(q), scale, lo)


def quantize_int8_groups(w: np.ndarray) -> Int8Group:
    """float [..., K, N] → 8-bit groups, min/max per group: each value within (max - min) / 510."""
    return Int8Group(*_minmax_groups(w, 255))


def grouped_dot(x: jax.Array, w: Int4Weight | Int8Group | Int8Sym | Int5Sym) -> jax.Array:
    """x [..., K] · a grouped weight → [..., N] float32, dequantized in the dot's prologue (XLA fuses
    it): the fallback of the CPU kernels and the accelerators' path."""
    k = x.shape[-1]
    dense = dequantize(w, jnp)[..., :k, :]  # [K, N]
    return jnp.dot(x.astype(jnp.float32), dense, preferred_element_type=jnp.float32)
