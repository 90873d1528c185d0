"""hk_w5sa16 (kernels/q5a16.h) and hk_w5sa8 (q5a8.h): signed 5-bit group weights (model/int4.Int5Sym,
what a GGUF's all-Q5_0 stacks import into, checkpoint/gguf_int4.py) times int16 (per 128)
or int8 (per 32) activation blocks, on both ISA paths, against the float64 product of the kernel's
block-quantized activations and the float64 dequantized weight, within 1e-5 of the sum of the terms'
magnitudes; odd sizes, B in {1, 3, 16, 17}; GGUF Q5_0 weights as imported; a layer stack read at its
index; a row's bits alone and among others; a model whose q/k/v and gate/up are 5-bit groups against the
same exact weights held as signed 8-bit groups (Int8Sym), and (hk_w5sa8) against XLA's float product."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import tiny_config
from test_int4_model import logits
from test_kernels import ISAS, SMOLLM2
from test_q8g_kernels import check_batch_sizes, check_dense, check_gguf_import, mixed_int4

from hkserve.checkpoint.gguf_quant import grouped5
from hkserve.kernels import dispatch, ffi, pack4, q4ffi
from hkserve.model.build import build_model
from hkserve.model.int4 import Int5Sym, Int8Sym, pack_high, pack_nibbles
from hkserve.model.memory import init_memory

ODD = [(100, 70), (33, 129), (200, 1), (64, 65)]
LEVELS = {"w5sa16": (32767, 128), "w5sa8": (127, 32)}  # activation levels, block (test_kernels.quantize_rows)
CASES = [(kind, isa) for kind in LEVELS for isa in ISAS]


def weight(k: int, n: int, seed: int = 0) -> Int5Sym:
    """Random 5-bit groups over the whole range (0 and 31 included) and float16 scales of both signs and
    several binades: K padded to whole groups with zero weights (q = 16)."""
    rng = np.random.default_rng(seed + 3 * k + n)
    kp = -(-k // 32) * 32
    q = rng.integers(0, 32, (kp, n)).astype(np.uint8)
    q[k:] = 16
    q[0, 0], q[1, 0] = 0, 31
    scale = (rng.uniform(1e-4, 4e-3, (kp // 32, n)) * rng.choice([-1, 1], (kp // 32, n))).astype(np.float16)
    return Int5Sym(pack_nibbles(q & 15), pack_high(q), scale)


def dense64(w: Int5Sym) -> np.ndarray:
    from hkserve.model.int4 import unpack_high, unpack_nibbles

    q = unpack_nibbles(w.nibbles).astype(np.int64) + 16 * unpack_high(w.high) - 16
    return q.astype(np.float64) * np.repeat(np.asarray(w.scale, np.float64), 32, 0)


@functools.cache
def kernel(isa: int, n: int, kind: str = "w5sa16"):
    return jax.jit(lambda x, w, h, s: q4ffi.matmul_int5_sym(x, w, h, s, n, isa, kind=kind))


def run(x: np.ndarray, w: Int5Sym, isa: int, kind: str = "w5sa16") -> np.ndarray:
    return np.asarray(kernel(isa, w.scale.shape[-1], kind)(x, *pack4.pack5(*map(jnp.asarray, w))))


def check(y: np.ndarray, x: np.ndarray, w: Int5Sym) -> None:
    check_dense(y, x, dense64(w))


def check8(y: np.ndarray, x: np.ndarray, w: Int5Sym) -> None:
    """hk_w5sa8's y against the float64 product of x's int8 blocks of 32 and the float64 weight."""
    check_dense(y, x, dense64(w), *LEVELS["w5sa8"])


def runner(kind: str):
    """(run, check) of one 5-bit kernel, as check_batch_sizes and check_gguf_import take them."""
    return functools.partial(run, kind=kind), check8 if kind == "w5sa8" else check


@pytest.mark.parametrize(("kind", "isa"), CASES)
@pytest.mark.parametrize("shape", SMOLLM2[:4] + ODD, ids=lambda s: f"{s[0]}x{s[1]}")
def test_kernel_equals_float64_reference(shape, kind, isa):
    check_batch_sizes(weight(*shape), shape[0], *runner(kind), isa)


@pytest.mark.parametrize(("kind", "isa"), CASES)
def test_gguf_q5_0_weights_run_as_imported(kind, isa):
    check_gguf_import(grouped5, Q.Q5_0, *runner(kind), isa)


@pytest.mark.parametrize(("kind", "isa"), CASES)
@pytest.mark.parametrize("q", [0, 31])
def test_extreme_weights_times_extreme_activations_stay_exact(q, kind, isa):
    """Every q at 0 or 31 against activations all at the block's maximum, both signs: hk_w5sa8's int16 sums
    of two quads (4 * 2 * 31 * 127 = 31496) are at their largest; a group's four quads in one int16 would
    wrap (62992 > 2^15)."""
    k, n = 256, 128
    full = np.full((k, n), q, np.uint8)
    w = Int5Sym(pack_nibbles(full & 15), pack_high(full), np.full((k // 32, n), 1e-3, np.float16))
    x = np.concatenate([np.ones((2, k)), -np.ones((2, k))]).astype(np.float32)
    run_kind, check_kind = runner(kind)
    check_kind(run_kind(x, w, isa), x, w)


@pytest.mark.parametrize("kind", LEVELS)
def test_a_stacked_weight_is_read_at_its_layer_index(kind):
    isa = ISAS[0]
    layers = [weight(100, 70, seed=s) for s in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*(pack4.pack5(*map(jnp.asarray, w)) for w in layers))]
    x = np.random.default_rng(0).standard_normal((3, 100)).astype(np.float32)
    call = jax.jit(lambda x, w, h, s, i: q4ffi.matmul_int5_sym(x, w, h, s, 70, isa, layer=i, kind=kind))
    for i, w in enumerate(layers):
        assert np.array_equal(np.asarray(call(x, *stacked, jnp.int32(i))), run(x, w, isa, kind))


@pytest.mark.parametrize(("kind", "isa"), CASES)
def test_a_row_has_the_same_bits_alone_or_among_others(kind, isa):
    w = weight(576, 192)  # 3 tiles: 16+ rows are split in groups of 8
    x = np.random.default_rng(1).standard_normal((17, 576)).astype(np.float32)
    together = run(x, w, isa, kind)
    for r in (0, 9, 16):
        assert np.array_equal(run(x[r : r + 1], w, isa, kind)[0], together[r])


def test_an_unknown_5_bit_kernel_is_refused():
    packed = pack4.pack5(*map(jnp.asarray, weight(64, 64)))
    with pytest.raises(ValueError, match="5-bit kernel"):
        q4ffi.matmul_int5_sym(jnp.ones((2, 64)), *packed, 64, ISAS[0], kind="w5sa4")


@pytest.mark.parametrize("isa", ISAS)
def test_5_bit_groups_take_int8_activations_where_int4_does(isa):
    """auto, w8a8 and w4a8 (int4 on hk_w4a8) → hk_w5sa8; w8a32, w8a16 and w4a16 → hk_w5sa16, on either path."""
    for requested, int5 in (("auto", "w5sa8"), ("w8a8", "w5sa8"), ("w4a8", "w5sa8"), ("w8a16", "w5sa16")):
        assert dispatch.resolve(requested, "int4")._replace(isa=isa).int5 == int5
    assert dispatch.resolve("w8a32", "int4").int5 == dispatch.resolve("w4a16", "int4").int5 == "w5sa16"


@pytest.mark.parametrize("wrong", ["w", "high"])
def test_a_layout_of_other_sizes_is_refused(wrong):
    """Int8Sym's packed weight (2048 bytes a tile and group) as w, or a high plane of another size."""
    packed, high, scale = pack4.pack5(*map(jnp.asarray, weight(64, 64)))
    call = jax.ffi.ffi_call(q4ffi.SYM5[0], jax.ShapeDtypeStruct((2, 64), jnp.float32))
    if wrong == "w":
        packed = jnp.zeros((*packed.shape[:-1], 2048), jnp.uint8)
    else:
        high = high[..., :128]
    with pytest.raises(Exception, match="hk_w5sa16:"):
        x = jnp.ones((2, 64))
        jax.block_until_ready(call(x, packed, high, scale, jnp.int32(0), isa=np.int64(ISAS[0]), threads=0))


