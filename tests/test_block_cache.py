"""The pool as the prefix cache (block_cache.py, block_pool.py; issue 34) on the host alone: full
blocks stay findable by their prefix once no slot names them, the least recently parked is evicted
first and only when the free list is empty, a block a slot names is never evicted, and a hash
collision never hands a prompt another prefix's block."""

from __future__ import annotations

import pytest

from hkserve.engine import block_cache
from hkserve.engine.block_pool import BlockPool, PoolExhausted, cached_reuse
from hkserve.engine.prefix_cache import PrefixCache, Reuse

BS = 4
A, B, C, D = ([k] * BS for k in (1, 2, 3, 4))  # one block's tokens each


def cached(pool: BlockPool, slot: int, tokens: list[int], upto: int | None = None) -> list[int]:
    """Slot `slot` (holding nothing) is given blocks for `tokens`, which become cached; its blocks."""
    pool.grow(slot, len(tokens))
    pool.register(slot, tokens, len(tokens) if upto is None else upto)
    return list(pool.held[slot])


def test_dropped_full_blocks_stay_cached_and_are_taken_by_reference():
    pool = BlockPool(8, BS, slots=2, max_blocks=4)
    blocks = cached(pool, 0, A + B + [5, 6])  # two full blocks cached; the partial third is not
    pool.drop(0)
    assert (pool.used, pool.cached, pool.free_blocks()) == (0, 2, 8)
    assert pool.cached_prefix(1, A + B + C, limit=4) == blocks[:2]
    assert pool.cached_prefix(1, A + C, limit=4) == blocks[:1]  # the first block only: the second differs
    assert pool.cached_prefix(1, A + B, limit=1) == blocks[:1]
    pool.adopt(1, blocks[:2])
    pool.grow(1, 10)
    assert pool.held[1][:2] == blocks[:2] and (pool.used, pool.cached) == (3, 0)
    pool.check()
    pool.cache.park(0, blocks[0])  # a named block also evictable
    with pytest.raises(AssertionError, match="both named and parked"):
        pool.check()
    pool.cache.unpark(0, blocks[0])
    pool.drop(1)
    with pytest.raises(ValueError, match="not a cached block"):
        pool.adopt(1, [blocks[2]])  # the partial block was never cached: back on the free list
    assert pool.held[1] == [] and blocks[2] in pool._free[0]
    pool.check()


def test_eviction_is_least_recently_parked_first_and_only_when_nothing_is_free():
    pool = BlockPool(6, BS, slots=3, max_blocks=2)
    x, y, z = cached(pool, 0, A + B), cached(pool, 1, C), cached(pool, 2, D)
    pool.drop(1)  # parked: y first, then x's (its last block first), then z
    pool.drop(0)
    pool.drop(2)
    pool.check()
    pool.grow(0, 8)  # two free blocks: nothing evicted
    assert pool.cached == 4 and pool.cached_prefix(1, C, 1) == y
    pool.drop(0)  # uncached blocks go back to the free list
    pool.grow(0, 8)
    pool.grow(1, 4)  # the free list is empty: y's block goes first
    assert pool.cached == 3 and pool.cached_prefix(2, C, 1) == [] and pool.cached_prefix(2, A + B, 2) == x
    pool.grow(1, 8)  # then x's second block, parked before its first
    assert pool.cached_prefix(2, A + B, 2) == x[:1] and pool.cached_prefix(2, D, 1) == z
    pool.check()


def test_a_block_a_slot_names_is_never_evicted():
    """Slot 1 takes x's cached blocks back; the pool then runs out: no named block is handed to another
    slot (planted: a cached block adopted stays in the LRU → slot 2 gets x's block, check() fails)."""
    pool = BlockPool(4, BS, slots=3, max_blocks=4)
    x = cached(pool, 0, A + B)
    pool.drop(0)
    pool.adopt(1, pool.cached_prefix(1, A + B, 2))
    pool.grow(2, 8)  # the two free blocks
    with pytest.raises(PoolExhausted):
        pool.grow(2, 12)
    assert pool.held[1] == x and not set(x) & set(pool.held[2])
    pool.check()
    assert pool.cached_prefix(0, A + B, 2) == x


@pytest.mark.parametrize("hash_of", [lambda parent, tokens: 0, lambda parent, tokens: hash(tokens)])
def test_a_hash_collision_never_hands_a_prompt_another_prefix(monkeypatch, hash_of):
    """Every key equal (a constant hash), or blind to the prefix before the block: the tokens and the
    predecessor's serial each entry keeps still refuse the wrong block (planted: no tokens check →
    the constant hash gives C+B A's first block; no predecessor check → C+B gets x's B after z's C)."""
    monkeypatch.setattr(block_cache, "chain_hash", hash_of)
    pool = BlockPool(8, BS, slots=2, max_blocks=4)
    x = cached(pool, 0, A + B)
    z = cached(pool, 1, C + D)
    pool.drop(0)
    pool.drop(1)
    found = pool.cached_prefix(0, C + B, 2)
    assert found in ([], z[:1])  # z's C at most (a constant hash keeps x's A alone), never x's B
    assert pool.cached_prefix(0, A + B, 2) == (x[:1] if hash_of(0, ()) == 0 else x)
    pool.check()


def test_admission_takes_whole_granules_of_cached_blocks_and_leaves_a_token_to_prefill():
    pool = BlockPool(16, BS, slots=2, max_blocks=8)
    prompt = [t for k in range(6) for t in [k] * BS]  # six full blocks
    blocks = cached(pool, 0, prompt)
    pool.drop(0)
    on = PrefixCache(2, "on", min_reuse=4)
    assert cached_reuse(pool, on, 1, prompt, None) == Reuse(1, 20, tuple(blocks[:5]))  # one token prefilled
    assert cached_reuse(pool, on, 1, prompt + [9], Reuse(0, 24)) == Reuse(0, 24)  # the slot's is as long
    assert on.hit == 20
    exact = PrefixCache(2, "exact", granule=8, min_reuse=4)
    assert cached_reuse(pool, exact, 1, prompt + [9], None) == Reuse(1, 24, tuple(blocks))
    assert cached_reuse(pool, exact, 1, prompt, None) == Reuse(1, 16, tuple(blocks[:4]))
    assert cached_reuse(pool, PrefixCache(2, "off"), 1, prompt + [9], None) is None
    assert cached_reuse(None, on, 1, prompt, None) is None


def test_a_prefix_reused_in_place_inside_a_cached_block_writes_a_copy_of_it():
    """Slot 0 alone names its cached second block; reused in place up to position 6 (inside it), the
    slot would overwrite positions 6-7 of a block the cache says holds B: it takes a copy instead,
    and the cached block stays findable (planted: copy only when shared → the slot keeps it)."""
    pool = BlockPool(4, BS, slots=1, max_blocks=2)
    x = cached(pool, 0, A + B)
    pool.truncate(0, 6)
    assert pool.unshare_tail(0, 6) == x[1] and pool.held[0][0] == x[0] and pool.held[0][1] != x[1]
    assert pool.cached_prefix(0, A + B, 2) == x and pool.cached == 1
    pool.check()
