"""Paged decode attention as a Pallas kernel: the GPU path of one new token per row over a paged KV
pool (model/paged_memory.py's layout), reading only the row's blocks through its block table.

One program per (row, KV head, split): the KV head's G query heads (GQA; padded to 16 rows, the
smallest Triton dot) walk their split's share of the row's blocks with an online softmax (flash
decoding's running max and sum), from the window's first block to the last block below the row's
length; a block index is read from the table in the loop, so nothing but those blocks is loaded.
Each program returns its unnormalised sum with its max and denominator, and `paged_decode_attention`
folds the splits, the new token's own key and gpt-oss's sinks into one softmax in plain JAX, so the
kernel needs neither. The same kernel runs under Triton on a GPU and in Pallas's interpreter on a CPU
(`interpret=True`, the tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
NEG = -1e30  # a masked score: finite, so exp(NEG - m) is 0 and never NaN
MIN_ROWS = 16  # Triton's dot takes at least 16 rows, columns and inner dims


class PagedPast(NamedTuple):
    """The past a paged decode step reads: one layer of the pools, through the rows' block tables."""

    k: jax.Array  # [L, NB, bs, Hkv, Dh] the pool's keys (rotated)
    v: jax.Array  # [L, NB, bs, Hkv, Dh]
    layer: jax.Array  # [] int32: the layer read
    table: jax.Array  # [B, MB] int32: row b's position p lies in block table[b, p // bs]
    seen: jax.Array  # [B] int32: the row's keys at positions < seen
    q_pos: jax.Array  # [B] int32: the new token's position; a window ends there
    window: jax.Array  # [] int32: the last `window` positions only, 0 = all


class PastPartial(NamedTuple):
    """What the kernel returns for the past of each (split, row, KV head, query head)."""

    acc: jax.Array  # [Sp, B, Hkv, Gp, Dh] float32: sum over seen keys of exp(score - top) * value
    top: jax.Array  # [Sp, B, Hkv, Gp] float32: the largest seen score, NEG where none was seen
    mass: jax.Array  # [Sp, B, Hkv, Gp] float32: sum over seen keys of exp(score - top)


