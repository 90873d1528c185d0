"""Prefix blocks shared by reference on the paged layout (issue 34, step 2), on a tiny random model:
two requests with a common 300-token prefix hold its blocks once and reply as uncached; a shared
block outlives the slot that let go of it; eviction frees the least recently used idle prefix and
never a block a running request names; the block pool's refcounts and copy-on-write."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.engine.block_pool import BlockPool
from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import block_bytes
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96, sliding_window=24, sliding_layers=(True, False), context_length=384)
F32 = jax.tree_util.tree_map(np.asarray, init_params(CONFIG, 7))
GREEDY = SamplingParams(temperature=0.0)
PREFIX = [(7 * i + 3) % 96 for i in range(300)]


def make_runner(layout: str = "paged", prefix_cache: str = "on", slots: int = 4, blocks: int | None = None):
    kv = {"kv_layout": "paged", "block_size": 16} if layout == "paged" else {"kv_layout": "static"}
    if blocks is not None:
        kv["kv_cache_mb"] = blocks * block_bytes(CONFIG, 16) / 2**20
    options = EngineOptions(slots=slots, max_len=384, prefill_buckets=(8, 64), prefix_cache=prefix_cache, **kv)
    engine = Engine(build_model(CONFIG), F32, options)
    # the test's thread is the loop; a budget that prefills a 300-token prompt in its first pass (the
    # tests count passes), not the CPU default's one small chunk a pass
    return InferenceRunner(engine, max_queue=64, max_step_tokens=slots + 512)


def submit(runner: InferenceRunner, request: Request, passes: int = 1):
    """Submit, then run `passes` loop passes (the prefill is dispatched by the first)."""
    stream = runner.submit(request)
    for _ in range(passes):
        runner.iterate()
    return stream


def finish(runner: InferenceRunner, streams) -> None:
    """Loop passes, the pool checked after each, until every stream is done."""
    while not all(s.done for s in streams):
        runner.iterate()
        runner.engine.kv_pool.check()


def replies(stream) -> list[int]:
    events = list(stream)
    assert events[-1].finish_reason in ("stop", "length"), events[-1]
    return [e.token.id for e in events if e.token is not None]


@pytest.fixture(scope="module")
def uncached():
    """Each request alone on the static layout without a prefix cache: the independent reference (one
    engine for the module: nothing of one request stays for the next)."""
    runner = make_runner("static", "off")

    def replies_alone(requests: list[Request]) -> list[list[int]]:
        out = []
        for request in requests:
            stream = runner.submit(request)
            while not stream.done:
                runner.iterate()
            out.append(replies(stream))
        return out

    return replies_alone


def slot_of(runner: InferenceRunner, stream) -> int:
    return next(i for i, s in enumerate(runner._slots) if s is not None and s.stream is stream)


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_two_requests_with_a_common_300_token_prefix_hold_its_blocks_once(mode, uncached):
    a = Request(PREFIX + [1, 2, 3], 24, GREEDY)
    b = Request(PREFIX + [4, 5], 24, GREEDY)
    runner = make_runner(prefix_cache=mode)
    first = submit(runner, a)
    second = submit(runner, b)
    pool = runner.engine.kv_pool
    rows = pool.held[slot_of(runner, first)], pool.held[slot_of(runner, second)]
    reused = 256 if mode == "exact" else 300  # exact reuses whole 64-token chunks
    full = reused // 16
    assert second.cached_tokens == reused
    assert rows[0][:full] == rows[1][:full]  # the same blocks, by reference
    assert not set(rows[0][full:]) & set(rows[1][full:])  # the rest (the prefix's partial block too) each its own
    assert pool.used == len(set(rows[0]) | set(rows[1])) == len(rows[0]) + len(rows[1]) - full
    pool.check()
    finish(runner, [first, second])
    assert [replies(first), replies(second)] == uncached([a, b])


def test_a_shared_block_outlives_the_slot_that_let_go_of_it(uncached):
    """a and b share the prefix; a ends, and its slot (the only free one) takes c, an unrelated
    300-token prompt, while b still decodes: the blocks b names must not go to c. Planted (truncate
    freeing a block other rows still name) b's reply changes."""
    a, b = Request(PREFIX + [1], 2, GREEDY), Request(PREFIX + [2], 40, GREEDY)
    c = Request([(5 * i + 1) % 96 for i in range(300)], 4, GREEDY)
    runner = make_runner(slots=2)
    first = submit(runner, a)
    second = submit(runner, b)
    assert second.cached_tokens == 300
    finish(runner, [first])
    assert not second.done
    third = submit(runner, c)
    assert slot_of(runner, third) == 1 - slot_of(runner, second)
    finish(runner, [first, second, third])
    assert [replies(s) for s in (first, second, third)] == uncached([a, b, c])


