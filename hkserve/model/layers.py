"""Decoder building blocks as Haiku modules: RMSNorm, RoPE, GQA attention over a KV memory, SwiGLU, MoE.

Parameter names follow one scheme (`q_proj/w`, `mlp/gate_proj/w`, ...) that the checkpoint importers
target; linear weights are stored [in, out].
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp

from hkserve.model.config import ModelConfig

F32 = jnp.float32


def param_dtype(config: ModelConfig):
    """Storage dtype of weight matrices (norm scales stay float32 for int8 weights)."""
    return {"bfloat16": jnp.bfloat16, "int8": jnp.int8}.get(config.dtype, F32)


def norm_dtype(config: ModelConfig):
    return jnp.bfloat16 if config.dtype == "bfloat16" else F32


def quantized_weight(name: str, shape, dtype, scale_shape, fan_in: int):
    """(weight, per-output-channel scale or None). int8 weights (grok-1's QuantizedWeight8bit idea)
    are widened inside the jitted dot, which XLA fuses: the step reads int8 bytes, never a float copy."""
    w = hk.get_parameter(name, shape, dtype, init=_init(fan_in) if dtype != jnp.int8 else jnp.zeros)
    if dtype != jnp.int8:
        return w, None
    return w, hk.get_parameter(f"{name}_scale" if name != "w" else "scale", scale_shape, F32, init=jnp.ones)


WIDE_OUT = 16384  # int8 products with at least this many outputs (vocabulary heads) go block by block
_BLOCK = 4096


def _wide_int8_dot(x: jax.Array, w: jax.Array, out_axis: int) -> jax.Array | None:
    """x·w for an int8 w whose output dim is large, in blocks of <= 4096 outputs.

    XLA's CPU dot with the int8→f32 convert fused runs ~4x slower than float32 on a [576, 49152]
    head at 16 rows, but fast on blocks; None when the output dim has no suitable block size."""
    out = w.shape[out_axis]
    n = next((k for k in range(-(-out // _BLOCK), out // 512 + 1) if out % k == 0), None)
    if n is None:
        return None
    size = out // n
    flat = x.reshape(-1, x.shape[-1]).astype(F32)

    def block(i):
        part = jax.lax.dynamic_slice_in_dim(w, i * size, size, axis=out_axis).astype(F32)
        return flat @ (part.T if out_axis == 0 else part)  # [rows, size]

    y = jax.lax.map(block, jnp.arange(n))  # [n, rows, size]
    return y.transpose(1, 0, 2).reshape(*x.shape[:-1], out)


def qdot(x: jax.Array, w: jax.Array, scale: jax.Array | None, spec: str | None = None, out_axis: int = 1) -> jax.Array:
    """x·w accumulated in float32; int8 weights widen in the dot and their scale applies after it."""
    if scale is None:
        x = x.astype(w.dtype)
        if out_axis == 0:
            w = w.T
        return jnp.einsum(spec, x, w, preferred_element_type=F32) if spec else jnp.dot(x, w, preferred_element_type=F32)
    if spec is None and w.ndim == 2 and w.shape[out_axis] >= WIDE_OUT:
        y = _wide_int8_dot(x, w, out_axis)
        if y is not None:
            return y * scale
    if out_axis == 0:
        w = w.T
    w = w.astype(F32)
    y = jnp.einsum(spec, x.astype(F32), w) if spec else jnp.dot(x.astype(F32), w)
    return y * scale


def _init(fan_in: int):
    return hk.initializers.TruncatedNormal(stddev=fan_in**-0.5)


class Linear(hk.Module):
    """y = x @ w without bias; accumulates in float32 whatever the storage dtype."""

    def __init__(self, out_dim: int, dtype, name: str):
        super().__init__(name=name)
        self.out_dim = out_dim
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        w, scale = quantized_weight("w", [x.shape[-1], self.out_dim], self.dtype, [self.out_dim], x.shape[-1])
        return qdot(x, w, scale)


class Embed(hk.Module):
    """Token embeddings [V, D]; also the output head when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int, dtype, name: str = "embed"):
        super().__init__(name=name)
        self.shape = (vocab_size, dim)
        self.dtype = dtype

    def _table(self):
        """[V, D] embeddings and, for int8, a scale per token row [V] (= per output channel when tied)."""
        if self.dtype == jnp.int8:
            table = hk.get_parameter("embeddings", self.shape, jnp.int8, init=jnp.zeros)
            return table, hk.get_parameter("scale", self.shape[:1], F32, init=jnp.ones)
        return hk.get_parameter("embeddings", self.shape, self.dtype, init=hk.initializers.TruncatedNormal(1.0)), None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table, scale = self._table()
        rows = jnp.take(table, tokens, axis=0).astype(F32)
        return rows if scale is None else rows * jnp.take(scale, tokens)[..., None]

    def unembed(self, x: jax.Array) -> jax.Array:
        table, scale = self._table()
        return qdot(x, table, scale, out_axis=0)


