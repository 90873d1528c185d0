"""hk_w4a16 and hk_w4a8 (kernels/q4matmul.cc): int4 group weights times int16 (per 128) or int8 (per
32) activation blocks, on both ISA paths, against the float64 product of the kernel's block-quantized
activations (test_kernels.quantize_rows) and the float64 dequantized weight, within 1e-5 of the sum of
the terms' magnitudes (float32 accumulation); odd sizes, B in {1, 3, 16, 17}; a layer stack read at
its index; a row's bits alone and among others; the XLA path (model/int4.grouped_dot) against the
same weight."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_int4 import source
from test_kernels import ISAS, SMOLLM2, quantize_rows

from hkserve.checkpoint.gguf_quant import grouped
from hkserve.kernels import dispatch, ffi, pack4, q4ffi
from hkserve.model.int4 import Int4Weight, grouped_dot, quantize_int4, unpack_nibbles
from hkserve.model.packing import fuse

ODD = [(100, 70), (33, 129), (200, 1), (64, 65)]
KINDS = {"w4a16": (32767, 128), "w4a8": (127, 32)}  # activation levels, block (test_kernels.quantize_rows)


def test_the_int4_targets_are_built_on_this_machine():
    assert q4ffi.available() and ISAS, "no kernel library or no AVX2: the int4 kernels are not tested here"


def weight(k: int, n: int, seed: int = 0) -> Int4Weight:
    """Random int4 weight whose groups have mins well off zero (the min term matters)."""
    rng = np.random.default_rng(seed + 3 * k + n)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05 + rng.uniform(-0.1, 0.1, (1, n)).astype(np.float32)
    return quantize_int4(w)


def dense64(w: Int4Weight) -> np.ndarray:
    """float64 dequantized weight [K_pad, N]."""
    q = unpack_nibbles(np.asarray(w.nibbles)).astype(np.float64)
    return q * np.repeat(np.asarray(w.scale, np.float64), 32, 0) + np.repeat(np.asarray(w.min, np.float64), 32, 0)


@functools.cache
def kernel(kind: str, isa: int, n: int):
    return jax.jit(lambda x, w, s, m: q4ffi.matmul_int4(x, w, s, m, n, kind, isa))


def run(x: np.ndarray, w: Int4Weight, isa: int, kind: str) -> np.ndarray:
    packed = pack4.pack4(*map(jnp.asarray, w))
    return np.asarray(kernel(kind, isa, w.nibbles.shape[-1])(x, *packed))


def check(y: np.ndarray, x: np.ndarray, w: Int4Weight, kind: str, tol: float = 1e-5) -> None:
    xs, wd = quantize_rows(x, *KINDS[kind]), dense64(w)[: x.shape[1]]
    ref, bound = xs @ wd, tol * (np.abs(xs) @ np.abs(wd)) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= bound), f"max error {err.max():.3g} over bound {(err / bound).max():.3g}x"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SMOLLM2[:4] + ODD, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_float64_reference(shape, isa, kind):
    k, n = shape
    w = weight(k, n)
    for m in (1, 3, 16, 17):
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        y = run(x, w, isa, kind)
        assert y.shape == (m, n)
        check(y, x, w, kind)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", ISAS)
def test_a_gguf_q4_k_weight_runs_as_imported(isa, kind):
    shape = (96, 512)  # [out, in]
    w = grouped(source(Q.Q4_K, shape, seed=5), Q.Q4_K, shape)
    x = np.random.default_rng(6).standard_normal((17, 512)).astype(np.float32)
    check(run(x, w, isa, kind), x, w, kind)


def check_stack_read_at_each_layer(make, packer, kind: str, alone) -> None:
    """A 3-layer stack of `make(seed)` weights [100, 70], packed by `packer` and read at each index,
    equals that layer run alone (`alone(x, w, isa)`) bit for bit: the kernel's layer offset."""
    isa = ISAS[0]
    layers = [make(s) for s in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*(packer(*map(jnp.asarray, w)) for w in layers))]
    x = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    call = jax.jit(lambda x, w, s, m, i: q4ffi.matmul_int4(x, w, s, m, 70, kind, isa, layer=i))
    for i, w in enumerate(layers):
        assert np.array_equal(np.asarray(call(x, *stacked, jnp.int32(i))), alone(x, w, isa))


