"""hk_w8sa16 (kernels/q8a16.h's A8S): signed 8-bit group weights without a min (model/int4.Int8Sym, what
a GGUF's Q4_0/Q5_0/Q8_0 stacks import into, checkpoint/gguf_int4.py) times int16 activation blocks, on
both ISA paths, against the float64 product of the kernel's block-quantized activations and the float64
dequantized weight, within 1e-5 of the sum of the terms' magnitudes; odd sizes, B in {1, 3, 16, 17};
GGUF weights as imported; a layer stack read at its index; a row's bits alone and among others; XLA's
grouped dot against the same float64 reference; an int4 model holding signed 8-bit stacks (its
int8_sym_linears; fused q/k/v and gate/up) through the kernels against the same model through XLA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_config
from test_int4_model import logits
from test_kernels import ISAS, SMOLLM2
from test_q8g_kernels import check_batch_sizes, check_dense, check_gguf_import, mixed_int4

from hkserve.checkpoint.gguf_quant import SYM8, grouped8_sym
from hkserve.kernels import dispatch, pack4, q4ffi
from hkserve.model.build import build_model
from hkserve.model.int4 import Int8Sym, grouped_dot
from hkserve.model.memory import init_memory

ODD = [(100, 70), (33, 129), (200, 1), (64, 65)]


def weight(k: int, n: int, seed: int = 0) -> Int8Sym:
    """Random signed groups over the whole int8 range (-128 and 127 included) and float16 scales of
    both signs and several binades: K padded to whole groups with zero weights."""
    rng = np.random.default_rng(seed + 3 * k + n)
    kp = -(-k // 32) * 32
    q = rng.integers(-128, 128, (kp, n)).astype(np.int8)
    q[k:] = 0
    q[0, 0], q[1, 0] = -128, 127
    scale = (rng.uniform(1e-4, 4e-3, (kp // 32, n)) * rng.choice([-1, 1], (kp // 32, n))).astype(np.float16)
    return Int8Sym(q, scale)


def dense64(w: Int8Sym) -> np.ndarray:
    return np.asarray(w.q, np.float64) * np.repeat(np.asarray(w.scale, np.float64), 32, 0)


@functools.cache
def kernel(isa: int, n: int):
    return jax.jit(lambda x, w, s: q4ffi.matmul_int8_sym(x, w, s, n, isa))


def run(x: np.ndarray, w: Int8Sym, isa: int) -> np.ndarray:
    return np.asarray(kernel(isa, w.q.shape[-1])(x, *pack4.pack8_sym(*map(jnp.asarray, w))))


def check(y: np.ndarray, x: np.ndarray, w: Int8Sym) -> None:
    check_dense(y, x, dense64(w))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SMOLLM2[:4] + ODD, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_float64_reference(shape, isa):
    check_batch_sizes(weight(*shape), shape[0], run, check, isa)


@pytest.mark.parametrize("qtype", list(SYM8), ids=lambda q: q.name)
@pytest.mark.parametrize("isa", ISAS)
def test_gguf_weights_run_as_imported(isa, qtype):
    check_gguf_import(grouped8_sym, qtype, run, check, isa)


@pytest.mark.parametrize("shape", [(100, 70), (33, 129)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_xla_grouped_dot_equals_float64_reference(shape):
    """The fallback (non-CPU backends, --kernels xla): float32 activations, so the reference is the
    float64 product of the float32 rows, within float32 accumulation."""
    k, n = shape
    w = weight(k, n, seed=2)
    x = np.random.default_rng(3).standard_normal((17, k)).astype(np.float32)
    y = np.asarray(jax.jit(grouped_dot)(jnp.asarray(x), jax.tree.map(jnp.asarray, w)), np.float64)
    wd = dense64(w)[:k]
    assert np.all(np.abs(y - x @ wd) <= 1e-5 * (np.abs(x) @ np.abs(wd)) + 1e-30)


def test_a_stacked_weight_is_read_at_its_layer_index():
    isa = ISAS[0]
    layers = [weight(100, 70, seed=s) for s in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*(pack4.pack8_sym(*map(jnp.asarray, w)) for w in layers))]
    x = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    call = jax.jit(lambda x, w, s, i: q4ffi.matmul_int8_sym(x, w, s, 70, isa, layer=i))
    for i, w in enumerate(layers):
        assert np.array_equal(np.asarray(call(x, *stacked, jnp.int32(i))), run(x, w, isa))


@pytest.mark.parametrize("isa", ISAS)
def test_a_row_has_the_same_bits_alone_or_among_others(isa):
    w = weight(576, 192)  # 3 tiles: 16+ rows are split in groups of 8
    x = np.random.default_rng(1).standard_normal((17, 576)).astype(np.float32)
    together = run(x, w, isa)
    for r in (0, 9, 16):
        assert np.array_equal(run(x[r : r + 1], w, isa)[0], together[r])


def test_a_float32_scale_layout_is_refused():
    """The packed weight of Int8Group (float32 scale and min) does not fit hk_w8sa16's operands."""
    packed, scale = pack4.pack8_sym(*map(jnp.asarray, weight(64, 64)))
    call = jax.ffi.ffi_call(q4ffi.SYM[0], jax.ShapeDtypeStruct((2, 64), jnp.float32))
    with pytest.raises(Exception, match="hk_w8sa16:"):
        x = jnp.ones((2, 64))
        jax.block_until_ready(call(x, packed[..., :1024], scale, jnp.int32(0), isa=np.int64(ISAS[0]), threads=0))


