"""GGUF quantized blocks → the grouped weights of model/int4.py, without a float round trip where the
block maps exactly.

Exact (equal to gguf.quants.dequantize bit for bit: the same float32 products and sums):
  Q4_0  w = d * (q - 8)           → scale d, min -8d (d * (q - 8) is exact in float32, so is d*q - 8d)
  Q4_1  w = d * q + m             → scale d, min m
  Q4_K  w = (d*sc) * q - dmin*m   → per 32-value sub-block: scale d*sc, min -(dmin*m)
  Q8_0  w = d * q (int8)          → Int8Group, q + 128, scale d, min -128d
Requantized from gguf's float32 dequantization (lossy, 5-6 bits → 4): Q5_0, Q5_1, Q5_K, Q6_K, by
model/int4.quantize_int4 (min/max per group of 32): each value within (max - min) / 30 of its group's
source values, plus float32 rounding (tests/test_int4.py measures it).

`grouped8` maps every type into 8-bit groups (model/int4.Int8Group), the form of the int4 variant's
stacks that hold any type but Q4_0/Q4_1/Q4_K (gguf_int4.py). Exact: Q4_0, Q4_1, Q4_K and Q8_0 as above,
  Q5_0  w = d * (q - 16)          → scale d, min -16d
  Q5_1  w = d * q + m             → scale d, min m
  Q5_K  w = (d*sc) * q - dmin*m   → per 32-value sub-block: scale d*sc, min -(dmin*m)
Requantized (min/max per group of 32, 255 steps: each value within (max - min) / 510 of its group's
source values): Q6_K (whose 16-value sub-blocks have scales of their own) and every other type.

`grouped8_sym` maps the types without a min into signed 8-bit groups (model/int4.Int8Sym), exactly:
  Q4_0  w = d * (q - 8)   → q - 8,  scale d (float16, as stored)
  Q5_0  w = d * (q - 16)  → q - 16, scale d
  Q8_0  w = d * q         → q,      scale d
gguf computes the same float32 product d * (q - offset), so the bits are equal (-0 included).

`grouped5` maps Q5_0 blocks into signed 5-bit groups (model/int4.Int5Sym) as they are: the 32 low
nibbles, the 32 high bits of qh and the float16 d, 5.5 bits a weight; the same product, equal bits.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from hkserve.model.int4 import (
    GROUP,
    Int4Weight,
    Int5Sym,
    Int8Group,
    Int8Sym,
    pack_high,
    pack_nibbles,
    quantize_int4,
    quantize_int8_groups,
)

EXACT = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)
REQUANTIZED = (Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q6_K)
EXACT8 = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0)  # grouped8's exact mappings
SYM8 = {Q.Q4_0: 8, Q.Q5_0: 16, Q.Q8_0: 0}  # grouped8_sym's types: d * (q - offset), no min


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


def _groups_q5(blocks: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """→ (q [n_groups, 32] uint8 in 0..31, scale [n_groups], min [n_groups]) of Q5_0/Q5_1/Q5_K blocks:
    the low nibbles as Q4_0/Q4_1/Q4_K lay them out, the fifth bit from qh."""
    if qtype in (Q.Q5_0, Q.Q5_1):
        at = 2 if qtype == Q.Q5_0 else 4  # qh follows d (and m)
        d = _f16(blocks[:, :2])[:, 0]
        qh = np.ascontiguousarray(blocks[:, at : at + 4]).view(np.uint32)  # [n, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)  # bit j: value j
        q = _nibbles(blocks[:, at + 4 :], 16) | (high << np.uint8(4))
        low = np.float32(-16) * d if qtype == Q.Q5_0 else _f16(blocks[:, 2:4])[:, 0]
        return q, d, low
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])  # [n, 8] 6-bit
    high = (blocks[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & np.uint8(1)  # [n, 8, 32]
    q = _nibbles(blocks[:, 48:], 32).reshape(-1, 8, GROUP) | (high << np.uint8(4))
    scale = (d * sc.astype(np.float32)).reshape(-1)
    low = -(dmin * m.astype(np.float32)).reshape(-1)
    return q.reshape(-1, GROUP), scale, low


def grouped8(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Int8Group:
    """A GGUF tensor's raw bytes of any type, `shape` [out, in] → 8-bit groups [in, out] (module docstring)."""
    out, inp = shape
    if qtype not in EXACT8:
        dense = np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(out, inp)
        return quantize_int8_groups(dense.T)
    blocks = _blocks(data, qtype)
    if qtype == Q.Q8_0:
        d = _f16(blocks[:, :2])[:, 0]
        q = (np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        scale, low = d, np.float32(-128) * d
    elif qtype in (Q.Q5_0, Q.Q5_1, Q.Q5_K):
        q, scale, low = _groups_q5(blocks, qtype)
    else:
        q, scale, low = _groups_q4(blocks, qtype)
    return Int8Group(_columns(q, shape).reshape(inp, out), _columns(scale, shape), _columns(low, shape))


def grouped8_sym(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Int8Sym:
    """A Q4_0/Q5_0/Q8_0 tensor's raw bytes, `shape` [out, in] → signed 8-bit groups [in, out] (module
    docstring): the blocks' own q - offset and float16 d, no float round trip."""
    if qtype not in SYM8:
        raise ValueError(f"{qtype.name} blocks have a min: no signed 8-bit group mapping")
    out, inp = shape
    blocks = _blocks(data, qtype)
    if qtype == Q.Q8_0:
        q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)
    else:
        q = (_groups_q5(blocks, qtype) if qtype == Q.Q5_0 else _groups_q4(blocks, qtype))[0]
        q = (q.astype(np.int16) - SYM8[qtype]).astype(np.int8)
    d = np.ascontiguousarray(blocks[:, :2]).view(np.float16)[:, 0]
    return Int8Sym(_columns(q, shape).reshape(inp, out), _columns(d, shape))


def grouped5(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> Int5Sym:
    """A Q5_0 tensor's raw bytes, `shape` [out, in] → signed 5-bit groups [in, out] (module docstring)."""
    if qtype != Q.Q5_0:
        raise ValueError(f"{qtype.name} blocks are not Q5_0: no signed 5-bit group mapping")
    out, inp = shape
    blocks = _blocks(data, qtype)
    q = _columns(_groups_q5(blocks, qtype)[0], shape).reshape(inp, out)  # 0..31
    d = np.ascontiguousarray(blocks[:, :2]).view(np.float16)[:, 0]
    return Int5Sym(pack_nibbles(q & np.uint8(0x0F)), pack_high(q), _columns(d, shape))


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
        return grouped8(data, qtype, shape)
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
