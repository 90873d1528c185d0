"""Prefill chunks that follow the token budget (`max_step_tokens`, issue 34): a pass cuts the prompts
still prefilling into the largest prefill bucket that fits its budget (max_step_tokens - rows), so a
long prompt beside many running streams goes in small chunks. The Scheduler's choice alone; the
chunks a runner dispatches (FakeEngine, counted); and on the tiny random model of test_paged_engine,
replies equal to the one-shot prefill's, alone and among neighbours, with chunk sizes that change as
the neighbours come and go. The tests drive `iterate()` themselves: every event comes in their order."""

from __future__ import annotations

import random

import pytest
from fake_engine import FakeEngine, events, token_ids
from test_paged_engine import CONFIG, F32, neighbours, run

from hkserve.engine.engine import Engine
from hkserve.engine.options import DEFAULT_PREFILL_BUCKETS, EngineOptions
from hkserve.engine.prefix_copy import Chunk, plan_chunks
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.scheduler import Scheduler, StepBudget
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

BUCKETS = DEFAULT_PREFILL_BUCKETS  # 16 .. 512


def test_the_chunk_is_the_largest_bucket_within_the_budget():
    assert [Scheduler.chunk_size(BUCKETS, b) for b in (48, 64, 65, 511, 512, 10_000)] == [32, 64, 64, 256, 512, 512]
    assert [Scheduler.chunk_size(BUCKETS, b) for b in (15, 1, 0, -7)] == [16] * 4  # nothing fits: the smallest
    rng = random.Random(3)
    for _ in range(500):
        buckets = tuple(sorted(rng.sample(range(1, 300), rng.randint(1, 6))))
        budget = rng.randint(-5, 400)
        size = Scheduler.chunk_size(buckets, budget)
        assert size in buckets
        if budget >= buckets[0]:
            assert size <= budget and all(b <= size or b > budget for b in buckets), (buckets, budget)
        else:
            assert size == buckets[0]


def test_a_pass_that_decodes_nothing_takes_at_least_the_largest_bucket():
    """Nobody to stall: a prompt at an idle server goes in the fewest passes (each reads every weight)."""
    assert [StepBudget(48).prompt_tokens(rows, BUCKETS) for rows in (0, 1, 16)] == [512, 47, 32]
    assert StepBudget(2000).prompt_tokens(0, BUCKETS) == 2000 and StepBudget(10).prompt_tokens(0, (8,)) == 10
    assert [StepBudget(None).prompt_tokens(rows, BUCKETS) for rows in (0, 1, 16)] == [512, 32, 32]


def test_the_chunk_sizes_a_runner_can_pick_are_those_warmup_compiles():
    """Of an explicit --max-step-tokens (the CPU default's: test_step_budget_default.py)."""
    assert Scheduler.chunk_sizes(BUCKETS, StepBudget(64), 16) == (32, 512)  # 0 rows: 512; 1..15 rows: 63..49
    assert Scheduler.chunk_sizes(BUCKETS, StepBudget(16 + 64), 16) == (64, 512)  # slots + a bucket: it beside rows
    assert Scheduler.chunk_sizes(BUCKETS, StepBudget(4 + 512), 4) == (512,)
    assert Scheduler.chunk_sizes(BUCKETS, StepBudget(8), 3) == (16, 512)
    engine = FakeEngine(slots=16, chunk=512, prefill_buckets=BUCKETS)
    InferenceRunner(engine, max_step_tokens=64)
    assert engine.chunk_sizes == (32, 512)


def test_plan_chunks_at_a_size_pads_later_chunks_to_it_and_a_reused_suffix_tightly():
    window = lambda s: 1000 + s  # marks which chunks attend to the past
    assert plan_chunks(100, 0, BUCKETS, window, size=32) == [
        Chunk(0, 32, 32, 0),
        Chunk(32, 64, 32, 1032),
        Chunk(64, 96, 32, 1064),
        Chunk(96, 100, 32, 1096),  # a later chunk: padded to the size, one program per window
    ]
    assert plan_chunks(20, 0, BUCKETS, window, size=64) == [Chunk(0, 20, 32, 0)]  # the first: its bucket
    assert plan_chunks(100, 64, BUCKETS, window, size=32, origin=0)[-1] == Chunk(96, 100, 32, 1096)
    assert plan_chunks(100, 70, BUCKETS, window, size=16) == [  # after a reused prefix of 70
        Chunk(70, 86, 16, 1070),
        Chunk(86, 100, 16, 1086),
    ]
    assert plan_chunks(100, 0, BUCKETS, window) == plan_chunks(100, 0, BUCKETS, window, size=512)


def long_prefill_among_rows(rows: int, max_step_tokens: int) -> tuple[FakeEngine, list[int], list[int]]:
    """A 300-token prompt submitted while `rows` requests decode → the engine, the padded size of each
    chunk it was prefilled in, and the tokens each running request got per pass meanwhile."""
    engine = FakeEngine(slots=rows + 1, max_len=600, chunk=512, prefill_buckets=BUCKETS)
    runner = InferenceRunner(engine, max_step_tokens=max_step_tokens)
    running = [runner.submit(Request([i + 1], 200)) for i in range(rows)]
    for _ in range(20):  # all of them decoding
        runner.iterate()
    assert len(runner._prefills) == 0 and all(events(s) for s in running)
    engine.padded.clear()
    start = len(engine.calls)
    long = runner.submit(Request([(3 * i) % 90 for i in range(300)], 2))
    got = []
    while not (first := token_ids(events(long))):
        runner.iterate()
        got.append(min(len(token_ids(events(s))) for s in running) if running else 1)
    assert first[0] == (3 * 299) % 90 + 1  # its prompt's last + 1: all of it was prefilled
    chunks = [c[2:] for c in engine.calls[start:] if c[0] == "prefill_chunk"]
    assert [s for s, _ in chunks] == [0] + [e for _, e in chunks[:-1]] and chunks[-1][1] == 300  # in order, whole
    return engine, list(engine.padded), got


