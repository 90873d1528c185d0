"""N-gram prompt lookup on the device (vLLM's `ngram`, transformers' `prompt_lookup_num_tokens`): the
tokens that followed the most recent earlier occurrence of a slot's last n tokens are its draft.

Pure array code over a fixed [B, S] context buffer, so it runs inside the compiled decode step and
the host never has to see the tokens before the next step is dispatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Drafts(NamedTuple):
    tokens: jax.Array  # [B, K] int32 proposed continuation (junk past count)
    count: jax.Array  # [B] int32 in 0..K: how many of tokens are proposed


def propose(context: jax.Array, last: jax.Array, k: int, sizes: Sequence[int]) -> Drafts:
    """context: [B, S] tokens by position, valid through `last` [B] (the newest token's position).

    For the longest n in `sizes` whose last-n-token suffix occurred earlier, the tokens after its most
    recent earlier occurrence, up to k of them and never past `last` (they must already exist)."""
    b, s = context.shape
    ends = jnp.arange(s, dtype=jnp.int32)[None, :]  # [1, S] candidate end of an earlier occurrence
    last = last.astype(jnp.int32)
    best = jnp.full((b,), -1, jnp.int32)
    for n in sorted(set(sizes)):  # a longer match found later overrides a shorter one
        match = (ends >= n - 1) & (ends < last[:, None]) & (last[:, None] >= n - 1)  # [B, S]
        for i in range(n):
            newest = jnp.take_along_axis(context, jnp.maximum(last - i, 0)[:, None], axis=1)  # [B, 1]
            match &= jnp.roll(context, i, axis=1) == newest  # position j holds context[j - i]
        end = jnp.max(jnp.where(match, ends, -1), axis=1)  # [B]
        best = jnp.where(end >= 0, end, best)
    count = jnp.where(best >= 0, jnp.minimum(k, last - best), 0).astype(jnp.int32)
    idx = jnp.clip(best[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None, :], 0, s - 1)  # [B, K]
    return Drafts(jnp.take_along_axis(context, idx, axis=1), count)


def first_draft(tokens: Sequence[int], sizes: Sequence[int]) -> tuple[int, int] | None:
    """(the first token `propose` would draft after `tokens`, the length of the suffix that matched),
    on the host: what a slot decoding plainly would have been offered, so its policy can see when
    drafting would pay again."""
    last = len(tokens) - 1
    for n in sorted(set(sizes), reverse=True):
        if last < n:
            continue
        suffix = list(tokens[last - n + 1 :])
        for end in range(last - 1, n - 2, -1):
            if tokens[end] == suffix[-1] and list(tokens[end - n + 1 : end + 1]) == suffix:
                return tokens[end + 1], n
    return None
