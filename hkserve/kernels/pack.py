"""The kernels' weight layout, made once at load from int8 [K, N] weights (jnp: it runs jitted on
the device in the engine's `prepare`).

uint8 (w + 128) as [N_pad/64, K_pad/4, 64, 4]: output tile t holds columns 64t..64t+63 and each
4-byte lane 4 consecutive inputs of one column (what vpdpbusd multiplies); K_pad is a multiple of
32 (the activation block), N_pad of 64; padding is zero weight. Leading (layer) dims are kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

K_ALIGN, N_TILE = 32, 64


def padded_width(n: int) -> int:
    """Output columns of a packed weight of n columns: whole tiles."""
    return -(-n // N_TILE) * N_TILE


def packed_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Packed shape of an int8 [..., K, N] weight."""
    *lead, k, n = shape
    return (*lead, -(-n // N_TILE), -(-k // K_ALIGN) * K_ALIGN // 4, N_TILE, 4)


def pack(w: jax.Array) -> jax.Array:
    """int8 [..., K, N] → uint8 [..., N_pad/64, K_pad/4, 64, 4]."""
    *lead, k, n = w.shape
    kp, np_ = -(-k // K_ALIGN) * K_ALIGN, -(-n // N_TILE) * N_TILE
    w = jnp.pad(w.astype(jnp.int16) + 128, [(0, 0)] * len(lead) + [(0, kp - k), (0, np_ - n)], constant_values=128)
    w = w.astype(jnp.uint8).reshape(*lead, kp // 4, 4, np_ // N_TILE, N_TILE)
    nl = len(lead)
    return jnp.transpose(w, (*range(nl), nl + 2, nl, nl + 3, nl + 1))


def unpack_rows(packed: jax.Array, rows: jax.Array, k: int) -> jax.Array:
    """Columns `rows` of a packed [N/64, K/4, 64, 4] weight as int8 [..., K] (an embedding lookup
    when the table is packed as the tied output head)."""
    cols = packed[rows // N_TILE, :, rows % N_TILE, :]  # [..., K_pad/4, 4]
    cols = cols.reshape(*rows.shape, -1)[..., :k]
    return (cols.astype(jnp.int16) - 128).astype(jnp.int8)
