"""The int4 kernel's weight layout (q4matmul.cc), made once at load from the stored grouped weight
(model/int4.py: nibbles [..., K/2, N], scale and min [..., K/32, N]); jnp, so it runs jitted.

Per 64-column tile and group of 32 inputs, 1024 bytes [4 input quads j][4 column quarters][16 columns]
[4 inputs e]: a byte holds input 4j + e of the group in its low nibble and 16 + 4j + e in its high one.
Scale and min become [..., N_pad/64, K/32, 64]. Padding columns have zero weight, scale and min.
Leading (layer) dims are kept. The stored nibble order (input i and 16 + i a byte) is repeated here,
not imported: kernels sit below model in the import layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

GROUP, N_TILE = 32, 64


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(weight, scale/min) packed shapes of a stored nibble array [..., K_pad/2, N]."""
    *lead, half, n = shape
    tiles, groups = -(-n // N_TILE), half * 2 // GROUP
    return (*lead, tiles, groups, 1024), (*lead, tiles, groups, N_TILE)


def pack4(nibbles: jax.Array, scale: jax.Array, mins: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Stored grouped int4 → (w [..., N_pad/64, K/32, 1024] uint8, scale, min [..., N_pad/64, K/32, 64])."""
    *lead, half, n = nibbles.shape
    nl, groups, pad = len(lead), half * 2 // GROUP, -(-n // N_TILE) * N_TILE - n
    widths = [(0, 0)] * (nl + 1) + [(0, pad)]
    q = nibbles.reshape(*lead, groups, 1, GROUP // 2, n)
    q = jnp.concatenate([q & 0x0F, q >> 4], axis=-3).reshape(*lead, groups, 2, 4, 4, n)  # [..., G, half, j, e, N]
    q = jnp.pad(q, [(0, 0)] * (nl + 4) + [(0, pad)]).reshape(*lead, groups, 2, 4, 4, -1, 4, 16)
    byte = (q[..., 0, :, :, :, :, :] | (q[..., 1, :, :, :, :, :] << 4)).astype(jnp.uint8)  # [..., G, j, e, T, c, 16]
    w = jnp.transpose(byte, (*range(nl), nl + 3, nl, nl + 1, nl + 4, nl + 5, nl + 2))  # [..., T, G, j, c, 16, e]

    def tiles(a):  # [..., G, N] → [..., T, G, 64]
        a = jnp.pad(a.astype(jnp.float32), widths).reshape(*lead, groups, -1, N_TILE)
        return jnp.swapaxes(a, -3, -2)

    return w.reshape(*lead, -1, groups, 1024), tiles(scale), tiles(mins)