def test_a_prefix_reused_in_place_up_to_inside_a_shared_block_writes_a_copy_of_it(uncached):
    """b shares a's two full blocks and ends; d, sharing a's first 20 tokens, reuses b's idle slot in
    place, its prefix ending inside block 1, which a (still decoding, its sliding window on it) names:
    d writes positions 20-31 into its own copy of that block (copy-on-write), so a's and d's replies
    equal their uncached ones. Planted (no copy) a's reply changes."""
    a, b = Request(PREFIX[:40] + [1], 40, GREEDY), Request(PREFIX[:40] + [2], 2, GREEDY)
    d = Request(PREFIX[:20] + [9] * 12, 8, GREEDY)
    runner = make_runner(slots=2)
    first = submit(runner, a)
    second = submit(runner, b)
    b_slot = slot_of(runner, second)
    finish(runner, [second])
    assert not first.done
    fourth = submit(runner, d)
    assert fourth.cached_tokens == 20 and slot_of(runner, fourth) == b_slot
    pool = runner.engine.kv_pool
    a_row, d_row = pool.held[slot_of(runner, first)], pool.held[b_slot]
    assert d_row[0] == a_row[0] and d_row[1] != a_row[1]
    finish(runner, [first, fourth])
    assert [replies(first), replies(second), replies(fourth)] == uncached([a, b, d])


def test_eviction_frees_the_least_recently_used_idle_prefix_and_never_a_referenced_block(uncached):
    """x (older) and y (newer) end and keep their prefixes; r, still running, shares x's six full
    blocks. 13 of the 24 blocks are named (x 7, r 2 of its own, y 4); z's 180-token prompt needs 12
    now: evicting x's slot (its one private block; the six r names stay) is enough, so y's prefix
    stays cached, and r replies as uncached."""
    px = PREFIX[:100]
    x, r = Request(px, 2, GREEDY), Request(px[:96] + [95] * 20, 40, GREEDY)
    y, z = Request(PREFIX[100:160], 2, GREEDY), Request([(5 * i + 1) % 96 for i in range(180)], 2, GREEDY)
    runner = make_runner(blocks=24)
    pool, cache = runner.engine.kv_pool, runner.prefix
    xs = submit(runner, x)
    x_slot = slot_of(runner, xs)
    rs = submit(runner, r)
    assert rs.cached_tokens == 96
    finish(runner, [xs])
    ys = submit(runner, y)
    y_slot = slot_of(runner, ys)
    finish(runner, [ys])
    shared = pool.held[slot_of(runner, rs)][:6]
    assert pool.held[x_slot][:6] == shared and len(pool.held[x_slot]) == 7 and len(pool.held[y_slot]) == 4
    assert pool.committed(0, 3) == 13 and not pool.fits(3, 181)  # z's prompt and first token do not fit
    zs = submit(runner, z)
    assert slot_of(runner, zs) == 3 and pool.held[x_slot] == [] and cache.usable(x_slot, px) == 0
    assert len(pool.held[y_slot]) == 4 and cache.usable(y_slot, y.prompt_ids + [0]) == 60  # y stays cached
    assert pool.held[slot_of(runner, rs)][:6] == shared and all(pool.refs[shared] == 1)
    pool.check()
    finish(runner, [rs, zs])
    assert [replies(rs), replies(zs)] == uncached([r, z])


