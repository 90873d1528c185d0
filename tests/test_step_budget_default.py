"""The default token budget on the CPU (issue 34): a pass's prompt tokens are the smallest prefill bucket
holding max(32, rows), so 16 rows keep the 32-token chunk (a pass within ~2x the step alone) and 64 busy
rows get a 64-token chunk a pass, not the fixed slots + 32's one 32-token chunk that starved admission.
The pure policy, the chunks a runner dispatches (FakeEngine), and the programs warm-up compiles for them
(the tiny model's Engine, nothing compiled). The tests drive `iterate()` themselves."""

from __future__ import annotations

import random

import jax
import pytest
from fake_engine import FakeEngine, events, token_ids
from test_paged_engine import CONFIG, F32
from test_step_budget_chunks import long_prefill_among_rows

from hkserve.engine.engine import Engine
from hkserve.engine.options import DEFAULT_PREFILL_BUCKETS, EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.scheduler import Prefilling, Scheduler, StepBudget, default_step_budget
from hkserve.model.build import build_model

BUCKETS = DEFAULT_PREFILL_BUCKETS  # 16 .. 512


@pytest.fixture
def cpu(monkeypatch):
    """The runner's default is the CPU's, whatever machine runs the test."""
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")


def test_the_cpu_default_gives_a_pass_max_32_rows_prompt_tokens_in_whole_chunks():
    budget = default_step_budget(16, "cpu")
    assert budget == StepBudget(None, 32)
    got = [budget.prompt_tokens(rows, BUCKETS) for rows in (0, 1, 16, 32, 33, 63, 64, 65, 300, 600, 1025)]
    assert got == [512, 32, 32, 32, 64, 64, 64, 128, 512, 1024, 1536]  # past 512: whole 512-token chunks
    assert [Scheduler.chunk_size(BUCKETS, t) for t in got] == [512, 32, 32, 32, 64, 64, 64, 128, 512, 512, 512]
    sparse = [budget.prompt_tokens(rows, (16, 64)) for rows in (16, 40, 64, 65)]  # whole chunks: 2 and 3 x 16, not 64
    assert sparse == [32, 48, 64, 128] and Scheduler.chunk_size((16, 64), 32) == 16
    gpu = default_step_budget(16, "gpu")  # unchanged: slots + 512
    assert gpu == StepBudget(16 + 512) and [gpu.prompt_tokens(r, BUCKETS) for r in (0, 1, 15)] == [528, 527, 513]


def test_the_default_prefills_at_least_one_prompt_token_per_decode_row_whatever_the_buckets():
    """A pass's planned chunks hold at least max(floor, rows) prompt tokens: admission's share of a
    crowded pass does not shrink as rows grow (the property the fixed slots + 32 lacked)."""
    rng = random.Random(34)
    for _ in range(300):
        buckets = tuple(sorted(rng.sample(range(1, 600), rng.randint(1, 6))))
        budget, rows = StepBudget(None, rng.randint(1, 64)), rng.randint(1, 2000)
        tokens = budget.prompt_tokens(rows, buckets)
        size = Scheduler.chunk_size(buckets, tokens)
        ((_, chunks),) = Scheduler.plan_prefill([Prefilling(0, 0, [size] * 100)], tokens)
        need = max(budget.floor, rows)
        assert chunks * size >= need, (buckets, budget, rows)
        assert chunks * size < 2 * need or chunks * size == buckets[0], (buckets, budget, rows)  # the cost bounded
        assert len(Scheduler.chunk_sizes(buckets, budget, rng.randint(1, 300))) <= len(buckets)


def test_an_explicit_max_step_tokens_means_rows_plus_prompt_tokens_as_before(cpu):
    assert [StepBudget(97).prompt_tokens(r, BUCKETS) for r in (0, 1, 33, 64)] == [512, 96, 64, 33]
    runner = InferenceRunner(FakeEngine(slots=65, chunk=512, prefill_buckets=BUCKETS), max_step_tokens=97)
    assert runner.step_budget == StepBudget(97) and runner.engine.chunk_sizes == (32, 64, 512)
    _, padded, per_pass = long_prefill_among_rows(64, 65 + 32)  # the old default at 64 rows: 33 tokens a pass
    assert padded == [32] * 10 and per_pass == [1] * 11


