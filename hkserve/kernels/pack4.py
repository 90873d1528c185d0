"""The int4 kernel's weight layout (q4matmul.cc), made once at load from the stored grouped weight
(model/int4.py: nibbles [..., K/2, N], scale and min [..., K/32, N]); jnp, so it runs jitted. `pack8`:
the same for 8-bit groups (hk_w8ga16, q8a16.h); `pack8_sym`: signed 8-bit groups (int8 q, a float16
scale, no min; hk_w8sa16), the same byte layout with the scale kept float16; `pack5`: signed 5-bit
groups (low nibbles, high bits, a float16 scale; hk_w5sa16, q5a16.h): pack4's nibble bytes and a
plane of the high bits, 256 bytes per tile and group.

Per 64-column tile and group of 32 inputs, 1024 bytes [4 input quads j][4 column quarters][16 columns]
[4 inputs e]: a byte holds input 4j + e of the group in its low nibble and 16 + 4j + e in its high one.
Scale and min become [..., N_pad/64, K/32, 64]. Padding columns have zero weight, scale and min.
Leading (layer) dims are kept. The stored nibble order (input i and 16 + i a byte) is repeated here,
not imported: kernels sit below model in the import layers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

GROUP, N_TILE = 32, 64


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(weight, scale/min) packed shapes of a stored nibble array [..., K_pad/2, N]."""
    *lead, half, n = shape
    tiles, groups = -(-n // N_TILE), half * 2 // GROUP
    return (*lead, tiles, groups, 1024), (*lead, tiles, groups, N_TILE)


def packed_shapes8(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(weight, scale/min) packed shapes of a stored 8-bit group array [..., K_pad, N]."""
    *lead, k, n = shape
    tiles, groups = -(-n // N_TILE), k // GROUP
    return (*lead, tiles, groups, 2048), (*lead, tiles, groups, N_TILE)


def _tiles(a: jax.Array, lead: list[int], groups: int, pad: int, dtype=jnp.float32) -> jax.Array:
    """A per-group param [..., G, N] → [..., N_pad/64, G, 64] `dtype` (zero padding columns)."""
    a = jnp.pad(a.astype(dtype), [(0, 0)] * (len(lead) + 1) + [(0, pad)]).reshape(*lead, groups, -1, N_TILE)
    return jnp.swapaxes(a, -3, -2)


def _bytes8(q: jax.Array) -> jax.Array:
    """8-bit q [..., K, N] (uint8, or int8 as its two's complement bytes) → [..., N_pad/64, K/32, 2048]
    uint8: per tile and group [8 input quads j][4 column quarters][16 columns][4 inputs 4j + e]."""
    *lead, k, n = q.shape
    nl, groups, pad = len(lead), k // GROUP, -(-n // N_TILE) * N_TILE - n
    q = jax.lax.bitcast_convert_type(q, jnp.uint8) if q.dtype == jnp.int8 else q.astype(jnp.uint8)
    w = jnp.pad(q.reshape(*lead, groups, 8, 4, n), [(0, 0)] * (nl + 3) + [(0, pad)])
    w = w.reshape(*lead, groups, 8, 4, -1, 4, 16)  # [..., G, j, e, T, c, 16]
    w = jnp.transpose(w, (*range(nl), nl + 3, nl, nl + 1, nl + 4, nl + 5, nl + 2))  # [..., T, G, j, c, 16, e]
    return w.reshape(*lead, -1, groups, 2048)


def pack8(q: jax.Array, scale: jax.Array, mins: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stored 8-bit groups → (w [..., N_pad/64, K/32, 2048] uint8 (_bytes8), scale, min [..., N_pad/64,
    K/32, 64] float32)."""
    *lead, k, n = q.shape
    groups, pad = k // GROUP, -(-n // N_TILE) * N_TILE - n
    return _bytes8(q), _tiles(scale, lead, groups, pad), _tiles(mins, lead, groups, pad)


def pack8_sym(q: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Stored signed 8-bit groups (int8 q [..., K, N], float16 scale [..., K/32, N]) → (w [..., N_pad/64,
    K/32, 2048] uint8 holding the int8 bytes, scale [..., N_pad/64, K/32, 64] float16)."""
    *lead, k, n = q.shape
    return _bytes8(q), _tiles(scale, lead, k // GROUP, -(-n // N_TILE) * N_TILE - n, jnp.float16)


def pack4(nibbles: jax.Array, scale: jax.Array, mins: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stored grouped int4 → (w [..., N_pad/64, K/32, 1024] uint8, scale, min [..., N_pad/64, K/32, 64])."""
    *lead, half, n = nibbles.shape
    groups, pad = half * 2 // GROUP, -(-n // N_TILE) * N_TILE - n
    return _bytes4(nibbles), _tiles(scale, lead, groups, pad), _tiles(mins, lead, groups, pad)


def _bytes4(nibbles: jax.Array) -> jax.Array:
    """Stored nibbles [..., K_pad/2, N] → [..., N_pad/64, K/32, 1024] uint8 (the module docstring's layout)."""
    *lead, half, n = nibbles.shape
    nl, groups, pad = len(lead), half * 2 // GROUP, -(-n // N_TILE) * N_TILE - n
    q = nibbles.reshape(*lead, groups, 1, GROUP // 2, n)
    q = jnp.concatenate([q & 0x0F, q >> 4], axis=-3).reshape(*lead, groups, 2, 4, 4, n)  # [..., G, half, j, e, N]
    q = jnp.pad(q, [(0, 0)] * (nl + 4) + [(0, pad)]).reshape(*lead, groups, 2, 4, 4, -1, 4, 16)
    byte = (q[..., 0, :, :, :, :, :] | (q[..., 1, :, :, :, :, :] << 4)).astype(jnp.uint8)  # [..., G, j, e, T, c, 16]
    w = jnp.transpose(byte, (*range(nl), nl + 3, nl, nl + 1, nl + 4, nl + 5, nl + 2))  # [..., T, G, j, c, 16, e]
    return w.reshape(*lead, -1, groups, 1024)


HIGH5 = 256  # bytes per (tile, group) of pack5's high-bit plane


def packed_shapes5(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(weight, high, scale) packed shapes of a stored 5-bit group nibble array [..., K_pad/2, N]."""
    w, scale = packed_shapes(shape)
    return w, (*w[:-1], HIGH5), scale


def pack5(nibbles: jax.Array, high: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stored signed 5-bit groups (nibbles [..., K/2, N], high [..., K/8, N]: bit i of byte 4g + b is input
    32g + 8b + i's; float16 scale [..., K/32, N]) → (w [..., N_pad/64, K/32, 1024] uint8, high [..., N_pad/64,
    K/32, 256] uint8, scale [..., N_pad/64, K/32, 64] float16). Per tile and group: pack4's 1024 nibble
    bytes, and the high bits, per input quad j 32 16-bit words (2 bytes each, low first), word 2l + h
    holding in bit c + 4 + 8 (k % 2) - 4 (k // 2) the high bit of column 16c + l at input 16 (k // 2) +
    4j + 2h + k % 2 (q5a16.h)."""
    *lead, eighth, n = high.shape
    nl, groups, pad = len(lead), eighth * 8 // GROUP, -(-n // N_TILE) * N_TILE - n
    bits = (high[..., :, None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]) & 1  # [..., K/8, 8, N]
    bits = jnp.pad(bits.reshape(*lead, groups, 2, 4, 2, 2, n), [(0, 0)] * (nl + 5) + [(0, pad)])
    bits = bits.reshape(*lead, groups, 2, 4, 2, 2, -1, 4, 16).astype(jnp.uint16)  # [..., G, k//2, j, h, k%2, T, c, l]
    ar = functools.partial(jnp.arange, dtype=jnp.int32)
    # bit c + 4 + 8 (k % 2) - 4 (k // 2): unpack k = 0, 1, 2, 3 of line c at c + 4, c + 12, c, c + 8
    shift = ar(4)[:, None] + 4 + 8 * ar(2)[:, None, None, None] - 4 * ar(2)[:, None, None, None, None, None, None]
    shift = shift.astype(jnp.uint16)
    word = (bits << shift).sum(axis=(-7, -4, -2), dtype=jnp.uint16)  # [..., G, j, h, T, l]: disjoint bits
    word = jnp.transpose(word, (*range(nl), nl + 3, nl, nl + 1, nl + 4, nl + 2))  # [..., T, G, j, l, h]
    hi = jnp.stack([word & 0xFF, word >> 8], axis=-1).astype(jnp.uint8).reshape(*lead, -1, groups, 256)
    return _bytes4(nibbles), hi, _tiles(scale, lead, groups, pad, jnp.float16)
