"""Grouped-query attention over a KV memory, with RoPE, optional q/k/v/o biases, per-head q/k RMSNorm,
a soft cap on the scores, a sliding window and attention sinks (gpt-oss).

The window and the RoPE base arrive per call as traced scalars, since the decoder scans its layers
and layers may differ in both (Gemma 2/3 alternate sliding and full layers, Gemma 3's sliding layers
have their own RoPE base).
"""

from __future__ import annotations

from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from hkserve.kernels import dispatch, ffi
from hkserve.model import layer_weights, paged_pallas
from hkserve.model.config import ModelConfig
from hkserve.model.layers import F32, Linear, RMSNorm, norm_dtype, param_dtype


class HeldKV(NamedTuple):
    """A decode step's KV memory read in place by a kernel instead of as k_past/v_past."""

    k: jax.Array  # [L, B, S, Hkv, Dh] static, or a paged pool [L, NB, bs, Hkv, Dh]
    v: jax.Array  # same as k
    layer: jax.Array  # [] int32: the layer read
    table: jax.Array | None  # [B, MB] int32 block tables of a paged pool, None for a static memory
    kernel: str  # "cpu" (kernels/attention.cc), "pallas" or "interpret" (paged_pallas.py; paged only)


def reads_own_length(config: ModelConfig, spec: dispatch.KernelSpec | None, kv_dtype) -> bool:
    """Does a decode step (one new token per row, all slots) read its past through the C++ kernel
    (kernels/attention.cc), which reads each row's memory, static or paged, in place up to that row's own
    length? Then the step's program does not depend on the attention window (the engine compiles one:
    engine.py `step_windows`). Under any spec (a float model's too) and a KV dtype of the kernel's two
    variants; that kernel has no attention sinks, so gpt-oss attends through XLA."""
    return (
        spec is not None
        and kv_dtype in (jnp.float32, jnp.bfloat16)
        and config.head_dim % 16 == 0
        and not config.attn_sinks
    )


