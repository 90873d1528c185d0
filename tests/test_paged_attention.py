"""Paged KV memory on the model side (hkserve/model/paged_memory.py, the paged decode-attention kernel):
the kernel through block tables against a float64 reference and against the static kernel, and the
model's logits on a paged memory (XLA gather and CPU kernel) bit-equal to the static memory's."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config
from test_attention_kernel import bf16_rounded, reference

from hkserve.checkpoint.quantize import convert_params
from hkserve.kernels import dispatch, ffi
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory
from hkserve.model.paged_memory import init_paged_memory


def paged_copy(k_mem: np.ndarray, bs: int, extra: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """Static memory [L, B, S, H, D] → the same positions in a pool of shuffled blocks (plus `extra`
    blocks of noise no row holds) [L, NB, bs, H, D], and the rows' table [B, ceil(S / bs)]."""
    layers, rows, positions, heads, dim = k_mem.shape
    mb = -(-positions // bs)
    nb = rows * mb + extra
    order = rng.permutation(nb)[: rows * mb].reshape(rows, mb).astype(np.int32)
    pool = rng.standard_normal((layers, nb, bs, heads, dim)).astype(np.float32)
    padded = np.zeros((layers, rows, mb * bs, heads, dim), np.float32)
    padded[:, :, :positions] = k_mem
    for b in range(rows):
        for j in range(mb):
            pool[:, order[b, j]] = padded[:, b, j * bs : (j + 1) * bs]
    return pool, order


@pytest.mark.parametrize(
    ("groups", "dim", "window", "cap", "bs"), [(1, 16, 0, 0.0, 16), (3, 64, 0, 0.0, 5), (2, 32, 5, 30.0, 7)]
)
def test_paged_decode_attention_equals_float64_reference_and_the_static_kernel(groups, dim, window, cap, bs):
    rng = np.random.default_rng(groups + dim + bs)
    layers, rows, heads, positions = 3, 5, 2, 40
    past_len = np.asarray([0, 1, 7, 39, 40], np.int32)  # empty, one, some, all but one, all
    q = rng.standard_normal((rows, heads, groups, dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, heads, dim)).astype(np.float32) for _ in range(2))
    k_mem, v_mem = (rng.standard_normal((layers, rows, positions, heads, dim)).astype(np.float32) for _ in range(2))
    k_pool, table = paged_copy(k_mem, bs, 3, np.random.default_rng(1))
    v_pool, same = paged_copy(v_mem, bs, 3, np.random.default_rng(1))
    assert (table == same).all()
    paged = jax.jit(lambda *a: ffi.decode_attention(*a[:-1], cap=cap, table=a[-1]))
    static = jax.jit(lambda *a: ffi.decode_attention(*a, cap=cap))
    for layer in range(layers):
        y = np.asarray(paged(q, k_new, v_new, k_pool, v_pool, np.int32(layer), past_len, np.int32(window), table))
        want = reference(q, k_new, v_new, k_mem, v_mem, layer, past_len, window, cap)
        np.testing.assert_allclose(y, want, atol=2e-6, rtol=1e-5)
        mine = static(q, k_new, v_new, k_mem, v_mem, np.int32(layer), past_len, np.int32(window))
        np.testing.assert_array_equal(y, np.asarray(mine))  # one arithmetic path: the same bits
    outside = table.copy()
    outside[3, 2] = k_pool.shape[1]  # a block row 3 can see, outside the pool
    with pytest.raises(Exception, match="outside the pool"):
        paged(q, k_new, v_new, k_pool, v_pool, np.int32(0), past_len, np.int32(window), outside).block_until_ready()
    unseen = table.copy()
    unseen[1, 1:] = k_pool.shape[1]  # row 1 sees position 0 only: the blocks after it are never read
    y = paged(q, k_new, v_new, k_pool, v_pool, np.int32(0), past_len, np.int32(window), unseen)
    np.testing.assert_array_equal(
        np.asarray(y),
        np.asarray(paged(q, k_new, v_new, k_pool, v_pool, np.int32(0), past_len, np.int32(window), table)),
    )


