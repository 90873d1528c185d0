"""Token-budget steps (`max_step_tokens`, issue 34 step 4) on FakeEngine (tokens by arithmetic: the last
token + 1): a long prompt is prefilled a few chunks per pass while the running requests get a token
every pass; the Scheduler's budget policy alone; preemption and cancellation of a request mid-prefill.
The test is the loop: it calls `iterate()`, so every event happens in the order it drives."""

from __future__ import annotations

import random
import re

from fake_engine import FakeEngine, events, token_ids

from hkserve.engine.constrained import GrammarCompiler, GrammarSpec
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.scheduler import Prefilling, Scheduler
from hkserve.train.vocab import byte_tokenizer


def test_a_running_stream_gets_a_token_every_pass_while_a_long_prompt_prefills():
    engine = FakeEngine(slots=2, chunk=8)
    runner = InferenceRunner(engine, max_step_tokens=9)  # one decode row + one chunk of 8
    running = runner.submit(Request([1, 2], 30))
    runner.iterate()
    runner.iterate()
    assert token_ids(events(running)) == [3, 4]
    long = runner.submit(Request(list(range(10, 50)), 3))  # 40 tokens: 5 chunks of 8
    gaps = []
    while not (first := token_ids(events(long))):
        runner.iterate()
        gaps.append(len(token_ids(events(running))))
    assert [c for c in engine.calls if c[0] == "prefill_chunk"][1:] == [
        ("prefill_chunk", 1, s, s + 8) for s in range(0, 40, 8)
    ]
    assert first == [50, 51]  # its first token (its last + 1), and the step it joined in the same pass
    # one token per pass for the running stream, every pass from the admission to the first token
    assert gaps == [1] * 6 and sum(gaps) >= 5
    while not running.done or not long.done:
        runner.iterate()
    assert token_ids(events(long)) == [52]


def test_the_budget_counts_decode_rows_and_admits_short_prompts_beside_a_prefill():
    engine = FakeEngine(slots=3, chunk=8)
    runner = InferenceRunner(engine, max_step_tokens=18)  # 18 - rows: two chunks of 8 a pass
    a = runner.submit(Request([5], 40))
    runner.iterate()
    long = runner.submit(Request([7] * 48, 2))  # 6 chunks
    runner.iterate()  # rows: a → budget 17: two chunks
    chunks = [c for c in engine.calls if c[0] == "prefill_chunk"]
    assert chunks[1:] == [("prefill_chunk", 1, 0, 8), ("prefill_chunk", 1, 8, 16)]
    short = runner.submit(Request([9, 9], 2))  # waits: the long prompt's 32 pending tokens exceed the budget
    runner.iterate()
    assert [c[2] for c in engine.calls if c[0] == "prefill_chunk"][1:] == [0, 8, 16, 24]
    assert runner.stats().waiting == 1
    runner.iterate()  # the last 16 tokens: the short prompt is admitted (16 pending < 17) with no room left
    assert [c[2] for c in engine.calls if c[0] == "prefill_chunk"][1:] == [0, 8, 16, 24, 32, 40]
    assert list(runner._prefills) == [2]
    runner.iterate()  # rows: a and long → 16: the short prompt's chunk
    assert engine.calls[-2:] == [("prefill_chunk", 2, 0, 2), ("step", [0, 1, 2])]
    while not (a.done and long.done and short.done):
        runner.iterate()
    assert token_ids(events(short)) == [10, 11] and token_ids(events(long)) == [8, 9]


def test_plan_prefill_never_exceeds_the_budget_and_serves_the_oldest_first():
    rng = random.Random(7)
    for _ in range(500):
        queue = [
            Prefilling(slot, rng.randrange(100), [rng.choice([8, 32]) for _ in range(rng.randint(1, 5))])
            for slot in range(rng.randint(1, 5))
        ]
        budget = rng.randint(32, 200)
        plan = Scheduler.plan_prefill(queue, budget)
        by_slot = {p.slot: p for p in queue}
        spent = sum(sum(by_slot[slot].chunks[:n]) for slot, n in plan)
        assert spent <= budget and plan, (queue, budget, plan)
        oldest = sorted(queue, key=lambda p: p.order)
        assert [slot for slot, _ in plan] == [p.slot for p in oldest[: len(plan)]]  # oldest first, none skipped
        for slot, n in plan[:-1]:
            assert n == len(by_slot[slot].chunks)  # a younger one gets chunks only after the older is done
        last_slot, last_n = plan[-1]
        rest = by_slot[last_slot].chunks[last_n:] or (oldest[len(plan)].chunks if len(plan) < len(queue) else [])
        assert not rest or spent + rest[0] > budget  # it stopped only where the next chunk did not fit