def test_the_default_keeps_32_token_chunks_beside_16_rows(cpu):
    runner = InferenceRunner(FakeEngine(slots=17, chunk=512, prefill_buckets=BUCKETS))
    assert runner.step_budget == StepBudget(None) and runner.engine.chunk_sizes == (32, 512)
    _, padded, per_pass = long_prefill_among_rows(16, None)
    assert padded == [32] * 10 and per_pass == [1] * 11


def test_the_default_gives_64_busy_rows_64_token_chunks(cpu):
    runner = InferenceRunner(FakeEngine(slots=65, chunk=512, prefill_buckets=BUCKETS))
    assert runner.engine.chunk_sizes == (32, 64, 512)  # 0 rows: 512; 1..32: 32; 33..64: 64
    _, padded, per_pass = long_prefill_among_rows(64, None)
    assert padded == [64] * 5 and per_pass == [1] * 6  # 300 tokens in 5 passes, every row stepping each


def test_queued_prompts_at_64_busy_rows_are_prefilled_within_a_bounded_number_of_passes(cpu):
    """Four 200-token prompts queued beside 64 decoding rows: each prefills in at most ceil(200 / 64) = 4
    passes from its admission (the first chunk the pass it is admitted), all four within 16 passes, and the
    running rows step every pass. The fixed slots + 32 took 7 passes each (one 32-token chunk a pass)."""
    engine = FakeEngine(slots=68, max_len=600, chunk=512, prefill_buckets=BUCKETS)
    runner = InferenceRunner(engine)
    running = [runner.submit(Request([i + 1], 400)) for i in range(64)]
    for _ in range(20):
        runner.iterate()
    assert not runner._prefills and all(events(s) for s in running)
    calls, padded = len(engine.calls), len(engine.padded)
    queued = [runner.submit(Request([(5 * i + k) % 90 for i in range(200)], 2)) for k in range(4)]
    admitted_at, first_at = {}, {}
    for n in range(1, 17):
        runner.iterate()
        assert all(len(token_ids(events(s))) == 1 for s in running)  # a token each pass (events drains)
        for k, stream in enumerate(queued):
            if k not in admitted_at and any(s is not None and s.stream is stream for s in runner._slots):
                admitted_at[k] = n
            if k not in first_at and token_ids(events(stream)):
                first_at[k] = n
        if len(first_at) == 4:
            break
    assert len(first_at) == 4, f"prefilled after 16 passes: {sorted(first_at)}"
    # a pass's first token is read the pass after its last chunk: at most 4 chunk passes + 1
    assert all(first_at[k] - admitted_at[k] + 1 <= 4 + 1 for k in range(4)), (admitted_at, first_at)
    chunks = [c for c in engine.calls[calls:] if c[0] == "prefill_chunk"]
    later = {size for c, size in zip(chunks, engine.padded[padded:], strict=True) if c[2] > 0}  # not a first chunk
    assert later == {64}  # those of the passes beside 64 rows (a 65th row's pass only ever ran a prompt's first)
    assert later <= set(engine.chunk_sizes)  # every continuation chunk of a size warm-up compiles


def test_warmup_compiles_every_chunk_size_the_default_picks(cpu):
    """The tiny model's Engine (no compile): 40 slots, buckets 16 .. 128 → chunks of 32 beside 1..32 rows,
    64 beside 33..39, 128 alone; each in the continuation programs over every window its chunks start in."""
    buckets = (16, 32, 64, 128)
    options = EngineOptions(slots=40, max_len=320, prefill_buckets=buckets, kv_layout="static")
    runner = InferenceRunner(Engine(build_model(CONFIG), F32, options))
    engine, budget = runner.engine, runner.step_budget
    picked = {Scheduler.chunk_size(buckets, budget.prompt_tokens(rows, buckets)) for rows in range(40)}
    assert picked == {32, 64, 128} == set(engine.chunk_sizes)
    programs = engine.continuation_programs()
    for size in picked:
        assert {w for c, w in programs if c == size} == set(engine.continuation_windows(size)) != set()
