"""The device copy of a cached prefix (`copy_prefix`), without a model: a small random decode state of
each layout, copied through jit as the engine does, against a numpy reference of what must change (the
destination's rows or own blocks, its step, its token history) and what must not (every other slot,
every shared block, the block table, the other state fields). Fast enough to score its mutants."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest

from hkserve.engine.prefix_copy import copy_prefix, set_table
from hkserve.engine.state import DecodeState
from hkserve.model.memory import KVMemory
from hkserve.model.paged_memory import PagedKVMemory
from hkserve.model.sampling import TokenHistory

L, B, S, H, D, V = 2, 3, 16, 2, 3, 16  # layers, slots, rows per slot, kv heads, head dim, vocabulary
NB, BS, MB = 12, 4, 4  # pool blocks, rows per block, blocks per slot (static S = MB * BS)
W = 8  # the copied window


def _history(rng: np.random.Generator) -> TokenHistory:
    return TokenHistory(rng.integers(0, 5, (B, V)).astype(np.int32), rng.random((B, V)) < 0.5)


def _state(memory, rng: np.random.Generator) -> DecodeState:
    """Every field random, so a field written where it must not be shows."""
    return DecodeState(memory, rng.integers(0, V, (B,)).astype(np.int32), None, _history(rng))


def _static(rng: np.random.Generator) -> DecodeState:
    kv = [rng.standard_normal((L, B, S, H, D)).astype(np.float32) for _ in "kv"]
    return _state(KVMemory(*kv, rng.integers(1, S, (B,)).astype(np.int32)), rng)


def _paged(rng: np.random.Generator, table: np.ndarray) -> DecodeState:
    kv = [rng.standard_normal((L, NB, BS, H, D)).astype(np.float32) for _ in "kv"]
    return _state(PagedKVMemory(*kv, rng.integers(1, S, (B,)).astype(np.int32), table.astype(np.int32)), rng)


def _copy(state: DecodeState, tokens, source: int, dest: int, length: int, source_row) -> DecodeState:
    """copy_prefix through jit, as the engine calls it; a warning while tracing fails (JAX warns of an
    implicit unsafe cast, e.g. float into the bool prompt set, that its later releases refuse)."""
    args = [np.asarray(tokens, np.int32), *(np.asarray([x], np.int32) for x in (source, dest, length))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = jax.jit(copy_prefix)(state, *args, np.asarray(source_row, np.int32))
    return jax.tree_util.tree_map(np.asarray, out)


def _expected_history(state: DecodeState, tokens, dest: int, length: int) -> TokenHistory:
    """dest's counts zeroed; its prompt set exactly the prefix's tokens (the slot's old ones gone)."""
    counts, in_prompt = state.history.counts.copy(), state.history.in_prompt.copy()
    counts[dest] = 0
    in_prompt[dest] = False
    in_prompt[dest, np.asarray(tokens)[:length]] = True
    return TokenHistory(counts, in_prompt)


def _check_rest(out: DecodeState, state: DecodeState, tokens, dest: int, length: int) -> None:
    step = state.memory.step.copy()
    step[dest] = length
    np.testing.assert_array_equal(out.memory.step, step)
    np.testing.assert_array_equal(out.tokens, state.tokens)
    assert out.settings is None
    for got, want in zip(out.history, _expected_history(state, tokens, dest, length), strict=True):
        np.testing.assert_array_equal(got, want)


TOKENS = [3, 0, 3, 15, 7, 9, 9, 12]  # a repeat, token 0 and V - 1; the last three past a length of 5


@pytest.mark.parametrize("source, dest, length", [(0, 2, 5), (2, 1, 8), (1, 0, 1)])
def test_static_copy_writes_the_prefix_rows_of_dest_only(source, dest, length):
    rng = np.random.default_rng(source * 10 + dest)
    state = _static(rng)
    out = _copy(state, TOKENS, source, dest, length, np.zeros(1))
    for got, cache in zip(out.memory[:2], state.memory[:2], strict=True):  # k, v: [L, B, S, H, D]
        want = cache.copy()
        want[:, dest, :W] = cache[:, source, :W]
        # Rows [length, W) are the window's padding (never read past the step): either value is right.
        np.testing.assert_array_equal(got[:, dest, :length], want[:, dest, :length])
        np.testing.assert_array_equal(got[:, dest, W:], want[:, dest, W:])
        others = [b for b in range(B) if b != dest]
        np.testing.assert_array_equal(got[:, others], want[:, others])
    _check_rest(out, state, TOKENS, dest, length)


# Slot 1's blocks (the source's row); slot 0 shares its first block and owns blocks 8, 10 and none;
# slot 2 owns 11 and 6 and shares nothing. NB (12) marks a block not held.
TABLE = np.asarray([[2, 8, 10, NB], [2, 5, 7, 9], [11, 6, NB, NB]])


@pytest.mark.parametrize(
    "source, dest, length, window, copied",
    [
        (1, 0, 6, 8, {8: 5}),  # block 2 shared, the partial block 5 copied to dest's 8
        (1, 0, 8, 8, {8: 5}),  # the prefix ends on a block boundary: the next block is not copied
        (1, 0, 9, 16, {8: 5, 10: 7}),  # a third block begun: copied too
        (1, 0, 3, 16, {}),  # all of the prefix in the shared block: nothing written
        (1, 2, 5, 8, {11: 2, 6: 5}),  # nothing shared: both blocks copied
        (0, 2, 4, 16, {11: 2}),  # slot 0 as the source
    ],
)
def test_paged_copy_writes_dest_own_prefix_blocks_only(source, dest, length, window, copied):
    rng = np.random.default_rng(length * 10 + dest)
    state = _paged(rng, TABLE)
    tokens = (TOKENS * 2)[:window]
    out = _check_paged(state, tokens, source, dest, length, TABLE[source], copied)
    _check_rest(out, state, tokens, dest, length)


def test_paged_copy_reads_the_source_row_given_not_the_table():
    """In-place reuse (issue 34): slot 1 reuses its own prefix, which ended in the shared block 5; the
    table already names its fresh block 3 there, so block 5 is read (source_row) into 3 (copy-on-write)."""
    table = TABLE.copy()
    table[1, 1] = 3
    state = _paged(np.random.default_rng(7), table)
    out = _check_paged(state, TOKENS, 1, 1, 6, TABLE[1], {3: 5})
    _check_rest(out, state, TOKENS, 1, 6)


def _check_paged(state, tokens, source, dest, length, source_row, copied: dict[int, int]) -> DecodeState:
    """Blocks `copied` (dest's block: source's block) hold the source's; every other block is as it was."""
    out = _copy(state, tokens, source, dest, length, source_row)
    for got, cache in zip(out.memory[:2], state.memory[:2], strict=True):  # k, v: [L, NB, BS, H, D]
        want = cache.copy()
        for to, frm in copied.items():
            want[:, to] = cache[:, frm]
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(out.memory.table, state.memory.table)
    return out


def test_set_table_replaces_only_the_block_table():
    state = _paged(np.random.default_rng(3), TABLE)
    table = np.arange(B * MB, dtype=np.int32).reshape(B, MB)
    out = jax.tree_util.tree_map(np.asarray, jax.jit(set_table)(state, table))
    np.testing.assert_array_equal(out.memory.table, table)
    for got, want in zip(
        jax.tree_util.tree_leaves(out._replace(memory=out.memory._replace(table=0))),
        jax.tree_util.tree_leaves(state._replace(memory=state.memory._replace(table=0))),
        strict=True,
    ):
        np.testing.assert_array_equal(got, want)
