"""Grouped int4 / int8 weights (model/int4.py) and the GGUF block mapping (checkpoint/gguf_quant.py)
against the `gguf` package's own dequantization: bit for bit for Q4_0, Q4_1, Q4_K and Q8_0; within the
stated bound ((max - min) / 30 per group of 32, plus float32 rounding) for the requantized Q5_0, Q5_1,
Q5_K and Q6_K. Tensors are made with gguf.quants.quantize where the package can (Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0), else as random blocks in llama.cpp's layout with sane float16 super-scales (Q4_K, Q5_K, Q6_K)."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from hkserve.checkpoint.gguf_quant import (
    EXACT,
    EXACT8,
    REQUANTIZED,
    SYM8,
    grouped,
    grouped5,
    grouped8,
    grouped8_sym,
    grouped_tensor,
)
from hkserve.model.int4 import Int4Weight, Int5Sym, Int8Group, Int8Sym, dequantize, grouped_dot, quantize_int4

SHAPE = (48, 512)  # [out, in]: two k-quant super-blocks of 256 per row
CAN_QUANTIZE = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)


def _random_kquant(qtype: Q, shape: tuple[int, int], rng) -> np.ndarray:
    """Random blocks of a k-quant: every byte random except the float16 super-scales (d, dmin)."""
    _, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // 256, size), dtype=np.uint8)
    d = rng.uniform(1e-4, 3e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    dmin = rng.uniform(1e-4, 3e-3, (blocks.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ... scales int8 [16], d f16 last
        blocks[:, -2:] = d
    else:  # d, dmin f16 first
        blocks[:, :2], blocks[:, 2:4] = d, dmin
    return blocks.reshape(-1)


def source(qtype: Q, shape=SHAPE, seed: int = 0) -> np.ndarray:
    """Raw bytes of a [out, in] tensor of `qtype`."""
    rng = np.random.default_rng(seed)
    if qtype in CAN_QUANTIZE:
        w = rng.standard_normal(shape).astype(np.float32) * 0.05
        w[0, :32] += 0.3  # one group well off zero: the mins matter
        return gguf.quants.quantize(w, qtype).reshape(-1)
    return _random_kquant(qtype, shape, rng)


def reference(data: np.ndarray, qtype: Q, shape=SHAPE) -> np.ndarray:
    """gguf's dequantization as [in, out] float32."""
    return np.asarray(gguf.quants.dequantize(data, qtype), np.float32).reshape(shape).T


@pytest.mark.parametrize("qtype", EXACT, ids=lambda q: q.name)
def test_exact_block_types_equal_gguf_dequantization_bit_for_bit(qtype):
    data = source(qtype)
    w = grouped(data, qtype, SHAPE)
    assert isinstance(w, Int8Group if qtype == Q.Q8_0 else Int4Weight)
    got, want = dequantize(w), reference(data, qtype)
    # bits equal but a zero's sign: Q4_0's d * (8 - 8) is -0 for a negative d, d * 8 - 8d is +0
    assert np.array_equal(np.where(got == 0, 0, got).view(np.uint32), np.where(want == 0, 0, want).view(np.uint32))


def _equal_bits_but_zero_sign(got: np.ndarray, want: np.ndarray) -> bool:
    return np.array_equal(np.where(got == 0, 0, got).view(np.uint32), np.where(want == 0, 0, want).view(np.uint32))


@pytest.mark.parametrize("qtype", EXACT8, ids=lambda q: q.name)
def test_every_up_to_8_bit_type_maps_into_8_bit_groups_bit_for_bit(qtype):
    """The int4 variant's 8-bit stacks (gguf_int4.py) hold Q4_*, Q5_* and Q8_0 blocks exactly."""
    data = source(qtype, seed=3)
    w = grouped8(data, qtype, SHAPE)
    assert isinstance(w, Int8Group) and w.q.dtype == np.uint8 and w.q.shape == SHAPE[::-1]
    assert _equal_bits_but_zero_sign(dequantize(w), reference(data, qtype))