def test_plan_prefill_gives_the_oldest_one_chunk_when_none_fits():
    queue = [Prefilling(3, 9, [32, 32]), Prefilling(1, 2, [64, 8])]
    assert Scheduler.plan_prefill(queue, 16) == [(1, 1)]
    assert Scheduler.plan_prefill(queue, 16, force=False) == []  # the pass already ran something
    assert Scheduler.plan_prefill(queue, 80) == [(1, 2)]
    assert Scheduler.plan_prefill(queue, 104) == [(1, 2), (3, 1)]
    assert Scheduler.plan_prefill([], 100) == []
    assert Scheduler.admits(0, -5) and Scheduler.admits(10, 11) and not Scheduler.admits(11, 11)


def test_a_request_preempted_mid_prefill_starts_over_and_leaks_no_block():
    engine = FakeEngine(slots=2, max_len=64, chunk=4, kv_blocks=12, block_size=4)
    runner = InferenceRunner(engine, max_step_tokens=5)  # one row + one chunk of 4
    pool = engine.kv_pool
    old = runner.submit(Request([1, 2], 40))  # grows to 42 positions: 11 blocks
    for _ in range(10):
        runner.iterate()
    prompt = list(range(20, 50))
    new = runner.submit(Request(prompt, 3))  # 30 tokens: 8 chunks, 8 blocks reserved at admission
    mid_prefill = []
    while not (old.done and new.done):
        before = {slot: job.done for slot, job in runner._prefills.items()}
        preempted = runner.preemptions
        runner.iterate()
        pool.check()
        if runner.preemptions > preempted:
            mid_prefill += [0 < done < 8 for done in before.values()]
    assert runner.preemptions == 1 and mid_prefill == [True]
    starts = [c[2] for c in engine.calls if c[0] == "prefill_chunk"][1:]  # the new request's (not old's)
    assert starts[0] == 0 and starts.count(0) == 2 and starts[-8:] == list(range(0, 30, 4))  # again from 0
    assert token_ids(events(old)) == [(2 + i) % 100 + 1 for i in range(40)]
    assert token_ids(events(new)) == [50, 51, 52]
    assert pool.reserved == [0, 0] and not runner._prefills


def test_cancelling_a_request_mid_prefill_frees_its_slot_and_blocks():
    engine = FakeEngine(slots=1, chunk=4, kv_blocks=16, block_size=4)
    runner = InferenceRunner(engine, max_step_tokens=4)
    pool = engine.kv_pool
    stream = runner.submit(Request(list(range(1, 33)), 5))  # 8 chunks
    runner.iterate()
    runner.iterate()
    assert runner._prefills[0].done == 2 and pool.used == 8
    runner.cancel(stream.request.id)
    runner.iterate()
    pool.check()
    assert stream.done and events(stream)[-1].finish_reason == "cancelled"
    assert runner._slots == [None] and not runner._prefills and pool.used == 0 and pool.reserved == [0]
    chunks = len([c for c in engine.calls if c[0] == "prefill_chunk"])
    after = runner.submit(Request([4, 5], 2))  # the slot takes the next request
    while not after.done:
        runner.iterate()
    assert token_ids(events(after)) == [6, 7] and chunks == 2


def test_a_constrained_prompt_prefilled_in_chunks_beside_a_running_request_replies_as_alone():
    """Its grammar's first mask reaches the chunk that samples; the running request's steps meanwhile
    (constrained steps: a grammar is bound) leave its matcher at the start."""
    tokenizer = byte_tokenizer()
    grammar = GrammarCompiler(tokenizer, 300).compile(GrammarSpec("regex", "(ab|cd|ef){6}!"))
    prompt = [97 + i % 20 for i in range(22)]  # 6 chunks of 4

    def constrained() -> Request:
        return Request(prompt, 16, stop_ids=(tokenizer.eos_id,), grammar=grammar)

    lone = InferenceRunner(FakeEngine(slots=2, vocab_size=300))
    alone_stream = lone.submit(constrained())
    while not alone_stream.done:
        lone.iterate()
    alone = token_ids(events(alone_stream))
    engine = FakeEngine(slots=2, vocab_size=300, chunk=4)
    runner = InferenceRunner(engine, max_step_tokens=5)
    running = runner.submit(Request([1, 2], 20))
    runner.iterate()
    stream = runner.submit(constrained())
    while not (running.done and stream.done):
        runner.iterate()
    assert len([c for c in engine.calls if c[0] == "prefill_chunk"]) == 1 + 6
    assert token_ids(events(stream)) == alone
    assert re.fullmatch("(ab|cd|ef){6}!", tokenizer.decode([t for t in alone if t != tokenizer.eos_id]))
    assert token_ids(events(running)) == list(range(3, 23))


def test_the_loop_passes_again_while_a_prompt_is_part_way_through_its_chunks():
    """A pass that only ran a chunk has nothing in flight, but the loop must not idle (it would wait
    for a submit, up to a second, before the next chunk): iterate() says so."""
    runner = InferenceRunner(FakeEngine(slots=1, chunk=8), max_step_tokens=8)
    stream = runner.submit(Request(list(range(1, 41)), 3))  # 5 chunks, one a pass, nothing else running
    passes = 1
    while runner.iterate():
        passes += 1
    assert stream.done and token_ids(events(stream)) == [41, 42, 43] and passes == 8
