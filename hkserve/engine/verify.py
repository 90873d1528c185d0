"""The compiled bodies of speculative decoding: one [B, K+1] verify step, and the small programs
that keep each slot's token context (what the n-gram lookup searches) in step with its memory.

A verify step feeds each row its last token plus its drafts, writes KV for all of them, and samples
every position exactly as K+1 plain steps would: the same settings, the RNG keyed by (seed, the
position the token takes), the penalties seeing the tokens before it. A draft is accepted iff it
equals the token sampled at its position, so the emitted run is the plain run's tokens by rule; KV
written for rejected drafts lies past the slot's step and is overwritten later.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from hkserve.engine.outputs import pack
from hkserve.engine.state import DecodeState
from hkserve.model.model import Model
from hkserve.model.ngram import propose
from hkserve.model.sampling import TokenHistory, sample

EXTRA = 3  # columns after a packed sample in a verify row: emitted, drafted, the slot's new step


def verify_step(
    model: Model,
    n_top: int,
    k: int,
    sizes: Sequence[int],
    attend_len: int,
    params,
    state: DecodeState,
    context: jax.Array,  # [B, S] int32 tokens by position
    active: jax.Array,  # [B] bool
    speculate: jax.Array,  # [B] bool: rows that may draft
):
    """→ (state, context, packed [B, K+1, 2 + 2 n_top + EXTRA]): row b's first `emitted` entries are
    its tokens in order; the last columns repeat (emitted, drafted, new step) on every entry."""
    b, s = context.shape
    rows = jnp.arange(b)
    memory = state.memory
    p = memory.step  # [B] position of each row's input token
    context = context.at[rows, jnp.where(active, p, s)].set(state.tokens, mode="drop")
    drafts = propose(context, p, k, sizes)
    room = jnp.maximum(s - 1 - p, 0)  # drafts take positions p+1.. and must fit the memory
    drafted = jnp.where(active & speculate, jnp.minimum(drafts.count, room), 0)  # [B]
    tokens = jnp.concatenate([state.tokens[:, None], drafts.tokens], axis=1)  # [B, K+1]
    lengths = active.astype(jnp.int32) * (1 + drafted)

    # Penalty history as the plain steps would see it: the input token, then each earlier draft.
    counts = state.history.counts.at[rows, state.tokens].add(active.astype(jnp.int32))  # [B, V]
    before = (jnp.arange(k)[None, :] < jnp.arange(k + 1)[:, None]).astype(jnp.int32)  # [K+1, K]: draft j before i
    extra = jnp.zeros((b, k + 1, counts.shape[1]), jnp.int32)
    extra = extra.at[rows[:, None, None], jnp.arange(k + 1)[None, :, None], drafts.tokens[:, None, :]].add(before[None])
    counts_at = counts[:, None] + extra  # [B, K+1, V]

    logits, memory = model.forward(params, tokens, memory, lengths, None, attend_len)  # [B, K+1, V]
    flat = b * (k + 1)
    settings = jax.tree_util.tree_map(lambda x: jnp.repeat(x, k + 1, axis=0), state.settings)
    history = TokenHistory(counts_at.reshape(flat, -1), jnp.repeat(state.history.in_prompt, k + 1, axis=0))
    positions = (p[:, None] + 1 + jnp.arange(k + 1)[None, :]).reshape(flat)
    out = sample(logits.reshape(flat, -1), settings, positions, n_top, history)
    sampled = out.token.reshape(b, k + 1)

    agree = (sampled[:, :k] == drafts.tokens) & (jnp.arange(k)[None, :] < drafted[:, None])
    accepted = jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)  # [B]
    emitted = active.astype(jnp.int32) * (accepted + 1)
    step = jnp.where(active, p + accepted + 1, p)
    # The tokens sampled at positions p+1..p+accepted+1 join the context; the last is the next input.
    write = jnp.where(jnp.arange(k + 1)[None, :] < emitted[:, None], p[:, None] + 1 + jnp.arange(k + 1), s)
    context = context.at[rows[:, None], write].set(sampled, mode="drop")
    state = DecodeState(
        memory._replace(step=step),
        jnp.where(active, sampled[rows, accepted], state.tokens),
        state.settings,
        state.history._replace(counts=jnp.where(active[:, None], counts_at[rows, accepted], counts)),
    )
    tail = jnp.stack([emitted, drafted, step], axis=1).astype(jnp.float32)  # [B, 3]
    packed = pack(out).reshape(b, k + 1, -1)
    packed = jnp.concatenate([packed, jnp.broadcast_to(tail[:, None], (b, k + 1, EXTRA))], axis=-1)
    return state, context, packed


def append_inputs(state: DecodeState, context: jax.Array, active: jax.Array) -> jax.Array:
    """Before a plain step: each active row's input token joins its context at its position."""
    b, s = context.shape
    where = jnp.where(active, state.memory.step, s)
    return context.at[jnp.arange(b), where].set(state.tokens, mode="drop")


def write_prompt(context: jax.Array, slot: jax.Array, prompt: jax.Array) -> jax.Array:
    """A prefilled slot's context: its prompt [S] (zero-padded) from position 0."""
    return context.at[slot].set(prompt)
