"""The Transformer-VQ decoder: serving through build_model (prefill into slots, decode, reset) equals one
long forward; training blocks equal serving; the codebook moves only by its EMA, never by gradients."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import tiny_vq_config

from hkserve.model.build import build_model, param_shapes
from hkserve.model.memory import init_memory, reset_slot
from hkserve.model.sharding import param_specs, parse_mesh
from hkserve.model.vq_model import (
    POSITION_KEYS,
    ema_update,
    init_train,
    serving_params,
    split_serving_params,
    train_forward,
)

TOL = 1e-5  # atol; with RTOL, since tied N(0,1) embeddings give logits of magnitude ~40
RTOL = 1e-5
CONFIG = tiny_vq_config()
BUCKET = 16


def random_params(seed: int) -> dict:
    """A serving tree with every ingredient non-trivial (u, v', norm gains and biases, output bias,
    codebook), drawn in numpy: no init compile."""
    rng = np.random.default_rng(seed)

    def draw(name, shape):
        if name == "c_count":
            return rng.uniform(0.5, 4.0, shape)
        if name == "scale":
            return 1 + 0.3 * rng.standard_normal(shape)
        if name in ("xl_u", "xl_v", "bias", "b", "c_sum", "embeddings"):
            return (1.0 if name == "embeddings" else 0.5) * rng.standard_normal(shape)
        return rng.standard_normal(shape) * shape[-2] ** -0.5  # [.., in, out] projections

    return {
        module: {name: draw(name, a.shape).astype(np.float32) for name, a in names.items()}
        for module, names in param_shapes(CONFIG).items()
    }


@functools.cache
def setup():
    model = build_model(CONFIG)
    forward = jax.jit(model.forward, static_argnums=(5, 6))
    return model, random_params(1), forward


def slot_of(memory, slot: int) -> list[np.ndarray]:
    """Every field of one slot: step[slot] and the [G, slot] rows of the state."""
    return [np.asarray(memory.step[slot])] + [np.asarray(a[:, slot]) for a in memory.layers]


def full_logits(seqs: list[list[int]]) -> np.ndarray:
    """Reference: every sequence in one forward on an empty memory. [N, BUCKET, V]"""
    _, params, forward = setup()
    tokens = np.zeros((len(seqs), BUCKET), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.asarray([len(s) for s in seqs], np.int32)
    logits, _ = forward(params, tokens, init_memory(CONFIG, len(seqs), 0), lengths, None, None, False)
    return np.asarray(logits)


def prefill(memory, seq, slot):
    _, params, forward = setup()
    tokens = np.zeros((1, BUCKET), np.int32)
    tokens[0, : len(seq)] = seq
    return forward(params, tokens, memory, np.asarray([len(seq)], np.int32), np.asarray([slot], np.int32), None, True)


def test_prefill_into_slots_then_decode_equals_one_long_forward():
    _, params, forward = setup()
    rng = np.random.default_rng(0)
    prompt_lens, steps = [5, 9, 13], 3
    seqs = [rng.integers(0, CONFIG.vocab_size, n + steps).tolist() for n in prompt_lens]
    want = full_logits(seqs)
    memory = init_memory(CONFIG, len(seqs), 0)
    for slot, (seq, n) in enumerate(zip(seqs, prompt_lens)):
        logits, memory = prefill(memory, seq[:n], slot)
        np.testing.assert_allclose(logits[0], want[slot, n - 1], atol=TOL, rtol=RTOL)
    np.testing.assert_array_equal(memory.step, prompt_lens)
    for step in range(steps):
        tokens = np.asarray([[s[n + step]] for s, n in zip(seqs, prompt_lens)], np.int32)
        active = np.asarray([1, 1, int(step < 2)], np.int32)  # slot 2 idles in the last step
        before = memory
        logits, memory = forward(params, tokens, memory, active, None, None, False)
        for slot, n in enumerate(prompt_lens):
            if active[slot]:
                np.testing.assert_allclose(
                    logits[slot, 0], want[slot, n + step], atol=TOL, rtol=RTOL, err_msg=f"slot {slot} step {step}"
                )
            else:
                for old, new in zip(slot_of(before, slot), slot_of(memory, slot)):
                    np.testing.assert_array_equal(new, old)


def test_prepared_position_keys_decode_the_same_and_leave_the_step_cheaper():
    """Serving (the Engine) runs `prepare` once: the step reads R instead of projecting sinusoids."""
    model, params, forward = setup()
    prepared = jax.jit(model.prepare)(params)
    g, h, m, dk = 2 * CONFIG.n_layers, CONFIG.n_heads, CONFIG.vq_mem_len, CONFIG.head_dim
    assert prepared[POSITION_KEYS]["r"].shape == (g, h, m + 1, dk)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, CONFIG.vocab_size, (3, BUCKET)).astype(np.int32)
    lengths = np.asarray([5, 9, 13], np.int32)
    memories = []
    for tree in (params, prepared):
        logits, memory = forward(tree, tokens, init_memory(CONFIG, 3, 0), lengths, None, None, False)
        step_logits, memory = forward(tree, tokens[:, :1], memory, np.ones(3, np.int32), None, None, False)
        memories.append((np.asarray(logits), np.asarray(step_logits), memory))
    (a, a1, mem_a), (b, b1, mem_b) = memories
    np.testing.assert_allclose(b, a, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(b1, a1, atol=1e-6, rtol=1e-6)
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(y, x, atol=1e-6), mem_a, mem_b)

    def step_flops(tree):
        step = jax.jit(lambda p, mem: model.forward(p, tokens[:, :1], mem, np.ones(3, np.int32)))
        return step.lower(tree, init_memory(CONFIG, 3, 0)).compile().cost_analysis()["flops"]

    # Projecting the M+1 sinusoids is (m+1)·D·h·dk multiply-adds (2 flops each) per GAU; XLA's cost
    # analysis counts the scanned GAU body once.
    assert step_flops(params) - step_flops(prepared) >= 2 * (m + 1) * CONFIG.dim * h * dk


def test_a_reset_slot_or_a_step_set_to_zero_starts_afresh():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (12, 7, 10)]
    want = full_logits(seqs)
    used = init_memory(CONFIG, 3, 0)
    for slot in range(3):
        _, used = prefill(used, seqs[0], slot)
    memory = reset_slot(used, 1)
    np.testing.assert_array_equal(memory.step, [12, 0, 12])
    for empty, new in zip(slot_of(init_memory(CONFIG, 3, 0), 1), slot_of(memory, 1)):
        np.testing.assert_array_equal(new, empty)
    logits, memory = prefill(memory, seqs[1], 1)
    np.testing.assert_allclose(logits[0], want[1, 6], atol=TOL, rtol=RTOL)
    # Setting step to 0 alone (enough for a KV memory) also empties a VQ row.
    logits, memory = prefill(used._replace(step=used.step.at[2].set(0)), seqs[2], 2)
    np.testing.assert_allclose(logits[0], want[2, 9], atol=TOL, rtol=RTOL)


# ---- training entry points ---------------------------------------------------------------------

BETA = 1e-4


def loss_fn(params, codebook, tokens, carry):
    logits, aux, carry = train_forward(CONFIG, params, codebook, tokens, carry)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
    return nll + BETA * aux.commit, (logits, aux, carry)


@pytest.fixture(scope="module")
def trained():
    """One training step's values and gradients (wrt params and, to show they are zero, codebook)."""
    _, serving, _ = setup()
    params, codebook = split_serving_params(serving)
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (3, BUCKET)).astype(np.int32)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
    (_, (logits, aux, carry)), grads = grad_fn(params, codebook, tokens, init_memory(CONFIG, 3, 0))
    return params, codebook, tokens, logits, aux, carry, grads


