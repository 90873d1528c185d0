"""The CPU decode-attention kernel (hkserve/kernels/attention.cc) against a float64 numpy reference, and
in the model against XLA's attention: windows, soft caps, grouped heads, rows of every past length."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.checkpoint.quantize import convert_params
from hkserve.kernels import dispatch, ffi
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory


def reference(q, k_new, v_new, k_mem, v_mem, layer, past_len, window, cap, sinks=None):
    """float64: each row's query heads over its visible past (< past_len, within the window) and itself,
    and (sinks [Hkv, G], gpt-oss) one more logit per query head in the denominator only."""
    b, h, g, d = q.shape
    out = np.zeros((b, h, g, d))
    for i in range(b):
        n = past_len[i]
        lo = max(0, n - window + 1) if window > 0 else 0
        for j in range(h):
            keys = np.concatenate([k_mem[layer, i, lo:n, j], k_new[i, j][None]]).astype(np.float64)
            values = np.concatenate([v_mem[layer, i, lo:n, j], v_new[i, j][None]]).astype(np.float64)
            scores = keys @ q[i, j].astype(np.float64).T  # [S, G]
            if cap:
                scores = cap * np.tanh(scores / cap)
            top = scores.max(0) if sinks is None else np.maximum(scores.max(0), sinks[j])
            p = np.exp(scores - top)
            total = p.sum(0) + (0.0 if sinks is None else np.exp(sinks[j] - top))
            out[i, j] = (p / total).T @ values
    return out


@pytest.mark.parametrize(("groups", "dim", "window", "cap"), [(1, 16, 0, 0.0), (3, 64, 0, 0.0), (2, 32, 5, 30.0)])
def test_decode_attention_equals_float64_reference(groups, dim, window, cap):
    rng = np.random.default_rng(groups + dim)
    layers, rows, heads, positions = 3, 5, 2, 40
    past_len = np.asarray([0, 1, 7, 39, 40], np.int32)  # empty, one, some, all but one, all
    q = rng.standard_normal((rows, heads, groups, dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, heads, dim)).astype(np.float32) for _ in range(2))
    k_mem, v_mem = (rng.standard_normal((layers, rows, positions, heads, dim)).astype(np.float32) for _ in range(2))
    call = jax.jit(lambda *a: ffi.decode_attention(*a, cap=cap))
    for layer in range(layers):
        y = call(q, k_new, v_new, k_mem, v_mem, np.int32(layer), past_len, np.int32(window))
        want = reference(q, k_new, v_new, k_mem, v_mem, layer, past_len, window, cap)
        np.testing.assert_allclose(np.asarray(y), want, atol=2e-6, rtol=1e-5)
    with pytest.raises(Exception, match="layer index out of range"):
        call(q, k_new, v_new, k_mem, v_mem, np.int32(layers), past_len, np.int32(window)).block_until_ready()


def bf16_rounded(x: np.ndarray) -> np.ndarray:
    """x rounded once to bfloat16 (nearest even), as a bf16 KV memory holds it: a float32 copy of those values."""
    return np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize(
    ("groups", "dim", "window", "cap", "positions"),
    [(1, 16, 0, 0.0, 40), (3, 48, 0, 0.0, 37), (2, 32, 5, 30.0, 41), (3, 80, 11, 0.0, 23)],
)
def test_bf16_memory_equals_float64_reference_of_the_rounded_memory(groups, dim, window, cap, positions):
    """--kv-dtype bf16: the kernel's bf16 variant reads the memory as stored and widens it exactly, so it
    gives the float64 reference of the bf16-rounded memory, and the float32 variant's bits on a float32
    copy of that memory (head dims 16..80 with a partial 64-column chunk, odd lengths, windows, caps)."""
    rng = np.random.default_rng(groups + dim + positions)
    layers, rows, heads = 2, 5, 2
    past_len = np.asarray([0, 1, 7, positions - 1, positions], np.int32)
    q = rng.standard_normal((rows, heads, groups, dim)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, heads, dim)).astype(np.float32) for _ in range(2))
    k_mem, v_mem = (rng.standard_normal((layers, rows, positions, heads, dim)).astype(np.float32) for _ in range(2))
    k16, v16 = jnp.asarray(k_mem, jnp.bfloat16), jnp.asarray(v_mem, jnp.bfloat16)
    k_rounded, v_rounded = bf16_rounded(k_mem), bf16_rounded(v_mem)
    assert np.abs(k_rounded - k_mem).max() > 1e-3  # the rounding is large enough to be seen below
    call = jax.jit(lambda *a: ffi.decode_attention(*a, cap=cap))
    for layer in range(layers):
        y = np.asarray(call(q, k_new, v_new, k16, v16, np.int32(layer), past_len, np.int32(window)))
        want = reference(q, k_new, v_new, k_rounded, v_rounded, layer, past_len, window, cap)
        np.testing.assert_allclose(y, want, atol=2e-6, rtol=1e-5)
        wide = call(q, k_new, v_new, k_rounded, v_rounded, np.int32(layer), past_len, np.int32(window))
        np.testing.assert_array_equal(y, np.asarray(wide))
    with pytest.raises(ValueError, match="float32 or bfloat16 KV memory"):
        call(q, k_new, v_new, k16.astype(jnp.float16), v16.astype(jnp.float16), np.int32(0), past_len, np.int32(0))


def test_a_rows_result_does_not_depend_on_the_other_rows():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((4, 2, 3, 64)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((4, 2, 64)).astype(np.float32) for _ in range(2))
    k_mem, v_mem = (rng.standard_normal((1, 4, 50, 2, 64)).astype(np.float32) for _ in range(2))
    past_len = np.asarray([30, 3, 49, 12], np.int32)
    call = jax.jit(ffi.decode_attention)
    together = np.asarray(call(q, k_new, v_new, k_mem, v_mem, np.int32(0), past_len, np.int32(0)))
    for i in range(4):
        alone = call(
            q[i : i + 1],
            k_new[i : i + 1],
            v_new[i : i + 1],
            k_mem[:, i : i + 1],
            v_mem[:, i : i + 1],
            np.int32(0),
            past_len[i : i + 1],
            np.int32(0),
        )
        np.testing.assert_array_equal(np.asarray(alone)[0], together[i])


CONFIGS = {
    "gqa": tiny_config(),
    "sliding-capped": tiny_config(sliding_window=3, sliding_layers=(True, False), attn_logit_cap=30.0),
}


@pytest.mark.parametrize("kv", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kernel_decode_steps_equal_xla_attention_in_the_model(name, kv):
    """Prefill 6 tokens, then 5 one-token steps: logits with the kernels (in-place attention) equal the
    XLA model's, and the kernel step reads the memory through hk_decode_attention (its bf16 variant for
    --kv-dtype bf16: the memory read as stored, as XLA reads its upcast window of the same bits)."""
    config = CONFIGS[name]
    f32 = jax.tree_util.tree_map(np.asarray, init_params(config, 5))
    config, params = convert_params(f32, config, "int8")
    config = config.replace(kv_dtype=kv)
    spec = dispatch.resolve("auto", config.dtype)
    assert spec is not None
    prompt = np.asarray(np.random.default_rng(1).integers(0, config.vocab_size, (2, 6)), np.int32)
    runs = {}
    for label, kernels in (("xla", None), ("kernels", spec)):
        model = build_model(config, kernels)
        p = jax.jit(model.prepare)(params) if model.prepare is not None else params
        forward = jax.jit(model.forward, static_argnames=("attend_len",))
        memory = init_memory(config, 2, 16)
        assert memory.k.dtype == jnp.dtype(kv)
        _, memory = forward(p, prompt, memory, np.asarray([6, 4], np.int32))  # rows of different lengths
        steps = []
        for step in range(5):
            token = np.full((2, 1), 3 + step, np.int32)
            logits, memory = forward(p, token, memory, np.ones(2, np.int32), attend_len=16)
            steps.append(np.asarray(logits))
        runs[label] = steps
        if kernels is not None:
            hlo = forward.lower(p, token, memory, np.ones(2, np.int32), attend_len=16).compile().as_text()
            assert ("hk_decode_attention_bf16" in hlo) == (kv == "bfloat16") and "hk_decode_attention" in hlo
    # The paths' int8 products differ in their last bits (w8a16 against XLA's dots); a bf16 memory can turn
    # such a difference into one bf16 step of a stored value, so its bound is wider (measured: 3.4e-4 at
    # most), still below what the rounding itself moves (3e-3 to 5e-3 between a bf16 and an f32 memory).
    for xla, kernel in zip(runs["xla"], runs["kernels"], strict=True):
        np.testing.assert_allclose(kernel, xla, atol=2e-4 if kv == "float32" else 1e-3, rtol=1e-4)
