"""A plain quadratic reference of one Transformer-VQ GAU in float64 numpy (docs/transformer-vq.md,
fixtures/vq/README.md section 3): every query attends with one softmax to every past key, each key
replaced by its nearest code, plus the position band over distances 0..M. No cache, no blocks: what
the cached linear-time form must equal for any split into blocks.

Params are the Haiku trees of a GAU module named `prefix` (`{prefix}/q_proj: {w}` ...) and its
codebook state (`{prefix}/codebook: {c_sum, c_count}`).
"""

from __future__ import annotations

import numpy as np

F64 = np.float64


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def reference_gau(
    params: dict, codebook: dict, x: np.ndarray, config, prefix: str = "gau", query_chunk: int = 512
) -> dict:
    """x [B, T, D] → {res [B,T,D], wv [B,T,H*dv], z [B,H,T], and the state after T tokens: z_win
    [B,H,M] (S where empty), v_win [B,H,M,dv], n [B,H,S], u_mean [B,H,S,dv]}, all float64 / int."""
    h, dk, dv, s, m, eps = (
        config.n_heads,
        config.head_dim,
        config.vq_value_dim,
        config.vq_codes,
        config.vq_mem_len,
        config.norm_eps,
    )

    def p(module, name):
        return np.asarray(params[f"{prefix}/{module}" if module else prefix][name], F64)

    x = np.asarray(x, F64)
    b, t, d = x.shape
    s4 = dk**-0.25

    def heads(y, width):  # [B, T, H*width] → [B, H, T, width]
        return y.reshape(b, t, h, width).transpose(0, 2, 1, 3)

    xt = _rms(x, eps) * p("input_norm", "scale") + p("input_norm", "bias")
    q = _rms(heads(xt @ p("q_proj", "w"), dk), eps) * s4
    kvg = xt @ p("kvg_proj", "w")
    k = _rms(heads(kvg[..., : h * dk], dk), eps) * s4
    v = _silu(heads(kvg[..., h * dk : h * (dk + dv)], dv))
    g = _silu(kvg[..., h * (dk + dv) :])
    c_sum = np.asarray(codebook[f"{prefix}/codebook"]["c_sum"], F64)
    c_count = np.asarray(codebook[f"{prefix}/codebook"]["c_count"], F64)
    codes = c_sum / np.maximum(c_count, 0.01)[..., None]  # [H, S, dk]
    dist = np.sum((k[:, :, :, None, :] - codes[None, :, None]) ** 2, axis=-1)  # [B, H, T, S]
    z = np.argmin(dist, axis=-1)
    k_hat = codes[np.arange(h)[None, :, None], z]  # [B, H, T, dk]

    omega = config.vq_pe_lam ** (-2.0 * np.arange(d // 2) / d)
    angles = np.arange(m + 1)[:, None] * omega
    emb = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)  # [M+1, D], distance 0..M
    r = (emb @ p("r_proj", "w")).reshape(m + 1, h, dk).transpose(1, 0, 2) * s4  # [H, M+1, dk]
    u = p("", "xl_u").reshape(h, dk) * s4
    vb = p("", "xl_v").reshape(h, dk) * s4

    wv = np.zeros((b, h, t, dv))
    for start in range(0, t, query_chunk):
        rows = np.arange(start, min(t, start + query_chunk))
        qc = q[:, :, rows]
        logits = np.einsum("bhid,bhjd->bhij", qc + u[:, None], k_hat)  # [B, H, I, T]
        band = np.einsum("bhid,hed->bhie", qc + vb[:, None], r)  # [B, H, I, M+1]
        for e in range(m + 1):  # distance e: key t - e
            keys = rows - e
            ok = keys >= 0
            logits[:, :, np.nonzero(ok)[0], keys[ok]] += band[:, :, ok, e]
        logits = np.where(np.arange(t)[None, :] <= rows[:, None], logits, -np.inf)
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        wv[:, :, rows] = np.einsum("bhij,bhjd->bhid", probs, v)
    wv = wv.transpose(0, 2, 1, 3).reshape(b, t, h * dv)
    res = (wv * g) @ p("o_proj", "w")

    old = max(t - m, 0)  # tokens older than the window
    hits = np.eye(s)[z[:, :, :old]]  # [B, H, old, S]
    n = hits.sum(axis=2)
    u_mean = np.einsum("bhts,bhtd->bhsd", hits, v[:, :, :old]) / np.maximum(n, 1)[..., None]
    z_win = np.full((b, h, m), s)
    v_win = np.zeros((b, h, m, dv))
    z_win[:, :, m - (t - old) :] = z[:, :, old:]
    v_win[:, :, m - (t - old) :] = v[:, :, old:]
    return {"res": res, "wv": wv, "z": z, "z_win": z_win, "v_win": v_win, "n": n, "u_mean": u_mean}