def rope_frequencies(config: ModelConfig, theta: jax.Array) -> jax.Array:
    """Inverse frequencies [Dh/2] for RoPE base `theta`, divided by config.rope_freq_factors if any
    (Llama 3's frequency scaling, as llama.cpp applies it from its rope_freqs tensor)."""
    dh = config.head_dim
    inv_freq = 1.0 / (jnp.asarray(theta, F32) ** (jnp.arange(0, dh, 2, dtype=F32) / dh))
    if config.rope_freq_factors:
        inv_freq = inv_freq / jnp.asarray(config.rope_freq_factors, F32)
    return inv_freq


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, rotate-half layout (Hugging Face's; GGUF q/k rows are un-permuted to it).

    x: [B, T, H, Dh]; positions: [B, T]; inv_freq: [Dh/2].
    """
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def in_window(q_pos: jax.Array, k_pos: jax.Array, window: jax.Array) -> jax.Array:
    """[B, T, S]: may a query at q_pos [B, T] see a key at k_pos [B, S]? Causal, and with a window
    (> 0) only the last `window` positions, its own included."""
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    return (diff >= 0) & ((window <= 0) | (diff < window))


def _project(c: ModelConfig, x: jax.Array, heads: int, name: str) -> jax.Array:
    """[B, T, D] → [B, T, heads, Dh] (a function, not a method: Haiku would scope a method's params)."""
    bias = norm_dtype(c) if c.qkv_bias else None
    y = Linear(heads * c.head_dim, param_dtype(c, name), name, bias_dtype=bias)(x)
    return y.reshape(*x.shape[:2], heads, c.head_dim)


def _qk_norm(c: ModelConfig, x: jax.Array, name: str) -> jax.Array:
    """RMSNorm of x [B, T, heads, Dh] over each head, or (qk_norm_full, OLMo 2) over all heads at once."""
    norm = RMSNorm(c.norm_eps, norm_dtype(c), name, c.norm_offset)
    return norm(x.reshape(*x.shape[:2], -1)).reshape(x.shape) if c.qk_norm_full else norm(x)


class Attention(hk.Module):
    """Grouped-query attention of T new tokens over the memory's past keys plus themselves.

    The past (`k_past`, read-only) and the new keys are scored separately and normalised by one
    softmax, so the memory is read but never rewritten inside the layer scan: the caller writes the
    new keys into the (donated) memory once, after all layers. The memory keeps every position; a
    sliding window is a mask on the scores.
    """

    def __init__(self, config: ModelConfig, name: str = "attention"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x, positions, k_past, v_past, past_len, window, rope_spec, memory=None):
        """x: [B,T,D]; positions: [B,T]; k_past/v_past: [B,W,Hkv,Dh]; past_len: [B] (valid past keys);
        window: this layer's sliding window (0 = none); rope_spec: (its RoPE base, 1.0 if it applies RoPE
        else 0.0: SmolLM3's NoPE layers, where a zero frequency makes the rotation the identity).
        `memory` (a decode step, T = 1): a HeldKV its kernel reads in place instead of k_past/v_past.

        Returns (out [B,T,D], k_new [B,T,Hkv,Dh], v_new [B,T,Hkv,Dh]).
        """
        c = self.c
        b, t, _ = x.shape
        groups = c.n_heads // c.n_kv_heads
        qkv = layer_weights.fused("qkv_proj", (c.n_heads * c.head_dim, *[c.n_kv_heads * c.head_dim] * 2), x)
        if qkv is not None:  # CPU kernels: q, k and v in one call (model/packing.py)
            q, k, v = (y.reshape(b, t, -1, c.head_dim) for y in qkv)
        else:
            q = _project(c, x, c.n_heads, "q_proj")
            k = _project(c, x, c.n_kv_heads, "k_proj")
            v = _project(c, x, c.n_kv_heads, "v_proj")
        if c.qk_norm:
            q, k = _qk_norm(c, q, "q_norm"), _qk_norm(c, k, "k_norm")
        theta, rope_on = rope_spec
        inv_freq = rope_frequencies(c, theta) * rope_on
        rope_factor = 1.0 + rope_on * (c.rope_attn_factor - 1.0)  # transformers scales cos and sin
        q = rope(q, positions, inv_freq) * (rope_factor * (c.attn_multiplier or c.head_dim**-0.5))
        k = rope(k, positions, inv_freq) * rope_factor
        q = q.reshape(b, t, c.n_kv_heads, groups, c.head_dim)  # [B, T, Hkv, G, Dh]

        if memory is not None:
            out = _read_in_place(c, q[:, 0], k[:, 0], v[:, 0], memory, past_len, positions[:, 0], window)
            return _out_proj(c, out.reshape(b, t, c.n_heads * c.head_dim)), k, v
        neg = jnp.finfo(F32).min

        def cap(scores):  # soft cap on the attention logits (grok-1, Gemma 2)
            return c.attn_logit_cap * jnp.tanh(scores / c.attn_logit_cap) if c.attn_logit_cap else scores

        new_scores = cap(jnp.einsum("bthgd,bshd->bhgts", q, k))  # [B, Hkv, G, T, T]
        new_scores = jnp.where(in_window(positions, positions, window)[:, None, None], new_scores, neg)
        w = k_past.shape[1]
        if w:
            past_scores = cap(jnp.einsum("bthgd,bshd->bhgts", q, k_past.astype(F32)))  # [B, Hkv, G, T, W]
            k_pos = jnp.broadcast_to(jnp.arange(w)[None, :], (b, w))  # memory index = position
            seen = (k_pos < past_len[:, None])[:, None, :] & in_window(positions, k_pos, window)  # [B, T, W]
            past_scores = jnp.where(seen[:, None, None], past_scores, neg)
            scores = jnp.concatenate([past_scores, new_scores], axis=-1)
            values = jnp.concatenate([v_past.astype(F32), v], axis=1)  # [B, W+T, Hkv, Dh]
        else:
            scores, values = new_scores, v
        probs = _softmax(c, scores)
        out = jnp.einsum("bhgts,bshd->bthgd", probs, values).reshape(b, t, c.n_heads * c.head_dim)
        return _out_proj(c, out), k, v


def _read_in_place(c: ModelConfig, q, k_new, v_new, held: HeldKV, past_len, q_pos, window) -> jax.Array:
    """One new token per row, q [B, Hkv, G, Dh], over a memory its kernel reads in place: the C++ CPU
    kernel (no sinks: the caller keeps gpt-oss on XLA there), or the Pallas kernel over a paged pool."""
    if held.kernel == "cpu":
        threads = dispatch.active().threads
        return ffi.decode_attention(
            q, k_new, v_new, held.k, held.v, held.layer, past_len, window, c.attn_logit_cap, threads, held.table
        )
    past = paged_pallas.PagedPast(held.k, held.v, held.layer, held.table, past_len, q_pos, window)
    splits = paged_pallas.default_splits(held.table.shape[1])
    return paged_pallas.paged_decode_attention(
        q, k_new, v_new, past, c.attn_logit_cap, _sinks(c), splits=splits, interpret=held.kernel == "interpret"
    )


def _out_proj(c: ModelConfig, out: jax.Array) -> jax.Array:
    """[B, T, H*Dh] → [B, T, D], with gpt-oss's bias."""
    return Linear(c.dim, param_dtype(c, "o_proj"), "o_proj", bias_dtype=norm_dtype(c) if c.o_bias else None)(out)


def _softmax(c: ModelConfig, scores: jax.Array) -> jax.Array:
    """Softmax over the keys of scores [B, Hkv, G, T, S]. With attn_sinks (gpt-oss), each query head's
    learned logit joins the denominator as one more key with no value, so a head can attend to nothing."""
    sinks = _sinks(c)
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sink = jnp.broadcast_to(sinks[None, :, :, None, None], (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def _sinks(c: ModelConfig) -> jax.Array | None:
    """gpt-oss's learned logit per query head [Hkv, G], float32; None for models without sinks."""
    if not c.attn_sinks:
        return None
    sinks = hk.get_parameter("sinks", [c.n_heads], norm_dtype(c), init=jnp.zeros)  # [H] = [Hkv*G]
    return sinks.astype(F32).reshape(c.n_kv_heads, -1)
