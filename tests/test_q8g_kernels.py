"""hk_w8ga16 (kernels/q8a16.h): 8-bit group weights (model/int4.Int8Group: what a GGUF mix's Q5_0/Q5_K/
Q8_0 stacks import into, checkpoint/gguf_int4.py) times int16 activation blocks, on both ISA paths,
against the float64 product of the kernel's block-quantized activations and the float64 dequantized
weight, within 1e-5 of the sum of the terms' magnitudes; odd sizes, B in {1, 3, 16, 17}; a layer stack
read at its index; a row's bits alone and among others; an int4 model holding 8-bit stacks (its
int8_linears) through the kernels against the same model through XLA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import init_params, tiny_config
from test_int4 import source
from test_int4_model import logits
from test_kernels import ISAS, SMOLLM2, quantize_rows
from test_q4_kernels import check_stack_read_at_each_layer

from hkserve.checkpoint.gguf_quant import grouped8
from hkserve.checkpoint.quantize import convert_params
from hkserve.kernels import dispatch, pack4, q4ffi
from hkserve.model.build import build_model
from hkserve.model.int4 import Int8Group, quantize_int8_groups
from hkserve.model.memory import init_memory

ODD = [(100, 70), (33, 129), (200, 1), (64, 65)]
KIND = q4ffi.EIGHT_BIT


def weight(k: int, n: int, seed: int = 0) -> Int8Group:
    """Random 8-bit group weight whose groups have mins well off zero (the min term matters)."""
    rng = np.random.default_rng(seed + 3 * k + n)
    w = rng.standard_normal((k, n)).astype(np.float32) * 0.05 + rng.uniform(-0.1, 0.1, (1, n)).astype(np.float32)
    return quantize_int8_groups(w)


def dense64(w: Int8Group) -> np.ndarray:
    q = np.asarray(w.q, np.float64)
    return q * np.repeat(np.asarray(w.scale, np.float64), 32, 0) + np.repeat(np.asarray(w.min, np.float64), 32, 0)


@functools.cache
def kernel(isa: int, n: int):
    return jax.jit(lambda x, w, s, m: q4ffi.matmul_int4(x, w, s, m, n, KIND, isa))


def run(x: np.ndarray, w: Int8Group, isa: int) -> np.ndarray:
    return np.asarray(kernel(isa, w.q.shape[-1])(x, *pack4.pack8(*map(jnp.asarray, w))))


def check_dense(y: np.ndarray, x: np.ndarray, dense: np.ndarray, levels: int = 32767, block: int = 128) -> None:
    """y against the float64 product of x's quantized blocks (int16 per 128 unless told) and the float64
    weight `dense` [K_pad, N]."""
    xs, wd = quantize_rows(x, levels, block), dense[: x.shape[1]]
    ref, bound = xs @ wd, 1e-5 * (np.abs(xs) @ np.abs(wd)) + 1e-30
    err = np.abs(np.asarray(y, np.float64) - ref)
    assert np.all(err <= bound), f"max error {err.max():.3g} over bound {(err / bound).max():.3g}x"


def check(y: np.ndarray, x: np.ndarray, w: Int8Group) -> None:
    check_dense(y, x, dense64(w))


def check_batch_sizes(w, k: int, run, check, isa: int) -> None:
    """`run(x, w, isa)` for x [B, k], B in {1, 3, 16, 17}: its shape, and `check(y, x, w)`."""
    for m in (1, 3, 16, 17):
        x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
        y = run(x, w, isa)
        assert y.shape == (m, w.scale.shape[-1])  # every grouped form's scale is [..., K/32, N]
        check(y, x, w)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SMOLLM2[:4] + ODD, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_float64_reference(shape, isa):
    check_batch_sizes(weight(*shape), shape[0], run, check, isa)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q8_0, Q.Q5_K], ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ISAS)
def test_gguf_weights_run_as_imported(isa, qtype):
    check_gguf_import(grouped8, qtype, run, check, isa)


def check_gguf_import(import_tensor, qtype, run, check, isa: int) -> None:
    """A [96, 512] GGUF tensor of `qtype` as `import_tensor` maps it, through the kernel `run` at 17 rows,
    against `check`'s float64 reference of that import."""
    shape = (96, 512)  # [out, in]
    w = import_tensor(source(qtype, shape, seed=5), qtype, shape)
    x = np.random.default_rng(6).standard_normal((17, 512)).astype(np.float32)
    check(run(x, w, isa), x, w)


def test_a_stacked_weight_is_read_at_its_layer_index():
    check_stack_read_at_each_layer(lambda s: weight(100, 70, seed=s), pack4.pack8, KIND, run)


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_has_the_same_bits_alone_or_among_others(isa):
    w = weight(576, 192)
    x = np.random.default_rng(1).standard_normal((17, 576)).astype(np.float32)
    together = run(x, w, isa)
    for r in (0, 9, 16):
        assert np.array_equal(run(x[r : r + 1], w, isa)[0], together[r])


def test_an_int4_packed_weight_is_refused_by_the_8_bit_kernel():
    from test_q4_kernels import weight as int4_weight

    packed = pack4.pack4(*map(jnp.asarray, int4_weight(64, 64)))
    with pytest.raises(Exception, match="hk_w8ga16:"):
        jax.block_until_ready(q4ffi.matmul_int4(jnp.ones((2, 64)), *packed, 64, KIND, ISAS[0]))


def mixed_int4(tied: bool):
    """A tiny int4 model whose v_proj, down_proj (and untied head) are 8-bit groups, as a GGUF mix's."""
    base = tiny_config(dim=96, ffn_dim=160, tie_embeddings=tied)
    master = jax.tree_util.tree_map(np.asarray, init_params(base, 1))
    config, params = convert_params(master, base, "int4")
    eight = ("v_proj", "down_proj") + (() if tied else ("lm_head",))
    for module in params:
        if module.rsplit("/", 1)[-1] in eight:
            params[module] = dict(zip(("w", "scale", "min"), quantize_int8_groups(master[module]["w"])))
    return config.replace(int8_linears=eight), params


@pytest.mark.parametrize("tied", [False, True])
def test_an_int4_model_with_8_bit_stacks_through_the_kernels_follows_xla(tied):
    """Kernel mode: the 8-bit stacks run hk_w8ga16 in the layer stack (read in place, not fused with the
    int4 q and k), the int4 ones hk_w4a16; against the same params through XLA's grouped dots."""
    config, params = mixed_int4(tied)
    model = build_model(config, dispatch.resolve("w4a16", "int4"))
    packed = jax.jit(model.prepare)(params)
    assert packed["decoder/layers/attention/v_proj"]["w"].shape[-1] == 2048
    assert packed["decoder/layers/attention/q_proj"]["w"].shape[-1] == 1024
    assert packed["decoder/layers/mlp/down_proj"]["w"].shape[-1] == 2048
    tokens = np.random.default_rng(0).integers(0, 128, (3, 5)).astype(np.int32)
    got = np.asarray(jax.jit(model.forward)(packed, tokens, init_memory(config, 3, 32), np.full(3, 5))[0])
    want = logits(config, params, tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