def default_splits(max_blocks: int) -> int:
    """Splits of a row's blocks: one per 16 table columns, at most 8 (more programs for a GPU's SMs at
    few rows and long tables; each split adds one partial for the combine). Not tuned on a GPU yet."""
    return max(1, min(8, max_blocks // 16))


def unsupported(block_size: int, head_dim: int, kv_dtype) -> str | None:
    """Why the kernel cannot run this pool (Triton's power-of-two blocks, its dot's 16 minimum, the
    float32 and bfloat16 pools), or None."""
    for name, n in (("block size", block_size), ("head dim", head_dim)):
        if n < MIN_ROWS or n & (n - 1):
            return f"{name} {n} is not a power of two >= {MIN_ROWS}"
    if jnp.dtype(kv_dtype) not in (jnp.dtype(F32), jnp.dtype(jnp.bfloat16)):
        return f"a {jnp.dtype(kv_dtype).name} KV pool (float32 and bfloat16 only)"
    return None


def _kernel(scalars_ref, seen_ref, q_pos_ref, table_ref, q_ref, k_ref, v_ref, acc_ref, top_ref, mass_ref, *, cap, per):
    """One (row, KV head, split): q_ref [Gp, Dh]; the pools [L, NB, bs, Hkv, Dh] read block by block."""
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, window = scalars_ref[0], scalars_ref[1]
    seen, q_pos = seen_ref[b], q_pos_ref[b]
    nb, bs = k_ref.shape[1], k_ref.shape[2]
    first = jnp.where(window > 0, jnp.maximum(q_pos - window + 1, 0), 0)  # first position in the window
    lo = jnp.maximum(first // bs, split * per)
    hi = jnp.minimum((seen + bs - 1) // bs, (split + 1) * per)
    q = q_ref[...].astype(F32)  # [Gp, Dh]

    def block(j, carry):
        acc, top, mass = carry
        index = jnp.minimum(table_ref[b, j], nb - 1)  # a table never names a block past the pool here
        k = k_ref[layer, index, :, h, :].astype(F32)  # [bs, Dh]
        v = v_ref[layer, index, :, h, :].astype(F32)
        s = plgpu.dot(q, k, trans_b=True)  # [Gp, bs]
        if cap:
            s = cap * jnp.tanh(s / cap)
        pos = j * bs + jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)  # [1, bs]
        visible = (pos < seen) & (pos >= first)
        s = jnp.where(visible, s, NEG)
        top_next = jnp.maximum(top, jnp.max(s, axis=1))  # [Gp]
        p = jnp.where(visible, jnp.exp(s - top_next[:, None]), 0.0)  # [Gp, bs]
        scale = jnp.exp(top - top_next)
        return acc * scale[:, None] + plgpu.dot(p, v), top_next, mass * scale + jnp.sum(p, axis=1)

    rows, dim = q_ref.shape
    start = (jnp.zeros((rows, dim), F32), jnp.full((rows,), NEG, F32), jnp.zeros((rows,), F32))
    acc_ref[...], top_ref[...], mass_ref[...] = jax.lax.fori_loop(lo, jnp.maximum(lo, hi), block, start)


@functools.partial(jax.jit, static_argnames=("cap", "splits", "interpret"))
def past_partials(
    q: jax.Array, past: PagedPast, *, cap: float = 0.0, splits: int = 1, interpret: bool = False
) -> PastPartial:
    """The kernel over the past: q [B, Hkv, Gp, Dh] (Gp a power of two >= 16). The table's MB blocks are
    cut into `splits` contiguous shares, one program each."""
    rows, heads, gp, dim = q.shape
    per = -(-past.table.shape[1] // splits)
    scalars = jnp.stack([jnp.asarray(past.layer, jnp.int32), jnp.asarray(past.window, jnp.int32)])
    whole = pl.BlockSpec()  # the whole array: scalars, tables and pools are indexed in the kernel
    per_program = pl.BlockSpec((None, None, gp, dim), lambda b, h, s: (b, h, 0, 0))
    out_specs = [
        pl.BlockSpec((None, None, None, gp, dim), lambda b, h, s: (s, b, h, 0, 0)),
        pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0)),
        pl.BlockSpec((None, None, None, gp), lambda b, h, s: (s, b, h, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((splits, rows, heads, gp, dim), F32),
        jax.ShapeDtypeStruct((splits, rows, heads, gp), F32),
        jax.ShapeDtypeStruct((splits, rows, heads, gp), F32),
    ]
    parts = pl.pallas_call(
        functools.partial(_kernel, cap=cap, per=per),
        grid=(rows, heads, splits),
        in_specs=[whole, whole, whole, whole, per_program, whole, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="hk_paged_decode_attention",
    )(*(scalars, *(jnp.asarray(x, jnp.int32) for x in (past.seen, past.q_pos, past.table))), q, past.k, past.v)
    return PastPartial(*parts)


def paged_decode_attention(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    past: PagedPast,
    cap: float = 0.0,
    sinks: jax.Array | None = None,
    *,
    splits: int = 1,
    interpret: bool = False,
) -> jax.Array:
    """Attention of one new token per row: q [B, Hkv, G, Dh] (rotated and scaled) over its own k_new/v_new
    [B, Hkv, Dh] and its past, each score soft-capped by `cap` (> 0), with gpt-oss's sink logits [Hkv, G]
    in the denominator → [B, Hkv, G, Dh] float32."""
    groups = q.shape[2]
    gp = max(MIN_ROWS, 1 << (groups - 1).bit_length())
    padded = jnp.pad(q.astype(F32), ((0, 0), (0, 0), (0, gp - groups), (0, 0)))
    part = past_partials(padded, past, cap=cap, splits=splits, interpret=interpret)
    part = PastPartial(*(x[:, :, :, :groups] for x in part))
    own = jnp.einsum("bhgd,bhd->bhg", q.astype(F32), k_new.astype(F32))  # [B, Hkv, G]
    if cap:
        own = cap * jnp.tanh(own / cap)
    return _combine(part, own, v_new.astype(F32), None if sinks is None else sinks.astype(F32))


def _combine(part: PastPartial, own: jax.Array, v_new: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """One softmax over the splits' partials [Sp, B, Hkv, G], the new token's own score `own` [B, Hkv, G]
    with its value v_new [B, Hkv, Dh], and the sinks' logits [Hkv, G] (no value) → [B, Hkv, G, Dh]."""
    top = jnp.maximum(jnp.max(part.top, axis=0), own)
    if sinks is not None:
        top = jnp.maximum(top, sinks[None])
    weight = jnp.exp(part.top - top)  # [Sp, B, Hkv, G]
    own_weight = jnp.exp(own - top)
    mass = jnp.sum(part.mass * weight, axis=0) + own_weight
    if sinks is not None:
        mass = mass + jnp.exp(sinks[None] - top)
    out = jnp.sum(part.acc * weight[..., None], axis=0) + own_weight[..., None] * v_new[:, :, None, :]
    return out / mass[..., None]