class RMSNorm(hk.Module):
    def __init__(self, eps: float, dtype, name: str):
        super().__init__(name=name)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = hk.get_parameter("scale", [x.shape[-1]], self.dtype, init=jnp.ones)
        x = x.astype(F32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return x * scale.astype(F32)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half layout (Hugging Face's; GGUF q/k rows are un-permuted to it).

    x: [B, T, H, Dh]; positions: [B, T].
    """
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=F32) / dh))  # [Dh/2]
    angles = positions.astype(F32)[..., None] * inv_freq  # [B, T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, Dh]
    half = dh // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


class Attention(hk.Module):
    """Grouped-query attention of T new tokens over the memory's past keys plus themselves.

    The past (`k_past`, read-only) and the new keys are scored separately and normalised by one
    softmax, so the memory is read but never rewritten inside the layer scan: the caller writes the
    new keys into the (donated) memory once, after all layers.
    """

    def __init__(self, config: ModelConfig, name: str = "attention"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x, positions, k_past, v_past, past_len):
        """x: [B,T,D]; positions: [B,T]; k_past/v_past: [B,W,Hkv,Dh]; past_len: [B] (valid past keys).

        Returns (out [B,T,D], k_new [B,T,Hkv,Dh], v_new [B,T,Hkv,Dh]).
        """
        c = self.c
        dtype = param_dtype(c)
        b, t, _ = x.shape
        groups = c.n_heads // c.n_kv_heads
        q = Linear(c.n_heads * c.head_dim, dtype, "q_proj")(x).reshape(b, t, c.n_heads, c.head_dim)
        k = Linear(c.n_kv_heads * c.head_dim, dtype, "k_proj")(x).reshape(b, t, c.n_kv_heads, c.head_dim)
        v = Linear(c.n_kv_heads * c.head_dim, dtype, "v_proj")(x).reshape(b, t, c.n_kv_heads, c.head_dim)
        q = rope(q, positions, c.rope_theta) * (c.attn_multiplier or c.head_dim**-0.5)
        k = rope(k, positions, c.rope_theta)
        q = q.reshape(b, t, c.n_kv_heads, groups, c.head_dim)  # [B, T, Hkv, G, Dh]

        neg = jnp.finfo(F32).min

        def cap(scores):  # grok-1's soft cap on the attention logits
            return c.attn_logit_cap * jnp.tanh(scores / c.attn_logit_cap) if c.attn_logit_cap else scores

        new_scores = cap(jnp.einsum("bthgd,bshd->bhgts", q, k))  # [B, Hkv, G, T, T]
        causal = jnp.tril(jnp.ones((t, t), bool))
        new_scores = jnp.where(causal, new_scores, neg)
        w = k_past.shape[1]
        if w:
            past_scores = cap(jnp.einsum("bthgd,bshd->bhgts", q, k_past.astype(F32)))  # [B, Hkv, G, T, W]
            seen = jnp.arange(w)[None, :] < past_len[:, None]  # [B, W]
            past_scores = jnp.where(seen[:, None, None, None, :], past_scores, neg)
            scores = jnp.concatenate([past_scores, new_scores], axis=-1)
            values = jnp.concatenate([v_past.astype(F32), v], axis=1)  # [B, W+T, Hkv, Dh]
        else:
            scores, values = new_scores, v
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bhgts,bshd->bthgd", probs, values).reshape(b, t, c.n_heads * c.head_dim)
        out = Linear(c.dim, dtype, "o_proj")(out)
        return out, k, v


class MLP(hk.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, name: str = "mlp"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x):
        dtype = param_dtype(self.c)
        gate = Linear(self.c.ffn_dim, dtype, "gate_proj")(x)
        up = Linear(self.c.ffn_dim, dtype, "up_proj")(x)
        return Linear(self.c.dim, dtype, "down_proj")(jax.nn.silu(gate) * up)


_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_exact": lambda x: jax.nn.gelu(x, approximate=False),
}


class MoE(hk.Module):
    """Top-k mixture of gated experts: act(x @ gate) * (x @ up) @ down per expert.

    Routing "mixtral": gates = softmax over the k selected router logits. Routing "grok": softmax over
    all experts, top-k, gates not renormalised. Unless `moe_dense`, experts no token selected are
    skipped (lax.cond in a scan over experts), so a decode step reads only the used experts' weights —
    with few tokens in flight that is k of E experts; grok-1's released code runs all of them.
    """

    def __init__(self, config: ModelConfig, name: str = "moe"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x):
        c = self.c
        dtype = param_dtype(c)
        e, d, f = c.n_experts, c.dim, c.ffn_dim
        router_logits = Linear(e, dtype, "router")(x)  # [B, T, E]
        if c.moe_routing == "grok":
            top_gates, top_idx = jax.lax.top_k(jax.nn.softmax(router_logits, axis=-1), c.n_experts_per_token)
        else:
            top_logits, top_idx = jax.lax.top_k(router_logits, c.n_experts_per_token)  # [B, T, K]
            top_gates = jax.nn.softmax(top_logits, axis=-1)
        gates = jnp.sum(jax.nn.one_hot(top_idx, e, dtype=F32) * top_gates[..., None], axis=-2)  # [B, T, E]
        w_gate, s_gate = quantized_weight("gate_proj", [e, d, f], dtype, [e, f], d)
        w_up, s_up = quantized_weight("up_proj", [e, d, f], dtype, [e, f], d)
        w_down, s_down = quantized_weight("down_proj", [e, f, d], dtype, [e, d], f)
        act = _ACTIVATIONS[c.moe_activation]

        def expert(i):
            def pick(w, s):
                return w[i], None if s is None else s[i]

            h = act(qdot(x, *pick(w_gate, s_gate))) * qdot(x, *pick(w_up, s_up))
            return qdot(h, *pick(w_down, s_down))  # [B, T, D]

        if c.moe_dense:
            y = jax.vmap(expert, out_axes=2)(jnp.arange(e))  # [B, T, E, D]
            return jnp.einsum("bted,bte->btd", y, gates)

        def add_expert(acc, i):
            gate = gates[..., i]  # [B, T]
            out = jax.lax.cond(jnp.any(gate > 0), lambda: expert(i) * gate[..., None], lambda: jnp.zeros_like(acc))
            return acc + out, None

        return jax.lax.scan(add_expert, jnp.zeros(x.shape[:-1] + (d,), F32), jnp.arange(e))[0]
