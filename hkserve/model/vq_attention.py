"""Transformer-VQ's gated attention unit (GAU) as a Haiku module (docs/transformer-vq.md).

Keys are replaced by their nearest code, so every key older than the window can be folded into a
per-code count and mean value, and one block of T tokens attends exactly, in float32, to
[M window keys + T block keys] plus C aggregate code slots: linear time, constant state.

Every head split is head-major (column h * d + e) and the k|v|g projection is fused, as in the
reference implementation. The codebook is Haiku *state*: gradients never reach it, `ema_update` moves it.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

from hkserve.model.config import ModelConfig
from hkserve.model.layers import Linear, norm_dtype, param_dtype, quantized_weight
from hkserve.model.vq_memory import GAUState, advance

F32 = jnp.float32
NEG = -1e30  # masked logit: finite, so a fully masked softmax row stays NaN-free


def rms(x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm without parameters over the last axis, in float32 (eps inside the square root)."""
    x = x.astype(F32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def sinusoids(n: int, width: int, lam: float) -> np.ndarray:
    """[n, width] embeddings of distances 0..n-1: all sines, then all cosines, w_i = lam^(-2i/width)."""
    omega = lam ** (-2.0 * np.arange(width // 2) / width)
    angles = np.arange(n)[:, None] * omega[None, :]
    return np.concatenate([np.sin(angles), np.cos(angles)], axis=-1).astype(np.float32)


def position_keys(w_r: jax.Array, config: ModelConfig) -> jax.Array:
    """R [..., H, M+1, dk] of distances 0..M from W_r [..., D, H*dk] (any leading axes), scaled by d_k^-1/4.

    A function of the params alone: serving computes it once per model (`prepare`), not in every step,
    where it would cost more than the rest of a decode step."""
    c = config
    sin = jnp.asarray(sinusoids(c.vq_mem_len + 1, c.dim, c.vq_pe_lam))  # [M+1, D]
    r = jnp.einsum("md,...de->...me", sin, w_r.astype(F32))  # [..., M+1, H*dk]
    r = r.reshape(*r.shape[:-1], c.n_heads, c.head_dim)
    return jnp.swapaxes(r, -2, -3) * c.head_dim**-0.25


class AffineRMSNorm(hk.Module):
    """RMSNorm with a gain and a bias (the GAU's input norm)."""

    def __init__(self, eps: float, dtype, name: str = "input_norm"):
        super().__init__(name=name)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = hk.get_parameter("scale", [x.shape[-1]], self.dtype, init=jnp.ones)
        bias = hk.get_parameter("bias", [x.shape[-1]], self.dtype, init=jnp.zeros)
        return rms(x, self.eps) * scale.astype(F32) + bias.astype(F32)


class Codebook(hk.Module):
    """Per-head codes = c_sum / max(c_count, 0.01) from EMA state c_sum [H, C, dk], c_count [H, C]."""

    def __init__(self, config: ModelConfig, name: str = "codebook"):
        super().__init__(name=name)
        self.c = config

    def __call__(self) -> jax.Array:
        h, s, dk = self.c.n_heads, self.c.vq_codes, self.c.head_dim
        c_sum = hk.get_state("c_sum", [h, s, dk], F32, init=hk.initializers.RandomNormal((h * s) ** -0.5))
        c_count = hk.get_state("c_count", [h, s], F32, init=jnp.ones)
        return jax.lax.stop_gradient(c_sum / jnp.maximum(c_count, 0.01)[..., None])  # [H, C, dk]


def quantize(k: jax.Array, codes: jax.Array) -> jax.Array:
    """Nearest code per key: k [B, H, T, dk], codes [H, C, dk] → z [B, H, T] int32."""
    dist = jnp.sum(codes * codes, axis=-1)[None, :, None, :] - 2 * jnp.einsum("bhtd,hsd->bhts", k, codes)
    return jnp.argmin(dist, axis=-1).astype(jnp.int32)


def attend(q, u, vb, codes, r, z, k_st, v, state: GAUState, step):
    """Attention of a block over window + block keys and the aggregate code slots, in float32.

    q [B,H,T,dk]; u, vb [H,dk] (content / position biases); codes [H,C,dk]; r [H,M+1,dk] (distance
    0..M); z [B,H,T] and v [B,H,T,dv] of the block; k_st: None, or [B,H,T,dk] keys whose gradient the
    block's content scores pass on (straight-through; adds exact zeros to the scores); step [B].
    Returns wv [B,H,T,dv].
    """
    m, s, t = state.z_win.shape[-1], codes.shape[1], z.shape[-1]
    w = m + t
    qu, qv = q + u[:, None, :], q + vb[:, None, :]
    code_scores = jnp.einsum("bhtd,hsd->bhts", qu, codes)  # [B, H, T, C]
    # Every key is a code, so a key's content score is a gather (empty code C clamps; masked below).
    z_keys = jnp.minimum(jnp.concatenate([state.z_win, z], axis=-1), s - 1)  # [B, H, W]
    content = jnp.take_along_axis(code_scores, jnp.broadcast_to(z_keys[:, :, None, :], q.shape[:3] + (w,)), -1)
    if k_st is not None:
        st = jnp.einsum("bhtd,bhjd->bhtj", qu, k_st - jax.lax.stop_gradient(k_st))  # zeros in value
        content = content + jnp.pad(st, [(0, 0), (0, 0), (0, 0), (m, 0)])
    # Band: query i (position step+i) and key slot j (position step-M+j) are d = i+M-j apart.
    band = jnp.einsum("bhtd,hed->bhte", qv, r)  # [B, H, T, M+1]
    dist = jnp.arange(t)[:, None] + m - jnp.arange(w)[None, :]  # [T, W]
    pos = jnp.take_along_axis(band, jnp.broadcast_to(jnp.clip(dist, 0, m), band.shape[:2] + (t, w)), -1)
    in_band = (dist >= 0) & (dist <= m)
    scores = content + jnp.where(in_band, pos, 0.0)
    valid = (dist >= 0)[None] & (step[:, None] - m + jnp.arange(w)[None, :] >= 0)[:, None, :]  # [B, T, W]
    scores = jnp.where(valid[:, None], scores, NEG)
    agg = jnp.where(
        state.n[:, :, None, :] > 0, code_scores + jnp.log(jnp.maximum(state.n, 1.0))[:, :, None, :], NEG
    )  # [B, H, T, C]: exp(q.codes[s] + log n_s) weighs the n_s tokens of code s at once
    probs = jax.nn.softmax(jnp.concatenate([scores, agg], axis=-1), axis=-1)
    v_keys = jnp.concatenate([state.v_win.astype(F32), v], axis=-2)  # [B, H, W, dv]
    return jnp.einsum("bhtw,bhwd->bhtd", probs[..., :w], v_keys) + jnp.einsum(
        "bhts,bhsd->bhtd", probs[..., w:], state.u_mean
    )


class GAU(hk.Module):
    """One gated attention unit: the residual branch (the caller adds x) and the advanced state."""

    def __init__(self, config: ModelConfig, name: str = "gau"):
        super().__init__(name=name)
        self.c = config

    def __call__(self, x, state: GAUState, step, lengths, is_train: bool = False, r=None):
        """x [B,T,D]; state of this GAU; step [B] (tokens before the block); lengths [B] (real tokens);
        r: this GAU's precomputed position keys [H, M+1, dk], or None to compute them from r_proj.

        Returns (out [B,T,D], new state, aux): aux is None, or when is_train (commit [] — mean
        ||k - sg(codes[z])||^2 over real tokens and heads —, count [H,C], k_sum [H,C,dk]) over real tokens.
        """
        c = self.c
        h, dk, dv = c.n_heads, c.head_dim, c.vq_value_dim
        dtype, ndtype = param_dtype(c), norm_dtype(c)
        b, t, _ = x.shape
        s4 = dk**-0.25  # applied to q, k, r, u and v' separately: the logits get no other scale

        def heads(y, d):  # [B, T, H*d] → [B, H, T, d]
            return y.reshape(b, t, h, d).transpose(0, 2, 1, 3)

        xt = AffineRMSNorm(c.norm_eps, ndtype)(x)
        q = rms(heads(Linear(h * dk, dtype, "q_proj")(xt), dk), c.norm_eps) * s4
        k, v, g = jnp.split(Linear(h * (dk + 2 * dv), dtype, "kvg_proj")(xt), [h * dk, h * (dk + dv)], axis=-1)
        k = rms(heads(k, dk), c.norm_eps) * s4  # the codebook lives in this scaled space
        v, g = jax.nn.silu(heads(v, dv)), jax.nn.silu(g)
        codes = Codebook(c)()
        z = quantize(jax.lax.stop_gradient(k), codes)

        if r is None:  # training (and unprepared params): position keys of distances 0..M, once per call
            with hk.experimental.name_scope("r_proj"):
                w_r, scale = quantized_weight("w", [c.dim, h * dk], dtype, [h * dk], c.dim)
            r = position_keys(w_r if scale is None else w_r.astype(F32) * scale, c)  # [H, M+1, dk]
        u = hk.get_parameter("xl_u", [h * dk], ndtype, init=jnp.zeros).astype(F32).reshape(h, dk) * s4
        vb = hk.get_parameter("xl_v", [h * dk], ndtype, init=jnp.zeros).astype(F32).reshape(h, dk) * s4

        wv = attend(q, u, vb, codes, r, z, k if is_train else None, v, state, step)  # [B, H, T, dv]
        o = wv.transpose(0, 2, 1, 3).reshape(b, t, h * dv) * g
        out = Linear(c.dim, dtype, "o_proj")(o)
        return out, advance(state, z, v, lengths), (_train_aux(k, z, codes, lengths) if is_train else None)


def _train_aux(k, z, codes, lengths):
    """Commit loss (gradient to k only) and the codebook's EMA statistics over the real tokens."""
    real = (jnp.arange(z.shape[-1])[None, :] < lengths[:, None]).astype(F32)[:, None, :]  # [B, 1, T]
    hits = jax.nn.one_hot(z, codes.shape[1], dtype=F32) * real[..., None]  # [B, H, T, C]
    chosen = jnp.einsum("bhts,hsd->bhtd", hits, codes)  # codes[z] (0 on padding)
    err = jnp.sum(jnp.square(k - chosen), axis=-1) * real  # [B, H, T]
    commit = jnp.sum(err) / jnp.maximum(jnp.sum(real) * z.shape[1], 1.0)
    k = jax.lax.stop_gradient(k)
    return commit, jnp.sum(hits, axis=(0, 2)), jnp.einsum("bhts,bhtd->hsd", hits, k)