def test_block_pool_refcounts_and_copy_on_write():
    pool = BlockPool(8, 4, slots=3, max_blocks=4)
    pool.grow(0, 10)  # blocks 0, 1, 2: positions 0-9
    pool.share(1, 0, 10)  # slot 1's prefix of 10: the two full blocks by reference
    pool.grow(1, 12)
    assert pool.held[1] == [0, 1, 3] and list(pool.refs[:4]) == [2, 2, 1, 1] and pool.used == 4
    pool.reserve(1, 16)  # slot 1 may grow to 4 blocks: one more
    assert pool.committed(0) == 5  # blocks 0-3 once, plus slot 1's promise
    assert pool.fits(2, 16, shared=1) and not pool.fits(2, 16) and pool.fits(2, 12)
    pool.check()
    with pytest.raises(ValueError, match="holds nothing"):
        pool.share(1, 0, 10)
    pool.drop(0)  # slot 0 lets go: its shared blocks stay slot 1's, its own is free
    assert list(pool.refs[:4]) == [1, 1, 0, 1] and pool.used == 3
    pool.check()
    pool.share(2, 1, 8)
    assert pool.unshare_tail(2, 8) is None  # position 8 starts a block slot 2 does not hold
    pool.truncate(1, 6)  # reused in place up to position 6: block 1 is shared with slot 2
    assert pool.unshare_tail(1, 6) == 1 and pool.held[1] == [0, 3] and pool.held[2] == [0, 1]
    assert pool.unshare_tail(1, 6) is None  # now slot 1's own
    pool.check()
    pool.refs[0] += 1  # a refcount that no longer says how many rows name the block
    with pytest.raises(AssertionError, match="refcounts"):
        pool.check()
    pool.refs[0] -= 1
    pool._free[0].append(pool.held[2][1])  # a named block on the free list
    with pytest.raises(AssertionError, match="free and named"):
        pool.check()


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_more_distinct_prefixes_than_slots_stay_cached_in_the_pool(mode, uncached):
    """--slots 2: three requests with different 300-token prompts, one after another, then the first
    again. The third took the first's slot, but the first's full blocks stay cached in the pool
    (block_cache.py), and the fourth takes them by reference in whatever slot it lands in; it replies
    as uncached. Planted (a dropped cached block freed, not parked) cached_tokens is 0."""
    prompts = [[(k * i + 3 * k + 1) % 96 for i in range(300)] for k in (5, 7, 11)]
    requests = [Request(p, 8, GREEDY) for p in prompts + prompts[:1]]
    runner = make_runner(prefix_cache=mode, slots=2, blocks=80)
    pool, streams = runner.engine.kv_pool, []
    for i, request in enumerate(requests):
        streams.append(submit(runner, request))
        if i == 0:
            first_blocks = list(pool.held[slot_of(runner, streams[0])])
        if i < 3:
            assert streams[-1].cached_tokens == 0
            finish(runner, streams)
    reused = 256 if mode == "exact" else 288  # whole 64-token chunks / whole 16-token blocks, a token left
    assert streams[3].cached_tokens == reused
    assert pool.held[slot_of(runner, streams[3])][: reused // 16] == first_blocks[: reused // 16]
    finish(runner, streams)
    assert pool.cached > 0 and pool.used + pool.free_blocks() == pool.total  # cached blocks are available
    assert runner.stats().kv_blocks_cached == pool.cached and runner.stats().kv_blocks_used == pool.used
    assert [replies(s) for s in streams] == uncached(requests)