def absmax_sym(w: np.ndarray) -> Int8Sym:
    """Float [..., K, N] → signed 8-bit groups by absmax / 127 per group (a float16 scale): test weights."""
    *lead, k, n = w.shape
    g = np.asarray(w, np.float32).reshape(*lead, k // 32, 32, n)
    scale = (np.abs(g).max(-2) / 127).astype(np.float16)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)[..., None, :]
    return Int8Sym(np.clip(np.rint(g / safe), -127, 127).astype(np.int8).reshape(w.shape), scale)


@pytest.mark.parametrize(
    "sym", [("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), ("k_proj",)], ids=["fused", "alone"]
)
def test_an_int4_model_with_signed_8_bit_stacks_through_the_kernels_follows_xla(sym):
    """Kernel mode: the signed 8-bit stacks run hk_w8sa16 in the layer stack, fused with each other
    (Gemma's q/k/v and gate/up) but never with another form (k alone between int4 q and 8-bit v); the
    8-bit down_proj hk_w8ga16; against the same params through XLA's grouped dots."""
    config, params = mixed_int4(tied=True)  # v_proj and down_proj 8-bit groups with a min
    base = tiny_config(dim=96, ffn_dim=160, tie_embeddings=True)
    master = jax.tree_util.tree_map(np.asarray, build_model(base).init(jax.random.PRNGKey(1)))
    for module in params:
        if module.rsplit("/", 1)[-1] in sym:
            params[module] = dict(zip(("w", "scale"), absmax_sym(master[module]["w"])))
    eight = tuple(n for n in config.int8_linears if n not in sym)
    config = config.replace(int8_linears=eight, int8_sym_linears=tuple(sorted(sym)))
    # w4a16: the int16 activations this 2e-3 bound was set for (auto's hk_w4a8 rounds them to int8 per 32)
    model = build_model(config, dispatch.resolve("w4a16", "int4"))
    packed = jax.jit(model.prepare)(params)
    layers = "decoder/layers/"
    if len(sym) > 1:
        assert packed[layers + "attention/qkv_proj"]["scale"].dtype == np.float16
        assert packed[layers + "mlp/gate_up_proj"]["scale"].dtype == np.float16
    else:
        assert packed[layers + "attention/k_proj"]["scale"].dtype == np.float16
        assert packed[layers + "attention/q_proj"]["w"].shape[-1] == 1024
        assert packed[layers + "attention/v_proj"]["min"].dtype == np.float32
    tokens = np.random.default_rng(0).integers(0, 128, (3, 5)).astype(np.int32)
    got = np.asarray(jax.jit(model.forward)(packed, tokens, init_memory(config, 3, 32), np.full(3, 5))[0])
    want = logits(config, params, tokens)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-3
