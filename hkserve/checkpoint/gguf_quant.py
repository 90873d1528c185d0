"""GGUF quantized blocks → the grouped weights of model/int4.py, without a float round trip where the
block maps exactly.

Exact (equal to gguf.quants.dequantize bit for bit: the same float32 products and sums):
  Q4_0  w = d * (q - 8)           → scale d, min -8d (d * (q - 8) is exact in float32, so is d*q - 8d)
  Q4_1  w = d * q + m             → scale d, min m
  Q4_K  w = (d*sc) * q - dmin*m   → per 32-value sub-block: scale d*sc, min -(dmin*m)
  Q8_0  w = d * q (int8)          → Int8Group, scale d per 32 values
Requantized from gguf's float32 dequantization (lossy, 5-6 bits → 4): Q5_0, Q5_1, Q5_K, Q6_K, by
model/int4.quantize_int4 (min/max per group of 32): each value within (max - min) / 30 of its group's
source values, plus float32 rounding (tests/test_int4.py measures it).
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from hkserve.model.int4 import GROUP, Int4Weight, Int8Group, pack_nibbles, quantize_int4

EXACT = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)
REQUANTIZED = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)


def _blocks(data: np.ndarray, qtype: Q) -> np.ndarray:
    """Raw tensor bytes → [n_blocks, type_size] uint8."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    return np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2] bytes → [n, 1] float32."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """[n, j * half] bytes → [n, j * 2 * half] values: each run of `half` bytes gives its low nibbles
    then its high ones (the order of Q4_0/Q4_1 blocks with half 16, of Q4_K's 64-value runs with 32)."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, half) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(n, -1)


def _groups_q4(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """→ (q [n_groups, 32] uint8, scale [n_groups] float32, min [n_groups] float32)."""
    if qtype == Q.Q4_0:
        d = _f16(blocks[:, :2])
        return _nibbles(blocks[:, 2:], 16), d[:, 0], (np.float32(-8) * d)[:, 0]
    if qtype == Q.Q4_1:
        return _nibbles(blocks[:, 4:], 16), _f16(blocks[:, :2])[:, 0], _f16(blocks[:, 2:4])[:, 0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] 6-bit
    scale = (d * sc.astype(np.float32)).reshape(-1)
    low = -(dmin * m.astype(np.float32)).reshape(-1)
    return _nibbles(blocks[:, 16:], 32).reshape(-1, GROUP), scale, low


def _columns(groups: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Per-group values in file order [out * in / 32, ...] → [in / 32 (, ...), out]: [in, out] order."""
    out, inp = shape
    g = groups.reshape(out, inp // GROUP, *groups.shape[1:])
    return np.moveaxis(g, 0, -1)


def grouped(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Int4Weight | Int8Group:
    """A GGUF tensor's raw bytes of `qtype`, `shape` [out, in] (the reversed GGUF dims) → the grouped
    weight [in, out]."""
    out, inp = shape
    if qtype in REQUANTIZED:
        dense = np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(out, inp)
        return quantize_int4(dense.T)
    if qtype not in EXACT:
        raise ValueError(f"{qtype.name} blocks have no grouped mapping")
    blocks = _blocks(data, qtype)
    if qtype == Q.Q8_0:
        values = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)  # [n, 32]
        values = _columns(values, shape).reshape(inp, out)
        return Int8Group(values, _columns(_f16(blocks[:, :2])[:, 0], shape))
    q, scale, low = _groups_q4(blocks, qtype)
    q = _columns(q, shape)  # [in/32, 32, out]
    return Int4Weight(pack_nibbles(q.reshape(inp, out)), _columns(scale, shape), _columns(low, shape))


def grouped_tensor(tensor) -> Int4Weight | Int8Group | None:
    """A gguf reader tensor as a grouped weight [in, out], or None for a float (or other) tensor, which
    the importer dequantizes as before. The hook of gguf_import.py for --weights int4."""
    if tensor.tensor_type not in EXACT + REQUANTIZED or len(tensor.shape) != 2:
        return None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return grouped(np.asarray(tensor.data), tensor.tensor_type, shape)