def test_training_blocks_equal_one_serving_forward(trained):
    params, codebook, tokens, logits, _, carry, _ = trained
    assert BUCKET % CONFIG.vq_block_len == 0 and CONFIG.vq_block_len < BUCKET
    _, serving, forward = setup()
    assert serving_params(params, codebook).keys() == serving.keys()
    want, memory = forward(serving, tokens, init_memory(CONFIG, 3, 0), np.full(3, BUCKET, np.int32), None, None, False)
    np.testing.assert_allclose(logits, want, atol=TOL, rtol=RTOL)
    np.testing.assert_array_equal(carry.z_win, memory.z_win)
    np.testing.assert_array_equal(carry.n, memory.n)
    np.testing.assert_allclose(carry.u_mean, memory.u_mean, atol=TOL, rtol=RTOL)


def test_codebook_gets_no_gradient_and_keys_get_one_through_the_straight_through_estimator(trained):
    params, _codebook, _, _, aux, _, (g_params, g_codebook) = trained
    assert not any(k.endswith("/codebook") for k in params) and g_params.keys() == params.keys()
    for leaf in jax.tree_util.tree_leaves(g_codebook):
        assert not np.asarray(leaf).any()
    hk_ = CONFIG.n_heads * CONFIG.head_dim
    g_k = np.asarray(g_params["decoder/layers/gau/kvg_proj"]["w"])[..., :hk_]  # [G, D, H*dk]: the key columns
    assert (np.abs(g_k).reshape(g_k.shape[0], -1).max(axis=1) > 0).all()  # every GAU's keys learn
    assert float(aux.commit) > 0