@pytest.mark.parametrize(("dim", "bs", "window"), [(48, 5, 0), (32, 7, 6)])
def test_paged_bf16_pool_equals_float64_reference_and_the_static_bf16_kernel(dim, bs, window):
    """A bf16 pool (--kv-dtype bf16) read through the table: the float64 reference of the rounded memory,
    and the static bf16 kernel's bits (one arithmetic path whatever the layout and the memory's dtype)."""
    rng = np.random.default_rng(dim + bs)
    layers, rows, heads, groups, positions = 2, 5, 2, 3, 37
    past_len = np.asarray([0, 1, 7, 36, 37], np.int32)
    q = rng.standard_normal((rows, heads, groups, dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, heads, dim)).astype(np.float32) for _ in range(2))
    k_mem, v_mem = (rng.standard_normal((layers, rows, positions, heads, dim)).astype(np.float32) for _ in range(2))
    k_pool, table = paged_copy(k_mem, bs, 3, np.random.default_rng(1))
    v_pool, _ = paged_copy(v_mem, bs, 3, np.random.default_rng(1))
    paged = jax.jit(lambda *a: ffi.decode_attention(*a[:-1], table=a[-1]))
    static = jax.jit(ffi.decode_attention)
    bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    for layer in range(layers):
        at = (np.int32(layer), past_len, np.int32(window))
        y = np.asarray(paged(q, k_new, v_new, bf16(k_pool), bf16(v_pool), *at, table))
        want = reference(q, k_new, v_new, bf16_rounded(k_mem), bf16_rounded(v_mem), layer, past_len, window, 0.0)
        np.testing.assert_allclose(y, want, atol=2e-6, rtol=1e-5)
        np.testing.assert_array_equal(y, np.asarray(static(q, k_new, v_new, bf16(k_mem), bf16(v_mem), *at)))


def _steps(config, params, kernels, memory, slots=None):
    """Prefill two rows of different lengths (into `slots` of the memory), then 5 one-token steps of
    every slot: the logits of each call."""
    model = build_model(config, kernels)
    p = jax.jit(model.prepare)(params) if model.prepare is not None else params
    forward = jax.jit(model.forward, static_argnames=("attend_len", "last_only"))
    prompt = np.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 12)), np.int32)
    rows = None if slots is None else np.asarray(slots, np.int32)
    logits, memory = forward(p, prompt, memory, np.asarray([12, 9], np.int32), rows, attend_len=0)
    out = [np.asarray(logits)]
    b = memory.step.shape[0]
    for step in range(5):
        token = np.full((b, 1), 3 + step, np.int32)
        logits, memory = forward(p, token, memory, np.ones(b, np.int32), attend_len=32)
        out.append(np.asarray(logits))
    return out


CONFIGS = {
    "gqa": tiny_config(),
    "sliding-capped": tiny_config(sliding_window=3, sliding_layers=(True, False), attn_logit_cap=30.0),
}


def _paged(config, batch: int, bs: int, tables: np.ndarray):
    memory = init_paged_memory(config, batch, 2 * tables.size, bs, 32)
    return memory._replace(table=jax.numpy.asarray(tables, jax.numpy.int32))


@pytest.mark.parametrize(
    ("name", "kv"), [("gqa", "float32"), ("sliding-capped", "float32"), ("sliding-capped", "bfloat16")]
)
@pytest.mark.parametrize("path", ["xla", "kernels", "kernels-f32"])
def test_model_on_a_paged_memory_equals_the_static_memory(name, path, kv):
    """Same logits, bit for bit, through prefill (a scatter by block table) and decode steps (a gather,
    or the kernel through the table): block size 5 (not dividing the window), shuffled blocks; a bf16
    memory (--kv-dtype bf16) on either layout too."""
    config = CONFIGS[name].replace(kv_dtype=kv)
    f32 = jax.tree_util.tree_map(np.asarray, init_params(config, 5))
    kernels = None
    if path == "kernels":
        config, f32 = convert_params(f32, config, "int8")
    if path in ("kernels", "kernels-f32"):  # kernels-f32: float weights, the attention-only spec
        kernels = dispatch.resolve("auto", config.dtype)
        assert kernels is not None
    static = _steps(config, f32, kernels, init_memory(config, 2, 32))
    tables = np.random.default_rng(3).permutation(2 * 7 * 2)[:14].reshape(2, 7)  # 7 blocks of 5 hold 32
    paged = _steps(config, f32, kernels, _paged(config, 2, 5, tables))
    for a, b in zip(static, paged, strict=True):
        np.testing.assert_array_equal(a, b)
