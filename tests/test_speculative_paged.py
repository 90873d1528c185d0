"""Speculative decoding on the paged KV layout (issue 34) on the tiny random model: a verify step's k+1
positions get their blocks before it is dispatched, so the tokens and logprobs equal plain decoding's
with every sampling setting, up to a full context; in a pool smaller than the requests' needs the
runner's block promises count a verify step's drafts, so requests are preempted (never failed) and
still reply as alone, the pool's invariants holding after every pass."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import init_params, tiny_config
from test_speculative import fills_context_as_plain, verify_equals_plain

from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import block_bytes
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config()
PARAMS = init_params(CONFIG, 0)
BLOCK = 8  # small blocks: a verify step's drafts often cross into a block the row did not hold yet
ALWAYS = SpecConfig(k=4, min_tokens=0.0, max_batch=4)  # always drafting: the test is the rule


def engine(layout: str, slots: int = 2, **paged) -> Engine:
    args = {"block_size": BLOCK, **paged} if layout == "paged" else {}
    options = EngineOptions(slots=slots, max_len=96, prefill_buckets=(16, 64), kv_layout=layout, **args)
    return Engine(build_model(CONFIG), PARAMS, options)


@pytest.fixture(scope="module")
def engines():
    """The plain static engine (the reference) and a speculating paged one."""
    return engine("static"), SpeculativeEngine(engine("paged"), ALWAYS)


def test_verify_on_paged_blocks_emits_exactly_the_plain_tokens_and_logprobs(engines):
    verify_equals_plain(*engines)
    assert engines[1].kv_pool.used == 0  # every block back once the requests ended (no prefix cache)
    engines[1].kv_pool.check()


def lockstep(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each slot prefilled with its prompt, then `steps` steps each read before the next is dispatched
    (a speculating engine's host positions are exact at every dispatch: no step in flight pads them),
    then every slot released."""
    engine.reset()
    out = [[engine.prefill(slot, prompt).read()[0].id] for slot, prompt in enumerate(prompts)]
    active = np.ones(engine.slots, bool)
    for _ in range(steps):
        for slot, row in enumerate(engine.step(active).read()):
            out[slot] += [t.id for t in row] if isinstance(row, list) else [row.id]
    for slot in range(engine.slots):
        engine.release(slot)
    return out


def test_a_verify_step_read_before_the_next_writes_its_drafts_into_grown_blocks(engines):
    """No step in flight: the blocks for a verify step's drafts come from its own growth alone."""
    plain, spec = engines
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 128, 5).tolist() * 5 for _ in range(2)]  # slot 1 accepts runs of 5 (planted: caught)
    before = spec.counts.accepted
    ours = lockstep(spec, prompts, 30)
    assert spec.counts.accepted > before
    theirs = lockstep(plain, prompts, max(len(row) for row in ours) - 1)
    assert all(row == want[: len(row)] for row, want in zip(ours, theirs))
    assert spec.kv_pool.used == 0  # released: every block it grew, drafts' too, back in the pool
    spec.kv_pool.check()


def test_a_request_filling_its_context_on_paged_blocks_ends_where_the_plain_one_does(engines):
    fills_context_as_plain(*engines)
    assert engines[1].kv_pool.used == 0


def drive(runner: InferenceRunner, requests: list[Request]) -> list[list[int]]:
    """The test's thread is the loop: pass by pass until every request ends, the pool checked after each."""
    streams = [runner.submit(r) for r in requests]
    while not all(s.done for s in streams):
        runner.iterate()
        runner.engine.kv_pool.check()
    events = [list(s) for s in streams]
    assert all(evs[-1].finish_reason == "length" for evs in events), [evs[-1] for evs in events]
    return [[e.token.id for e in evs if e.token is not None] for evs in events]


def test_a_pool_smaller_than_the_needs_preempts_speculating_requests_and_they_reply_as_alone():
    """12 blocks of 8 (one --max-len request) for 4 slots and 6 requests of 24 + 40 positions each."""
    mb = 12 * block_bytes(CONFIG, BLOCK) / 2**20
    spec = SpeculativeEngine(engine("paged", slots=4, kv_cache_mb=mb), ALWAYS)
    runner = InferenceRunner(spec, max_queue=16)
    assert spec.kv_pool.total == 12
    rng = np.random.default_rng(5)
    requests = [
        Request(rng.integers(0, 128, 6).tolist() * 4, 40, SamplingParams(temperature=0.9 * (i % 2), seed=i), ())
        for i in range(6)
    ]
    alone = [drive(runner, [r])[0] for r in requests]
    assert runner.preemptions == 0
    accepted = spec.counts.accepted
    assert drive(runner, requests) == alone
    assert runner.preemptions > 0 and spec.counts.accepted > accepted
    assert spec.kv_pool.used == 0 and spec.kv_pool.reserved == [0] * 4
