"""Preemption through Engine and InferenceRunner on the tiny random model of test_paged_engine (issue 34,
step 3): a pool much smaller than the requests' needs runs 32 requests of mixed lengths, preempting
and resuming many times, and every reply equals the request's reply alone (greedy, seeded sampled,
and with frequency / presence penalties, which count the generated tokens a resume recomputes)."""

from __future__ import annotations

import random

import numpy as np
from test_paged_engine import CONFIG, make_runner

from hkserve.engine.kv_layout import block_bytes
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.sampling import SamplingParams


def mixed(n: int, seed: int) -> list[Request]:
    """n requests: prompts of 1..48 tokens, replies of 8..40; greedy, seeded, and penalized."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(96) for _ in range(rng.randint(1, 48))]
        sampling = [
            SamplingParams(temperature=0.0),
            SamplingParams(temperature=0.9, seed=i),
            SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5),
        ][i % 3]
        out.append(Request(prompt, rng.randint(8, 40), sampling))
    return out


def run(runner: InferenceRunner, requests: list[Request], watch=None) -> tuple[list[list[int]], list[list[float]]]:
    """Drive the loop until every request ends (`watch(runner)` after every pass) → token ids, logprobs."""
    streams = [runner.submit(r) for r in requests]
    while not all(s.done for s in streams):
        runner.iterate()
        if watch is not None:
            watch(runner)
    events = [list(s) for s in streams]
    assert all(evs[-1].finish_reason in ("stop", "length") for evs in events), [evs[-1] for evs in events]
    tokens = [[e.token for e in evs if e.token is not None] for evs in events]
    return [[t.id for t in row] for row in tokens], [[t.logprob for t in row] for row in tokens]


def test_32_requests_in_a_pool_smaller_than_their_needs_reply_as_alone():
    """10 blocks of 16 (160 positions) for 8 slots and 32 requests needing up to 88 positions each."""
    mb = 10 * block_bytes(CONFIG, 16) / 2**20
    runner = make_runner("xla", "paged", slots=8, kv_cache_mb=mb)
    pool = runner.engine.kv_pool
    assert pool.total == 10
    requests = mixed(32, seed=4)
    assert sum(pool.blocks_for(len(r.prompt_ids) + r.max_tokens) for r in requests) > 5 * pool.total
    alone = [run(runner, [r]) for r in requests]
    assert runner.preemptions == 0
    ids, logprobs = run(runner, requests, watch=lambda r: r.engine.kv_pool.check())
    assert ids == [a[0][0] for a in alone]
    # recomputed KV went through a prefill's shapes, not the decode steps': logprobs agree to rounding
    for got, (_, want) in zip(logprobs, alone):
        np.testing.assert_allclose(got, want[0], atol=1e-4)
    assert runner.stats().preemptions == runner.preemptions > 10
    assert pool.used == 0 and pool.reserved == [0] * 8
