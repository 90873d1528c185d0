"""Preemption on the paged layout (issue 34, step 3): the Scheduler's pure policy, and InferenceRunner
applying it over a FakeEngine that holds a real BlockPool (tokens by arithmetic: the last token + 1,
so a request resumed without its generated tokens replies differently). The test is the loop: every
event happens in the order it drives."""

from __future__ import annotations

import random
import re

import pytest
from fake_engine import FakeEngine, token_ids
from fastapi.testclient import TestClient

from hkserve.api.app import create_app
from hkserve.engine.block_pool import BlockPool
from hkserve.engine.constrained import GrammarCompiler, GrammarSpec
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.scheduler import Row, Scheduler
from hkserve.train.vocab import byte_tokenizer


def test_plan_evicts_idle_cached_blocks_first_then_preempts_the_newest():
    pool = BlockPool(8, 4, slots=4, max_blocks=4)
    pool.grow(0, 8)  # slot 0: 2 blocks (oldest request), slot 1: 2 (newest), slot 2: 3 (middle)
    pool.grow(1, 8)
    pool.grow(2, 12)
    pool.grow(3, 1)  # slot 3: idle, one cached block
    rows = [Row(0, order=1, tokens=9), Row(1, order=7, tokens=8), Row(2, order=4, tokens=12)]
    # 3 + 2 + 3 = 8 blocks for the step: the idle slot's block goes, nobody is preempted
    assert Scheduler(pool).plan_step(rows, idle_by_age=[3]) == ([3], [])
    rows[1] = Row(1, order=7, tokens=9)  # now 9 blocks: the newest (slot 1) goes, not the bigger slot 2
    assert Scheduler(pool).plan_step(rows, idle_by_age=[3]) == ([3], [1])
    rows = [Row(0, order=9, tokens=17), Row(1, order=7, tokens=16), Row(2, order=8, tokens=17)]
    # 5 + 4 + 5: both newer requests go before the oldest (slot 1) would; it alone fits
    assert Scheduler(pool).plan_step(rows, idle_by_age=[3]) == ([3], [0, 2])


def test_plan_works_per_data_shard():
    pool = BlockPool(8, 4, slots=4, max_blocks=4, shards=2)  # slots 0-1: blocks 0-3; slots 2-3: blocks 4-7
    rows = [Row(0, 0, 12), Row(1, 1, 8), Row(2, 2, 8), Row(3, 3, 8)]
    assert Scheduler(pool).plan_step(rows, []) == ([], [1])  # shard 0 needs 5 of 4; shard 1 fits (4)
    assert Scheduler(pool).roomy([0, 1, 2, 3], 4) == [0, 1, 2, 3]
    pool.reserve(2, 16)
    assert Scheduler(pool).roomy([0, 1, 2, 3], 4) == [0, 1, 2]  # slot 2 promised all of shard 1 (it may reuse it)


def alone_tokens(request: Request) -> list[int]:
    """The fake model's reply: each token the one after the last, from the prompt's last token."""
    return [(request.prompt_ids[-1] + k) % 100 for k in range(1, request.max_tokens + 1)]


def drive(runner: InferenceRunner, requests: list[Request], limit: int = 2000) -> list[list[int]]:
    """Submit all, iterate until every request ended (the pool checked after every pass) → token ids."""
    streams = [runner.submit(r) for r in requests]
    for _ in range(limit):
        if all(s.done for s in streams):
            break
        runner.iterate()
        runner.engine.kv_pool.check()
    out = []
    for s in streams:
        evs = list(s)
        assert evs[-1].finish_reason == "length", evs[-1]
        out.append(token_ids(evs))
    return out


@pytest.mark.parametrize("prefix_cache", ["off", "on"])
def test_requests_that_outgrow_the_pool_are_preempted_and_all_reply_as_alone(prefix_cache):
    """16 blocks of 4 tokens for 8 slots; 24 requests of up to 30 positions each. Admission by what a
    request needs now lets many run; as they grow the newest are preempted and resumed, repeatedly;
    every reply equals its alone reply and every block comes back (prefix cache on: idle slots keep
    theirs until a step or an admission needs them)."""
    rng = random.Random(5)
    requests = [
        Request([rng.randrange(1, 100) for _ in range(rng.randint(1, 10))], rng.randint(5, 20)) for _ in range(24)
    ]
    engine = FakeEngine(slots=8, kv_blocks=16, block_size=4, prefix_cache=prefix_cache)
    runner = InferenceRunner(engine, max_queue=64)
    seen = []
    real = runner._preempt

    def watching(slot):
        seen.append(runner._slots[slot].stream.order)
        real(slot)

    runner._preempt = watching
    assert drive(runner, requests) == [alone_tokens(r) for r in requests]
    assert runner.stats().preemptions == runner.preemptions == len(seen) > 5
    assert engine.kv_pool.reserved == [0] * 8
    assert engine.kv_pool.used == 0 if prefix_cache == "off" else engine.kv_pool.used > 0  # cached blocks kept
    # resumed requests prefill their prompt and the tokens they had delivered
    resumed = [c[2] for c in engine.calls if c[0] == "prefill" and not any(c[2] == r.prompt_ids for r in requests)]
    assert len(resumed) >= len(seen)


