"""VQ memory helpers: one interface (init / insert / reset) for KV and VQ memory; float32 aggregates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import tiny_config, tiny_vq_config

from hkserve.model.memory import KVMemory, init_memory, insert_slot, reset_slot
from hkserve.model.vq_memory import GAUState, VQMemory, advance

CONFIG = tiny_vq_config()


def filled(memory: VQMemory, seed: int) -> VQMemory:
    """Random non-empty contents in every field."""
    rng = np.random.default_rng(seed)
    return VQMemory(
        *(
            jnp.asarray(rng.integers(1, 5, a.shape) if a.dtype == jnp.int32 else rng.random(a.shape), a.dtype)
            for a in memory
        )
    )


def test_init_memory_dispatches_on_the_config_and_keeps_aggregates_float32():
    memory = init_memory(CONFIG, 3, 1024)
    assert isinstance(memory, VQMemory)
    g, h, m, s, dv = 2 * CONFIG.n_layers, CONFIG.n_heads, CONFIG.vq_mem_len, CONFIG.vq_codes, CONFIG.vq_value_dim
    assert memory.z_win.shape == (g, 3, h, m) and (np.asarray(memory.z_win) == s).all()  # S = empty
    assert memory.v_win.shape == (g, 3, h, m, dv) and memory.u_mean.shape == (g, 3, h, s, dv)
    bf16 = init_memory(CONFIG.replace(dtype="bfloat16"), 2, 0)
    assert bf16.v_win.dtype == jnp.bfloat16 and bf16.n.dtype == bf16.u_mean.dtype == jnp.float32
    assert isinstance(init_memory(tiny_config(), 2, 8), KVMemory)


def test_insert_slot_and_reset_slot_touch_only_their_slot():
    batch = filled(init_memory(CONFIG, 4, 0), 0)
    single = filled(init_memory(CONFIG, 1, 0), 1)
    moved = jax.jit(insert_slot)(batch, single, 2)
    for got, before, placed in zip(moved.layers, batch.layers, single.layers):
        np.testing.assert_array_equal(got[:, 2], placed[:, 0])
        np.testing.assert_array_equal(np.delete(np.asarray(got), 2, axis=1), np.delete(np.asarray(before), 2, axis=1))
    np.testing.assert_array_equal(moved.step, [batch.step[0], batch.step[1], single.step[0], batch.step[3]])
    empty, cleared = init_memory(CONFIG, 4, 0), jax.jit(reset_slot)(moved, 2)
    for got, want, before in zip(cleared, empty, moved):
        got, want, before = (np.moveaxis(np.asarray(a), 0 if a.ndim == 1 else 1, 0) for a in (got, want, before))
        np.testing.assert_array_equal(got[2], want[2])
        np.testing.assert_array_equal(np.delete(got, 2, axis=0), np.delete(before, 2, axis=0))
    kv = init_memory(tiny_config(), 3, 8)._replace(step=jnp.asarray([5, 6, 7], jnp.int32))
    np.testing.assert_array_equal(reset_slot(kv, 1).step, [5, 0, 7])


def test_advance_folds_the_oldest_entries_into_exact_counts_and_means():
    """Window M=4 holding codes 0..3 (values 10..13), block of codes [1, 1, 2] with 2 real tokens."""
    z_win = jnp.asarray([[[0, 1, 2, 3]]], jnp.int32)  # [B=1, H=1, M]
    v_win = jnp.arange(10.0, 14.0).reshape(1, 1, 4, 1)
    n = jnp.asarray([[[0.0, 2.0, 0.0, 0.0, 0.0]]])  # S = 5; code 1 already seen twice with mean 4
    u_mean = jnp.asarray([[[[0.0], [4.0], [0.0], [0.0], [0.0]]]])
    new = jax.jit(advance)(
        GAUState(z_win, v_win, n, u_mean),
        jnp.asarray([[[1, 1, 2]]], jnp.int32),
        jnp.asarray([[[[20.0], [21.0], [99.0]]]]),
        jnp.asarray([2], jnp.int32),
    )
    np.testing.assert_array_equal(new.z_win, [[[2, 3, 1, 1]]])  # the last M real tokens
    np.testing.assert_array_equal(new.v_win[..., 0], [[[12.0, 13.0, 20.0, 21.0]]])
    np.testing.assert_array_equal(new.n, [[[1.0, 3.0, 0.0, 0.0, 0.0]]])  # codes 0 and 1 left the window
    np.testing.assert_allclose(new.u_mean[..., 0], [[[10.0, (2 * 4.0 + 11.0) / 3, 0.0, 0.0, 0.0]]])
