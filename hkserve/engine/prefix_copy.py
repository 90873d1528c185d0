"""Prefix caching's device side: how a prompt is cut into prefill chunks, and the copy of a cached
prefix's KV rows (paged: blocks) from one slot to another; and the paged memory's table update.

The copy is one compiled program per attention window (the rows copied are the window's, fixed-shape;
those past the prefix are never read, since the slot's step says where its memory ends), with the
decode state donated, so the memory is updated in place. It only writes the destination slot.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.engine.prefill_job import PrefillJob
from hkserve.engine.prefix_cache import Reuse
from hkserve.model.memory import KVMemory
from hkserve.model.paged_memory import PagedKVMemory
from hkserve.model.sampling import TokenHistory

EXACT_CHUNK = 64  # the "exact" mode's one prefill shape: every chunk has these many tokens, at multiples of it


class Chunk(NamedTuple):
    start: int  # first prompt position of the chunk
    end: int  # one past its last
    bucket: int  # tokens it is padded to
    attend_len: int  # past positions it reads (0: the slot starts afresh)


def plan_chunks(
    n: int,
    start: int,
    buckets: Sequence[int],
    window: Callable[[int], int],
    fixed: int | None = None,
    size: int | None = None,
    origin: int | None = None,
) -> list[Chunk]:
    """Chunks prefilling prompt positions [start, n).

    fixed: chunks of exactly `fixed` tokens at multiples of it (`start` must be one), so that any
    position's KV is computed through the same program whether or not a prefix was reused. Else
    chunks of `size` tokens (a bucket; None: the largest, the one-shot prefill's): an uncached prompt's
    first chunk is padded to the smallest bucket holding it and its later ones to `size` (one program
    per size and window), and a suffix after a reused prefix (`origin`, where the prefill began, > 0;
    None: `start`) is padded chunk by chunk to the smallest bucket holding it (short suffixes stay cheap).
    """
    if fixed:
        if start % fixed:
            raise ValueError(f"a fixed-chunk prefill starts at a multiple of {fixed}, not {start}")
        return [Chunk(s, min(n, s + fixed), fixed, window(s) if s else 0) for s in range(start, n, fixed)]
    size = size or buckets[-1]
    origin = start if origin is None else origin
    chunks = []
    for s in range(start, n, size):
        e = min(n, s + size)
        if s and not origin:
            chunks.append(Chunk(s, e, size, window(s)))
        else:
            chunks.append(Chunk(s, e, buckets[bisect.bisect_left(buckets, e - s)], window(s) if s else 0))
    return chunks


def rechunk(job: PrefillJob, buckets: Sequence[int], window: Callable[[int], int], size: int) -> PrefillJob:
    """The job with the chunks it has still to run planned again at `size` tokens (the pass's budget's
    chunk: Scheduler.chunk_size), from where its prefill has reached; the chunks run so far stay."""
    if job.done == len(job.chunks):
        return job
    start = job.chunks[job.done].start
    plan = plan_chunks(len(job.prompt_ids), start, buckets, window, size=size, origin=job.chunks[0].start)
    return job._replace(chunks=job.chunks[: job.done] + plan)


def check_reuse(
    reuse: Reuse | None, slot: int, n: int, slots: int, positions: np.ndarray, mode: str, chunk: int | None
) -> int:
    """Where a prefill of n prompt tokens into `slot` starts: after the reused prefix, which must leave a
    token to prefill, lie within what the source slot holds (positions: each slot's length) and, in
    fixed-chunk mode, end on a chunk boundary (cached blocks: the block pool checks them when the
    slot adopts them). Raises ValueError before any device work."""
    if reuse is None or reuse.length == 0:
        return 0
    if mode == "off":
        raise ValueError("prefix reuse asked of an engine made with prefix_cache='off'")
    if not (0 < reuse.length < n and 0 <= reuse.source < slots and 0 <= slot < slots):
        raise ValueError(f"cannot reuse {reuse} for a prompt of {n} tokens")
    if not reuse.blocks and reuse.length > positions[reuse.source]:
        raise ValueError(f"slot {reuse.source} holds {positions[reuse.source]} tokens, not {reuse.length}")
    if chunk and reuse.length % chunk:
        raise ValueError(f"exact reuse is whole chunks of {chunk} tokens, not {reuse.length}")
    return reuse.length


def copy_prefix(state, tokens: jax.Array, source: jax.Array, dest: jax.Array, length: jax.Array, source_row: jax.Array):
    """Slot dest [1] starts with the first length [1] positions of slot source [1]'s KV (tokens [W], the
    prefix padded to the copied window W, are what its penalties see as prompt); its generated-token
    counts start at zero. Returns the decode state with only dest's rows changed. Paged: source_row [MB]
    names the source's blocks, and only the prefix's blocks dest does not already name are copied (the
    partial last one: full ones are shared by reference, block_pool.py), so a shared block is never written."""
    memory: KVMemory | PagedKVMemory = state.memory
    w = tokens.shape[0]
    zero = jnp.int32(0)

    def copy(cache):  # [L, B, S, Hkv, Dh]: the window's rows of source onto dest
        rows = jax.lax.dynamic_slice(
            cache, (zero, source[0], zero, zero, zero), (cache.shape[0], 1, w, *cache.shape[3:])
        )
        return jax.lax.dynamic_update_slice(cache, rows, (zero, dest[0], zero, zero, zero))

    def copy_blocks(cache):  # [L, NB, bs, Hkv, Dh]: the prefix's blocks of source onto dest's own
        n = -(-w // cache.shape[2])
        src, dst = source_row[:n], memory.table[dest[0], :n]  # [n]; NB where not held
        outside = (src == dst) | (jnp.arange(n) * cache.shape[2] >= length[0])  # shared, or past the prefix
        dst = jnp.where(outside, cache.shape[1], dst)
        return cache.at[:, dst].set(jnp.take(cache, src, axis=1, mode="clip"), mode="drop")

    if isinstance(memory, PagedKVMemory):
        memory = memory._replace(k=copy_blocks(memory.k), v=copy_blocks(memory.v))
    else:
        memory = memory._replace(k=copy(memory.k), v=copy(memory.v))
    memory = memory._replace(step=memory.step.at[dest].set(length))
    vocab = state.history.in_prompt.shape[1]
    seen = jnp.zeros((vocab,), bool).at[jnp.where(jnp.arange(w) < length[0], tokens, vocab)].set(True, mode="drop")
    history = TokenHistory(state.history.counts.at[dest].set(0), state.history.in_prompt.at[dest].set(seen))
    return state._replace(memory=memory, history=history)


def set_table(state, table: jax.Array):
    """The decode state with the paged memory's block table [B, MB] replaced by the host's."""
    return state._replace(memory=state.memory._replace(table=table))