FIVE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # Gemma 3 270M's Q5_0 stacks


def same_weights(w: np.ndarray) -> tuple[Int5Sym, Int8Sym]:
    """Float [..., K, N] → one 5-bit quantization (absmax / 15 per group, q in -16..15) as Int5Sym and as
    Int8Sym: the same exact weights in both forms."""
    *lead, k, n = w.shape
    g = np.asarray(w, np.float32).reshape(*lead, k // 32, 32, n)
    scale = (np.abs(g).max(-2) / 15).astype(np.float16)
    safe = np.where(scale == 0, 1, scale).astype(np.float32)[..., None, :]
    q = np.clip(np.rint(g / safe), -16, 15).astype(np.int8).reshape(w.shape)
    q5 = (q.astype(np.int16) + 16).astype(np.uint8)
    return Int5Sym(pack_nibbles(q5 & 15), pack_high(q5), scale), Int8Sym(q, scale)


def forms():
    """(config, params) of one tiny int4 model with FIVE as 5-bit groups, and as signed 8-bit groups."""
    config, params = mixed_int4(tied=True)  # down_proj 8-bit groups with a min, o_proj int4
    master = jax.tree_util.tree_map(
        np.asarray, build_model(tiny_config(dim=96, ffn_dim=160)).init(jax.random.PRNGKey(1))
    )
    p5, p8 = dict(params), dict(params)
    for module in params:
        if module.rsplit("/", 1)[-1] in FIVE:
            five, eight = same_weights(master[module]["w"])
            p5[module] = dict(zip(("w", "high", "scale"), five))
            p8[module] = dict(zip(("w", "scale"), eight))
    config = config.replace(int8_linears=tuple(n for n in config.int8_linears if n not in FIVE))
    return (config.replace(int5_linears=FIVE), p5), (config.replace(int8_sym_linears=FIVE), p8)


def kernel_logits(config, params, path: str, tokens: np.ndarray) -> tuple[np.ndarray, str]:
    """The model's logits through the kernels of `path` (dispatch.resolve), and its compiled HLO text."""
    model = build_model(config, dispatch.resolve(path, "int4"))
    packed = jax.jit(model.prepare)(params)
    for fused in ("attention/qkv_proj", "mlp/gate_up_proj"):
        assert ("high" in packed[f"decoder/layers/{fused}"]) == bool(config.int5_linears)
    memory, lengths = init_memory(config, tokens.shape[0], 32), np.full(tokens.shape[0], tokens.shape[1])
    forward = jax.jit(model.forward)
    text = forward.lower(packed, tokens, memory, lengths).as_text()
    return np.asarray(forward(packed, tokens, memory, lengths)[0]), text


@pytest.mark.parametrize("path", ["w4a16", "xla"])
def test_a_model_on_5_bit_stacks_equals_the_same_weights_as_signed_8_bit_groups(path):
    """The same exact weights give the same logits, bit for bit, and so the same greedy tokens: through the
    kernels with int16 activations hk_w5sa16's integer sums (sum q x - 16 sum x) equal hk_w8sa16's
    (sum (q - 16) x) and the float step is the same (fused q/k/v and gate/up in both); through XLA the
    dequantized weights are equal."""
    (c5, p5), (c8, p8) = forms()
    tokens = np.random.default_rng(0).integers(0, 128, (3, 5)).astype(np.int32)
    if path == "xla":
        got, want = logits(c5, p5, tokens), logits(c8, p8, tokens)
    else:
        (got, text), (want, _) = kernel_logits(c5, p5, path, tokens), kernel_logits(c8, p8, path, tokens)
        assert q4ffi.SYM5[0] in text
    assert np.array_equal(got, want)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("isa", ISAS)
def test_a_model_on_5_bit_stacks_runs_int8_activations_under_auto(isa, monkeypatch):
    """auto runs the 5-bit stacks through hk_w5sa8 (the compiled step names it): their logits follow XLA's
    float product of the same weights within 1% (L2) with the same greedy tokens, and the int16 kernel's
    within the same bound; the int8 activations are the only difference."""
    monkeypatch.setenv(dispatch.ISA_ENV, ffi.ISA_NAMES[isa])
    (c5, p5), _ = forms()
    tokens = np.random.default_rng(0).integers(0, 128, (3, 5)).astype(np.int32)
    got, text = kernel_logits(c5, p5, "auto", tokens)
    assert q4ffi.INT5["w5sa8"][0] in text and q4ffi.SYM5[0] not in text
    for want in (logits(c5, p5, tokens), kernel_logits(c5, p5, "w4a16", tokens)[0]):
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01
        assert np.array_equal(got.argmax(-1), want.argmax(-1))
