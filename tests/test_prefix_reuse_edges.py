"""Prefix reuse at its edges, on the tiny random model (issue 38): a cached record and a new prompt that
differ only at the record's last token, and a prefix copied into a slot that held an unrelated request,
with penalties that read the slot's token history. The host record's own checks: test_prefix_record.py."""

from __future__ import annotations

import random

import numpy as np
import pytest
from fake_engine import events, token_ids
from helpers import init_params, tiny_config

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.prefix_cache import PrefixCache, Reuse
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

VOCAB = 96
MODEL = build_model(tiny_config(vocab_size=VOCAB))
PARAMS = init_params(MODEL.config, 11)
RNG = random.Random(38)
SYSTEM = [RNG.randrange(VOCAB) for _ in range(150)]  # longer than two exact-mode chunks of 64
PENALIZED = SamplingParams(repetition_penalty=1.6, presence_penalty=1.5, frequency_penalty=0.5)


# -- the engine and the runner --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_engine():
    return Engine(MODEL, PARAMS, EngineOptions(slots=3, max_len=256, prefill_buckets=(8, 32, 128), prefix_cache="on"))


@pytest.fixture(scope="module")
def exact_engine():
    return Engine(
        MODEL, PARAMS, EngineOptions(slots=3, max_len=256, prefill_buckets=(8, 32, 128), prefix_cache="exact")
    )


def drain(runner: InferenceRunner, request: Request):
    stream = runner.submit(request)
    while runner.iterate():
        pass
    return stream


def test_runner_reuses_exactly_the_true_common_prefix_when_only_the_records_last_token_differs(on_engine):
    prompt = SYSTEM[:40]
    runner = InferenceRunner(on_engine)
    runner.prefix = PrefixCache(on_engine.slots, "off")
    first = token_ids(events(drain(runner, Request(prompt, 4))))
    # The slot holds the prompt and the generated tokens written (the runner writes all 4: its last step
    # is dispatched before the request ends). Change each of the last two in turn: the last one is the
    # record's last token.
    for kept in (2, 3):
        follow_up = prompt + first[:kept] + [(first[kept] + 1) % VOCAB, 7, 8]
        runner.prefix = PrefixCache(on_engine.slots, "off")
        uncached = token_ids(events(drain(runner, Request(follow_up, 8))))
        runner.prefix = PrefixCache(on_engine.slots, "on")  # fresh: it knows only what is admitted from here
        assert token_ids(events(drain(runner, Request(prompt, 4)))) == first
        cached = drain(runner, Request(follow_up, 8))
        assert cached.cached_tokens == len(prompt) + kept
        assert token_ids(events(cached)) == uncached


def _run(e: Engine, slot: int, ids, settings: SamplingParams, reuse=None, n: int = 12):
    """Prefill into `slot` and decode n tokens alone → (ids, logprobs)."""
    out = [e.prefill(slot, ids, settings, reuse).read()[0]]
    active = np.zeros(e.slots, bool)
    active[slot] = True
    out += [e.step(active).read()[slot] for _ in range(n)]
    return [t.id for t in out], [t.logprob for t in out]


def test_reuse_into_a_dirty_slot_with_penalties_matches_an_uncached_run_bit_for_bit(exact_engine):
    e = exact_engine
    prompt = SYSTEM + [1, 2, 3]
    fresh = _run(e, 1, prompt, PENALIZED)
    # Slot 2 ends up holding an unrelated request whose prompt is made of the very tokens the penalized
    # reply uses, and which generated the reply's first token 20 times (a bias forces it): any of its
    # prompt set or generated counts left in place changes what the penalties ban.
    forced = SamplingParams(logit_bias={fresh[0][0]: 100.0})
    assert _run(e, 2, fresh[0] * 3 + [5], forced, n=20)[0] == [fresh[0][0]] * 21
    _run(e, 0, SYSTEM + [9], SamplingParams(), n=0)  # the prefix's source
    assert _run(e, 2, prompt, PENALIZED, Reuse(0, 128)) == fresh
    # The same without penalties is equal as well (the check above is not one of penalties alone).
    plain = _run(e, 1, prompt, SamplingParams())
    _run(e, 2, plain[0] * 3 + [5], forced, n=20)
    assert _run(e, 2, prompt, SamplingParams(), Reuse(0, 128)) == plain