@pytest.mark.parametrize("kind", KINDS)
def test_a_stacked_weight_is_read_at_its_layer_index(kind):
    check_stack_read_at_each_layer(
        lambda s: weight(100, 70, seed=s), pack4.pack4, kind, lambda x, w, isa: run(x, w, isa, kind)
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("isa", ISAS)
def test_a_row_has_the_same_bits_alone_or_among_others(isa, kind):
    w = weight(576, 192)  # 3 tiles: 16+ rows are split in groups of 8
    x = np.random.default_rng(1).standard_normal((17, 576)).astype(np.float32)
    together = run(x, w, isa, kind)
    for r in (0, 9, 16):
        assert np.array_equal(run(x[r : r + 1], w, isa, kind)[0], together[r])


@pytest.mark.parametrize(("kind", "bound"), [("w4a16", 1e-4), ("w4a8", 0.015)])
@pytest.mark.parametrize("isa", ISAS)
def test_activation_quantization_error_stays_small_against_the_xla_path(isa, kind, bound):
    """The XLA path multiplies float32 activations: the kernel's int16 blocks cost < 0.01% of it, the
    int8 blocks < 1.5%."""
    w = weight(576, 1536)
    x = np.random.default_rng(2).standard_normal((16, 576)).astype(np.float32)
    exact = np.asarray(jax.jit(grouped_dot)(jnp.asarray(x), jax.tree.map(jnp.asarray, w)), np.float64)
    assert np.allclose(exact, x.astype(np.float64) @ dense64(w), rtol=0, atol=1e-4)
    y = run(x, w, isa, kind).astype(np.float64)
    assert np.linalg.norm(y - exact) / np.linalg.norm(exact) < bound


@pytest.mark.parametrize("kind", KINDS)
def test_a_shape_the_kernel_cannot_read_is_refused(kind):
    w = weight(64, 64)
    packed = pack4.pack4(*map(jnp.asarray, w))
    with pytest.raises(Exception, match=f"hk_{kind}:"):
        jax.block_until_ready(q4ffi.matmul_int4(jnp.ones((2, 100)), *packed, 64, kind, ISAS[0]))
    with pytest.raises(ValueError, match="int4 kernel"):
        q4ffi.matmul_int4(jnp.ones((2, 64)), *packed, 64, "w4a4", ISAS[0])
    assert ffi.cpu_isa() >= 1


def test_the_avx2_path_can_be_forced_on_any_machine(monkeypatch):
    monkeypatch.setenv(dispatch.ISA_ENV, "avx2")
    assert dispatch.machine_isa() == 1 and dispatch.resolve("auto", "int4").isa == 1
    monkeypatch.setenv(dispatch.ISA_ENV, "")
    assert dispatch.machine_isa() == ffi.cpu_isa()
    monkeypatch.setenv(dispatch.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="HKSERVE_KERNEL_ISA"):
        dispatch.machine_isa()


def test_auto_runs_int4_weights_with_int8_activations():
    """auto, w8a8 and w4a8 → hk_w4a8; w8a32, w8a16 and w4a16 (activations kept at 16 bits or more) →
    hk_w4a16; w4a16/w4a8 keep w8a16 for the int8 embeddings."""
    isa = dispatch.machine_isa()
    assert dispatch.resolve("auto", "int4") == dispatch.KernelSpec("w8a16", isa, 0, "w4a8")
    assert dispatch.resolve("w8a32", "int4").int4 == "w4a16"
    assert dispatch.resolve("w8a16", "int4").int4 == "w4a16"
    assert dispatch.resolve("w8a8", "int4") == dispatch.KernelSpec("w8a8", isa, 0, "w4a8")
    assert dispatch.resolve("w4a8", "int4") == dispatch.KernelSpec("w8a16", isa, 0, "w4a8")
    assert dispatch.resolve("w4a16", "int4") == dispatch.KernelSpec("w8a16", isa, 0, "w4a16")


@pytest.mark.parametrize("kind", KINDS)
def test_fused_int4_projections_give_each_projection_its_own_bits(kind):
    """q, k, v packed as one int4 weight (model/packing.fuse) and split after one call give exactly what
    each projection's own call gives, widths not multiples of a tile included."""
    isa, widths, k, layers = ISAS[0], (100, 70, 64), 96, 2
    parts = {}
    for name, n in zip(("q_proj", "k_proj", "v_proj"), widths):
        stack = [pack4.pack4(*map(jnp.asarray, weight(k, n, seed=layer))) for layer in range(layers)]
        parts[f"decoder/layers/attention/{name}"] = dict(zip(("w", "scale", "min"), map(jnp.stack, zip(*stack))))
    fused = fuse(parts)
    assert set(fused) == {"decoder/layers/attention/qkv_proj"}
    fused = fused["decoder/layers/attention/qkv_proj"]
    x = np.random.default_rng(4).standard_normal((5, k)).astype(np.float32)

    def call(part, n, layer):
        w, scale, low = part["w"], part["scale"], part["min"]
        return np.asarray(q4ffi.matmul_int4(x, w, scale, low, n, kind, isa, layer=np.int32(layer)))

    for layer in range(layers):
        y, at = call(fused, fused["w"].shape[1] * 64, layer), 0
        for part, n in zip(parts.values(), widths):
            np.testing.assert_array_equal(y[:, at : at + n], call(part, n, layer))
            at += -(-n // 64) * 64