def test_the_oldest_running_request_is_never_preempted():
    """Two requests that each need 9 of a shard's 10 blocks at their end: the second (newer) is the one
    preempted, every time, and both finish."""
    engine = FakeEngine(slots=2, max_len=40, kv_blocks=10, block_size=4)
    runner = InferenceRunner(engine)
    first, second = Request([1, 2, 3, 4], 32), Request([50, 51], 34)
    order = {}
    preempted = []
    real = runner._preempt

    def watching(slot):
        preempted.append(order[runner._slots[slot].stream.request.id])
        real(slot)

    runner._preempt = watching
    streams = [runner.submit(first), runner.submit(second)]
    order = {s.request.id: i for i, s in enumerate(streams)}
    while not all(s.done for s in streams):
        runner.iterate()
    assert [token_ids(list(s)) for s in streams] == [alone_tokens(first), alone_tokens(second)]
    assert preempted and set(preempted) == {1}


def test_a_constrained_request_resumes_its_grammar_where_it_stopped():
    """A regex-constrained request preempted mid-reply: its resumed matcher has taken the tokens it had
    generated (a fresh matcher would mask for the first token again), so its reply is the alone one."""
    tokenizer = byte_tokenizer()
    grammar = GrammarCompiler(tokenizer, 300).compile(GrammarSpec("regex", "(ab|cd|ef){6}!"))
    engine = FakeEngine(slots=2, max_len=40, vocab_size=300, kv_blocks=10, block_size=4)
    runner = InferenceRunner(engine)
    constrained = Request([97, 98, 99], 16, stop_ids=(tokenizer.eos_id,), grammar=grammar)
    alone = drive_any(runner, [constrained])
    assert runner.preemptions == 0
    old = Request(list(range(1, 25)), 14)  # older: 7 of 10 blocks at once, 10 at its end (the other's 5th token)
    together = drive_any(runner, [old, Request([97, 98, 99], 16, stop_ids=(tokenizer.eos_id,), grammar=grammar)])
    assert runner.preemptions > 0
    resumed = [c[2] for c in engine.calls if c[0] == "prefill" and c[2][:3] == [97, 98, 99] and len(c[2]) > 4]
    assert resumed  # preempted after some of its tokens
    assert together[1] == alone[0] and together[0] == alone_tokens(old)
    assert re.fullmatch("(ab|cd|ef){6}!", tokenizer.decode([t for t in alone[0] if t != tokenizer.eos_id]))


def drive_any(runner: InferenceRunner, requests: list[Request]) -> list[list[int]]:
    streams = [runner.submit(r) for r in requests]
    for _ in range(500):
        if all(s.done for s in streams):
            break
        runner.iterate()
    return [token_ids(list(s)) for s in streams]


@pytest.mark.parametrize("blocks", [10, 11])
def test_admission_takes_what_a_request_needs_now_not_its_worst_case(blocks):
    """Two requests whose worst cases (9 blocks each) do not fit 10 or 11 blocks together both start at
    once: each needs 2 blocks now."""
    engine = FakeEngine(slots=2, max_len=40, kv_blocks=blocks, block_size=4)
    runner = InferenceRunner(engine)
    for r in (Request([1, 2, 3, 4], 32), Request([5, 6], 34)):
        runner.submit(r)
    runner.iterate()
    assert runner.stats().running == 2 and runner.stats().waiting == 0


def test_health_and_metrics_report_the_pool_and_the_preemptions():
    """/health "ok" carries the pool (blocks total / used / free, block size, preemptions) and /metrics
    hkserve_preemptions_total, both from the runner's published stats."""
    engine = FakeEngine(slots=2, max_len=40, vocab_size=300, kv_blocks=10, block_size=4)
    runner = InferenceRunner(engine)  # the test drives the loop; the app only reads its stats
    client = TestClient(create_app(runner, byte_tokenizer(), "fake", engine.max_len))
    runner.ready.set()
    assert client.get("/health").json()["kv_pool"]["preemptions"] == 0
    streams = [runner.submit(Request(list(range(1, 25)), 14)), runner.submit(Request([97, 98, 99], 30))]
    while runner.preemptions == 0:
        runner.iterate()
    pool = client.get("/health").json()["kv_pool"]
    expected = {"blocks_total": 10, "blocks_used": 8, "blocks_cached": 0, "blocks_free": 2, "block_size": 4}
    assert pool == {**expected, "preemptions": 1}
    assert pool["blocks_used"] == engine.kv_pool.used
    assert "hkserve_preemptions_total 1.0" in client.get("/metrics").text
    while not all(s.done for s in streams):
        runner.iterate()
    assert client.get("/health").json()["kv_pool"]["blocks_used"] == 0