def gau0_keys(params, codebook, tokens):
    """numpy keys k [B,H,T,dk] and codes z [B,H,T] of the first GAU (its input is the embedding)."""
    c = CONFIG
    h, dk = c.n_heads, c.head_dim

    def rms(a):
        return a / np.sqrt(np.mean(a * a, axis=-1, keepdims=True) + c.norm_eps)

    x = np.asarray(params["decoder/embed"]["embeddings"])[tokens] * c.embedding_multiplier
    norm = params["decoder/layers/gau/input_norm"]
    xt = rms(x) * np.asarray(norm["scale"][0]) + np.asarray(norm["bias"][0])
    k = xt @ np.asarray(params["decoder/layers/gau/kvg_proj"]["w"][0])[:, : h * dk]
    k = rms(k.reshape(*tokens.shape, h, dk).transpose(0, 2, 1, 3)) * dk**-0.25
    cb = codebook["decoder/layers/gau/codebook"]
    codes = np.asarray(cb["c_sum"][0]) / np.maximum(np.asarray(cb["c_count"][0]), 0.01)[..., None]
    z = np.argmin(((k[:, :, :, None] - codes[None, :, None]) ** 2).sum(-1), axis=-1)
    return k, z


def test_ema_update_equals_its_closed_form_on_the_batch_statistics(trained):
    params, codebook, tokens, _, aux, _, _ = trained
    k, z = gau0_keys(params, codebook, tokens)
    hits = np.eye(CONFIG.vq_codes)[z]  # [B, H, T, S]
    stats = aux.stats["decoder/layers/gau/codebook"]
    np.testing.assert_allclose(stats["c_count"][0], hits.sum(axis=(0, 2)), atol=0)
    np.testing.assert_allclose(stats["c_sum"][0], np.einsum("bhts,bhtd->hsd", hits, k), atol=TOL, rtol=RTOL)
    assert stats["c_count"].shape == codebook["decoder/layers/gau/codebook"]["c_count"].shape
    gamma = 0.9
    new = ema_update(codebook, aux.stats, gamma)
    for name in ("c_sum", "c_count"):
        old = np.asarray(codebook["decoder/layers/gau/codebook"][name])
        np.testing.assert_allclose(
            new["decoder/layers/gau/codebook"][name], gamma * old + (1 - gamma) * np.asarray(stats[name]), rtol=1e-6
        )


# ---- shapes and partition rules ---------------------------------------------------------------


def test_serving_tree_size_is_n_params_and_every_param_has_a_partition_rule():
    for config in (CONFIG, tiny_vq_config(tie_embeddings=False, vq_e_preln=False)):
        shapes = param_shapes(config)
        assert sum(int(np.prod(a.shape)) for m in shapes.values() for a in m.values()) == config.n_params
        assert set(param_specs(shapes, parse_mesh("1x1"), config)) == set(shapes)
    train_params, train_codebook = jax.eval_shape(lambda: init_train(CONFIG, jax.random.PRNGKey(0)))
    assert list(train_codebook) == ["decoder/layers/gau/codebook"]
    assert serving_params(train_params, train_codebook).keys() == param_shapes(CONFIG).keys()
