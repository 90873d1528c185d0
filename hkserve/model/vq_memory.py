"""VQ memory: the Transformer-VQ state of every gated attention unit (GAU), batched over serving slots.

Per GAU and row it holds the codes and values of the last M tokens (the window, attended exactly with
the position band) and, for every older token, only how many had each code and the mean of their
values. Its size does not depend on how many tokens came before, nor on the block length, so a state
built by a prefill of any bucket is valid for one-token decode steps (docs/transformer-vq.md).

The GAUs are stacked on a leading axis G = 2 * n_layers because the decoder scans over them; `step` is
shared by all GAUs since each sees the same tokens. A row whose step is 0 is empty whatever its other
fields hold, so resetting `step` alone (as for the KV memory) restarts a slot; `reset_slot` clears it all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkserve.model.config import ModelConfig

F32 = jnp.float32


class GAUState(NamedTuple):
    """The state of one GAU (or of all, with a leading [G] axis) for a batch of rows."""

    z_win: jax.Array  # [B, H, M] int32: codes of the last M tokens, oldest first; C = empty
    v_win: jax.Array  # [B, H, M, dv]: their values
    n: jax.Array  # [B, H, C] float32: count of older tokens per code
    u_mean: jax.Array  # [B, H, C, dv] float32: mean value of those tokens per code (0 where n = 0)


class VQMemory(NamedTuple):
    step: jax.Array  # [B] int32: tokens consumed per slot = position of the next token
    z_win: jax.Array  # [G, B, H, M] int32
    v_win: jax.Array  # [G, B, H, M, dv] (float32, or bfloat16 for bfloat16 weights)
    n: jax.Array  # [G, B, H, C] float32 (exact integer counts up to 2**24)
    u_mean: jax.Array  # [G, B, H, C, dv] float32

    @property
    def batch(self) -> int:
        return self.step.shape[0]

    @property
    def layers(self) -> GAUState:
        return GAUState(self.z_win, self.v_win, self.n, self.u_mean)


def value_dtype(config: ModelConfig):
    return jnp.bfloat16 if config.dtype == "bfloat16" else F32


def init_memory(config: ModelConfig, batch: int, max_len: int | None = None) -> VQMemory:
    """Empty memory for `batch` slots. `max_len` is accepted for the KV interface and ignored: the VQ
    state has no length axis. Every field is its own zero array so all can be donated."""
    g, h, m, s, dv = 2 * config.n_layers, config.n_heads, config.vq_mem_len, config.vq_codes, config.vq_value_dim
    return VQMemory(
        step=jnp.zeros((batch,), jnp.int32),
        z_win=jnp.full((g, batch, h, m), s, jnp.int32),
        v_win=jnp.zeros((g, batch, h, m, dv), value_dtype(config)),
        n=jnp.zeros((g, batch, h, s), F32),
        u_mean=jnp.zeros((g, batch, h, s, dv), F32),
    )


def insert_slot(memory: VQMemory, slot_memory: VQMemory, slot: jax.Array | int) -> VQMemory:
    """Copy a one-slot memory (from a prefill) into slot `slot` of the batched memory."""
    if slot_memory.batch != 1:
        raise ValueError(f"insert_slot takes a one-slot memory, got batch {slot_memory.batch}")
    slot = jnp.asarray(slot, jnp.int32)

    def put(dst, src, axis):
        start = [jnp.int32(0)] * dst.ndim
        start[axis] = slot
        return jax.lax.dynamic_update_slice(dst, src.astype(dst.dtype), start)

    return VQMemory(
        put(memory.step, slot_memory.step, 0),
        *(put(dst, src, 1) for dst, src in zip(memory.layers, slot_memory.layers)),
    )


def reset_slot(memory: VQMemory, slot: jax.Array | int) -> VQMemory:
    """Slot `slot` empty again: step 0, empty window codes, zero values, counts and means."""
    s = memory.n.shape[-1]
    return VQMemory(
        step=memory.step.at[slot].set(0),
        z_win=memory.z_win.at[:, slot].set(s),
        v_win=memory.v_win.at[:, slot].set(0),
        n=memory.n.at[:, slot].set(0),
        u_mean=memory.u_mean.at[:, slot].set(0),
    )


def read_rows(memory: VQMemory, rows: jax.Array | None) -> tuple[jax.Array, GAUState]:
    """(step [b], the stacked state [G, b, ...]) of memory rows `rows` (None: all), rows at step 0
    cleared."""
    step = memory.step if rows is None else memory.step[rows]
    fresh = step == 0
    s = memory.n.shape[-1]

    def clear(x, empty):  # x: [G, B, ...]
        x = x if rows is None else x[:, rows]
        return jnp.where(fresh.reshape((1, -1) + (1,) * (x.ndim - 2)), jnp.asarray(empty, x.dtype), x)

    return step, GAUState(*(clear(x, e) for x, e in zip(memory.layers, (s, 0, 0, 0))))


def write_rows(memory: VQMemory, rows: jax.Array | None, new: GAUState, lengths: jax.Array) -> VQMemory:
    """Store the new state of rows `rows` (None: all) and advance their step; rows with lengths 0
    keep every bit."""
    moved = lengths > 0

    def put(old, x):  # old: [G, B, ...]; x: [G, b, ...]
        keep = moved.reshape((1, -1) + (1,) * (x.ndim - 2))
        if rows is None:
            return jnp.where(keep, x.astype(old.dtype), old)
        return old.at[:, rows].set(jnp.where(keep, x.astype(old.dtype), old[:, rows]))

    step = memory.step + lengths if rows is None else memory.step.at[rows].add(lengths)
    return VQMemory(step.astype(jnp.int32), *(put(old, x) for old, x in zip(memory.layers, new)))


def advance(state: GAUState, z: jax.Array, v: jax.Array, lengths: jax.Array) -> GAUState:
    """The state of one GAU after a block: z [B, H, T] codes and v [B, H, T, dv] values of the block,
    of which the first lengths[b] are real. The window takes the last M real tokens; the lengths[b]
    oldest entries of window + block leave it and join the per-code counts and means (float32)."""
    m, s, t = state.z_win.shape[-1], state.n.shape[-1], z.shape[-1]
    z_all = jnp.concatenate([state.z_win, z], axis=-1)  # [B, H, M+T]
    v_all = jnp.concatenate([state.v_win.astype(F32), v.astype(F32)], axis=-2)  # [B, H, M+T, dv]
    # At most T entries leave, all among the first T of window + block.
    leaving = jnp.arange(t)[None, :] < lengths[:, None]  # [B, T]
    hits = jax.nn.one_hot(z_all[..., :t], s, dtype=F32) * leaving[:, None, :, None]  # [B, H, T, C]; C → 0
    count = hits.sum(axis=-2)  # [B, H, C]
    v_sum = jnp.einsum("bhts,bhtd->bhsd", hits, v_all[..., :t, :])  # [B, H, C, dv]
    n = state.n + count
    # Running mean; codes that gained nothing keep their mean bit for bit.
    delta = (v_sum - count[..., None] * state.u_mean) / jnp.maximum(n, 1.0)[..., None]
    u_mean = jnp.where(count[..., None] > 0, state.u_mean + delta, state.u_mean)
    keep = lengths[:, None, None] + jnp.arange(m)[None, None, :]  # [B, 1, M]
    z_win = jnp.take_along_axis(z_all, keep, axis=-1)
    v_win = jnp.take_along_axis(v_all, keep[..., None], axis=-2).astype(state.v_win.dtype)
    return GAUState(z_win, v_win, n, u_mean)