def test_a_long_prompt_beside_16_rows_goes_in_chunks_within_the_budget():
    engine, padded, per_pass = long_prefill_among_rows(16, 64)  # 64 - 16 rows = 48: chunks of 32
    assert padded == [32] * 10  # 300 tokens, one chunk a pass (no second one fits 48)
    assert per_pass == [1] * 11  # every running stream got its token in every one of those passes
    assert [c[2] for c in engine.calls if c[0] == "prefill_chunk"][-10:] == list(range(0, 300, 32))
    assert engine.calls[-1] == ("step", list(range(17)))  # its first token joined the step


@pytest.mark.parametrize(("rows", "budget", "want"), [(0, 64, [512]), (4, 64, [32] * 10), (2, 300, [256, 256])])
def test_the_chunk_follows_the_rows(rows, budget, want):
    """No rows decoding: the pass takes the largest bucket (the whole 300-token prompt in one chunk)."""
    _, padded, _ = long_prefill_among_rows(rows, budget)
    assert padded == want and all(p <= max(StepBudget(budget).prompt_tokens(rows, BUCKETS), BUCKETS[0]) for p in padded)


def test_a_budget_below_the_smallest_bucket_still_prefills_one_smallest_chunk_a_pass():
    _, padded, per_pass = long_prefill_among_rows(6, 10)  # 4 left: no bucket fits
    assert padded == [16] * 19 and per_pass == [1] * 20


# -- the tiny random model: the same replies however the prompt is cut ----------------------------------

LONG = Request([(7 * i + 3) % 96 for i in range(130)], 12, SamplingParams(temperature=0.0))


def make(layout: str, max_step_tokens: int) -> tuple[InferenceRunner, list[tuple[int, Chunk]]]:
    """A runner (never started: the test's thread is its loop) over 4 slots, buckets 8/16/32, and the
    list that (prompt length, chunk) of each chunk its engine's continue_prefill dispatches goes to."""
    args = {"block_size": 16} if layout == "paged" else {}
    options = EngineOptions(slots=4, max_len=160, prefill_buckets=(8, 16, 32), kv_layout=layout, **args)
    engine = Engine(build_model(CONFIG), F32, options)
    dispatched: list[tuple[int, Chunk]] = []
    original = engine.continue_prefill

    def recording(job, chunks, scores=None):
        dispatched.extend((len(job.prompt_ids), c) for c in job.chunks[job.done : job.done + chunks])
        return original(job, chunks, scores)

    engine.continue_prefill = recording
    return InferenceRunner(engine, max_queue=64, max_step_tokens=max_step_tokens), dispatched


@pytest.mark.parametrize("layout", [pytest.param("static", marks=pytest.mark.slow), "paged"])
def test_small_chunks_reply_as_the_one_shot_prefill_alone_and_among_neighbours(layout):
    """Beside two short requests that end while it prefills, the long prompt goes in chunks of 16 (two
    rows: 33 - 2 < 32), then of 32 (no rows); the neighbours queued after it come in at its end."""
    one_shot, whole = make(layout, 10_000)  # every chunk of 32, all in the admitting pass
    want_alone = run(one_shot, [LONG])[0]
    short = [
        Request([(5 * i + 1) % 96 for i in range(n)], k, SamplingParams(temperature=0.0)) for n, k in ((10, 4), (12, 6))
    ]
    mixed = [*short, LONG, *neighbours(3, seed=5)]
    want_mixed = run(one_shot, mixed)
    assert [c.bucket for n, c in whole if n == 130] == [32] * 10  # alone, then among the neighbours

    alone, chunks = make(layout, 4 + 16)  # alone: nothing decodes, so the largest bucket (32), not 20's 16
    assert run(alone, [LONG])[0] == want_alone
    assert [c.bucket for _, c in chunks] == [32] * 5 and chunks[-1][1].end == 130

    beside, chunks = make(layout, 33)  # 0 rows: 32; 1..3 rows: 16
    got = run(beside, mixed)
    assert got == want_mixed and got[2] == want_alone  # the neighbours' replies unchanged; batch invariance
    long = [c for n, c in chunks if n == 130]
    assert long[-1].end == 130 and {c.bucket for c in long} == {16, 32}  # cut at both sizes as rows came and went
    if layout == "paged":
        beside.engine.kv_pool.check()
        assert beside.engine.kv_pool.used == 0


def test_warmup_compiles_the_continuation_chunks_of_every_size_the_budget_picks():
    runner, _ = make("static", 33)  # 0 or 1 rows: 32; 2 or 3 rows: 16
    engine = runner.engine
    assert engine.chunk_sizes == (16, 32) and engine.windows == (128, 160)
    # each size over the windows its later chunks start in (16 .. 144: 128 and 160; 32 .. 128: 128)
    assert engine.continuation_programs() == [(16, 128), (16, 160), (32, 128)]
    small, _ = make("static", 4 + 8)  # chunks of 8 beside rows, of the largest bucket alone
    assert small.engine.chunk_sizes == (8, 32)
    assert small.engine.continuation_programs() == [(8, 128), (8, 160), (32, 128)]