@pytest.mark.parametrize("qtype", list(SYM8), ids=lambda q: q.name)
def test_min_less_types_map_into_signed_8_bit_groups_bit_for_bit(qtype):
    """Q4_0/Q5_0/Q8_0 (d * (q - offset)) as signed int8 with the file's float16 d, no min: gguf's
    float32 bits exactly, the sign of zero included; and grouped8_sym refuses a type with a min."""
    data = source(qtype, seed=4)
    w = grouped8_sym(data, qtype, SHAPE)
    assert isinstance(w, Int8Sym) and w.q.dtype == np.int8 and w.scale.dtype == np.float16
    assert w.q.shape == SHAPE[::-1] and w.scale.shape == (SHAPE[1] // 32, SHAPE[0])
    got, want = dequantize(w), reference(data, qtype)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    low, high = -SYM8[qtype] if SYM8[qtype] else -128, (SYM8[qtype] - 1) if SYM8[qtype] else 127
    assert low <= w.q.min() and w.q.max() <= high
    with pytest.raises(ValueError, match="have a min"):
        grouped8_sym(source(Q.Q4_1), Q.Q4_1, SHAPE)


def _random_q5_0(shape=SHAPE, seed: int = 0) -> np.ndarray:
    """Q5_0 blocks with every qs and qh byte random (each q in 0..31 met) and float16 d of both signs."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // 32, 22), dtype=np.uint8)
    d = rng.uniform(1e-4, 3e-3, (blocks.shape[0], 1)) * rng.choice([-1, 1], (blocks.shape[0], 1))
    blocks[:, :2] = d.astype(np.float16).view(np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("blocks", ["quantized", "random"])
def test_q5_0_maps_into_signed_5_bit_groups_bit_for_bit(blocks):
    """Q5_0 as it is (Int5Sym: the low nibbles, qh's bits, the float16 d): gguf's float32 bits exactly,
    the sign of zero included, at the file's 0.6875 bytes a weight; grouped5 refuses other types."""
    data = source(Q.Q5_0, seed=5) if blocks == "quantized" else _random_q5_0(seed=6)
    w = grouped5(data, Q.Q5_0, SHAPE)
    assert isinstance(w, Int5Sym) and w.scale.dtype == np.float16
    assert w.nibbles.shape == (SHAPE[1] // 2, SHAPE[0]) and w.high.shape == (SHAPE[1] // 8, SHAPE[0])
    assert sum(a.nbytes for a in w) == data.nbytes  # 22 bytes a block of 32, as in the file
    got, want = dequantize(w), reference(data, Q.Q5_0)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="not Q5_0"):
        grouped5(source(Q.Q8_0), Q.Q8_0, SHAPE)


def test_q6_k_requantized_into_8_bit_groups_within_the_stated_bound():
    data = source(Q.Q6_K)
    ref = reference(data, Q.Q6_K)
    got = dequantize(grouped8(data, Q.Q6_K, SHAPE))
    groups = ref.reshape(-1, 32, ref.shape[1])
    bound = (groups.max(1) - groups.min(1)) / 510
    err = np.abs(got - ref).reshape(groups.shape)
    assert np.all(err <= bound[:, None, :] * (1 + 1e-4) + 1e-7 * np.abs(groups))
    assert err.max() > 0


@pytest.mark.parametrize("qtype", REQUANTIZED, ids=lambda q: q.name)
def test_requantized_block_types_stay_within_the_stated_bound(qtype):
    data = source(qtype)
    ref = reference(data, qtype)  # [in, out]
    got = dequantize(grouped(data, qtype, SHAPE))
    groups = ref.reshape(-1, 32, ref.shape[1])
    bound = (groups.max(1) - groups.min(1)) / 30  # [in/32, out]
    err = np.abs(got - ref).reshape(groups.shape)
    assert np.all(err <= bound[:, None, :] * (1 + 1e-5) + 1e-7 * np.abs(groups))
    assert err.max() > 0  # a lossy mapping: 5-6 bits do not fit in 4


def test_float_quantization_bound_and_zero_padding_of_a_partial_group():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((70, 9)).astype(np.float32)  # K = 70: the third group is partial
    q = quantize_int4(w)
    assert q.nibbles.shape == (48, 9) and q.scale.shape == (3, 9)
    got = dequantize(q)[:70]
    padded = np.pad(w, [(0, 26), (0, 0)]).reshape(3, 32, 9)
    bound = np.repeat((padded.max(1) - padded.min(1)) / 30, 32, axis=0)[:70]
    assert np.all(np.abs(got - w) <= bound * (1 + 1e-5) + 1e-6)


def test_constant_groups_quantize_exactly():
    w = np.full((64, 3), 0.25, np.float32)
    w[32:] = -1.5
    assert np.array_equal(dequantize(quantize_int4(w)), w)


@pytest.mark.parametrize("kind", ["int4", "int8", "int8-sym-Q5_0", "int8-sym-Q8_0", "int5-sym"])
def test_xla_grouped_dot_equals_float64_product_of_ggufs_dequantized_weight(kind):
    qtype = {"int4": Q.Q4_1, "int8": Q.Q8_0, "int8-sym-Q5_0": Q.Q5_0, "int8-sym-Q8_0": Q.Q8_0, "int5-sym": Q.Q5_0}[kind]
    shape = (40, 96)
    data = source(qtype, shape, seed=2)
    w = grouped8_sym(data, qtype, shape) if "8-sym" in kind else grouped(data, qtype, shape)
    w = grouped5(data, qtype, shape) if kind == "int5-sym" else w
    dense = reference(data, qtype, shape).astype(np.float64)  # gguf's floats
    x = np.random.default_rng(3).standard_normal((3, 96)).astype(np.float32)
    y = np.asarray(jax.jit(grouped_dot)(jnp.asarray(x), jax.tree.map(jnp.asarray, w)))
    assert np.allclose(y, x.astype(np.float64) @ dense, rtol=0, atol=1e-5 * (np.abs(x) @ np.abs(dense)).max())


def test_reader_tensors_map_by_type_and_floats_are_left_to_the_importer(tmp_path):
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    q4 = source(Q.Q4_1, (8, 64))
    writer.add_tensor("q4", q4.reshape(8, -1), raw_dtype=Q.Q4_1)
    writer.add_tensor("f32", np.ones((8, 64), np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert grouped_tensor(tensors["f32"]) is None
    got = grouped_tensor(tensors["q4"])
    assert np.array_equal(dequantize(got), reference(q4, Q.Q4_1, (8, 64)))
