"""Prefix caching (issue 17) on the tiny random model: the host record's choices, the device copy, and
the runner using both. The real model's must-shows (golden cases, a chat, a shared system prompt) are
in test_prefix_smollm2.py."""

from __future__ import annotations

import random
import threading
import types

import numpy as np
import pytest
from fake_engine import FakeEngine, events, token_ids
from helpers import init_params, tiny_config, tiny_vq_config

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.prefix_cache import PrefixCache, Reuse
from hkserve.engine.prefix_copy import plan_chunks
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams
from hkserve.multihost.hosts import LeaderEngine, follow

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 7)
RNG = random.Random(17)
SYSTEM = [RNG.randrange(96) for _ in range(150)]  # a shared prefix longer than two exact chunks


def prompt(*tail: int) -> list[int]:
    return SYSTEM + list(tail)


# -- the host record ---------------------------------------------------------------------------------
def test_longest_common_prefix_wins_a_free_slot_is_taken_as_is_a_running_one_is_copied():
    cache = PrefixCache(3, "on", min_reuse=4)
    cache.admitted(0, [1, 2, 3, 4, 5, 6])
    cache.finished(0, 6)
    cache.admitted(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # still running: its prompt is valid
    assert cache.place([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [0, 2]) == (2, Reuse(1, 9))  # copied to the LRU slot
    assert cache.place([1, 2, 3, 4, 5, 0], [0, 2]) == (0, Reuse(0, 5))  # a tie goes to the free slot
    assert cache.place([1, 2, 3, 9], [0, 2]) == (2, None)  # 3 < min_reuse: LRU free slot, nothing reused
    assert cache.place([1, 2, 3, 4, 5, 6], [0, 2]) == (0, Reuse(0, 5))  # the last token is always prefilled
    assert (cache.looked_up, cache.hit) == (10 + 6 + 4 + 6, 9 + 5 + 5)


def test_generated_tokens_count_once_written_and_exact_mode_reuses_whole_prefill_chunks_only():
    cache = PrefixCache(2, "on", min_reuse=1)
    cache.admitted(0, [1, 2, 3])
    for t in (7, 8, 9):
        cache.delivered(0, t)
    cache.finished(0, 5)  # the step that would write 9 never ran
    assert cache.usable(0, [1, 2, 3, 7, 8, 9, 4]) == 5
    exact = PrefixCache(2, "exact", granule=4, min_reuse=1)
    exact.admitted(0, list(range(10)))
    exact.delivered(0, 10)
    exact.finished(0, 11)
    assert exact.usable(0, list(range(12))) == 8  # 10 prefill tokens, rounded down to whole chunks
    assert exact.usable(0, list(range(7)) + [0]) == 4
    exact.admitted(1, list(range(10)), exact=False)  # a scoring prefill: another program computed the KV
    assert exact.usable(1, list(range(12))) == 0


def test_a_slot_reused_by_an_unrelated_prompt_no_longer_matches_its_old_content():
    cache = PrefixCache(1, "on", min_reuse=1)
    cache.admitted(0, [5] * 20)
    cache.finished(0, 20)
    assert cache.place([5] * 21, [0]) == (0, Reuse(0, 20))
    cache.admitted(0, [6] * 20)
    cache.finished(0, 20)
    assert cache.place([5] * 21, [0]) == (0, None)
    cache.forget(0)
    assert cache.place([6] * 21, [0]) == (0, None)


def test_off_mode_takes_the_first_free_slot_and_reuses_nothing():
    cache = PrefixCache(2, "off", min_reuse=1)
    cache.admitted(1, [1, 2, 3])
    cache.finished(1, 3)
    assert cache.place([1, 2, 3, 4], [1, 0]) == (1, None)
    assert cache.looked_up == 0


def test_chunk_plans():
    window = {64: 128, 100: 128, 128: 128}.get
    assert plan_chunks(20, 0, (8, 16, 32), window) == [(0, 20, 32, 0)]
    assert plan_chunks(70, 0, (8, 16, 32), lambda s: 128) == [(0, 32, 32, 0), (32, 64, 32, 128), (64, 70, 32, 128)]
    assert plan_chunks(105, 100, (8, 16, 32), window) == [(100, 105, 8, 128)]  # a short suffix: small bucket
    assert plan_chunks(150, 128, (8, 16, 32), lambda s: 256) == [(128, 150, 32, 256)]
    assert plan_chunks(130, 64, (8,), window, fixed=64) == [(64, 128, 64, 128), (128, 130, 64, 128)]
    with pytest.raises(ValueError):
        plan_chunks(130, 65, (8,), window, fixed=64)


# -- the engine -----------------------------------------------------------------------------------------
def engine(mode: str, slots: int = 3, max_len: int = 256, layout: str = "paged") -> Engine:
    # up to 128: an uncached prompt of 129..256 tokens is one 128 chunk and a short suffix a small one
    options = EngineOptions(slots, max_len, (8, 32, 128), prefix_cache=mode, kv_layout=layout)
    return Engine(MODEL, PARAMS, options)


def run(e: Engine, slot: int, ids, reuse=None, n: int = 8, others=()) -> tuple[list[int], list[float]]:
    """Prefill into `slot` and decode n tokens (with the slots in `others` decoding alongside)."""
    out = [e.prefill(slot, ids, SamplingParams(), reuse).read()[0]]
    active = np.zeros(e.slots, bool)
    active[[slot, *others]] = True
    out += [e.step(active).read()[slot] for _ in range(n)]
    return [t.id for t in out], [t.logprob for t in out]


@pytest.fixture(scope="module")
def exact_engine():
    return engine("exact")


@pytest.fixture(scope="module")
def on_engine():
    return engine("on")


def test_exact_reuse_is_bit_identical_to_a_fresh_prefill(exact_engine):
    e = exact_engine
    run(e, 0, prompt(1, 2))
    fresh = run(e, 1, prompt(3, 4, 5))
    assert run(e, 2, prompt(3, 4, 5), Reuse(0, 128)) == fresh  # tokens and logprobs, bit for bit
    with pytest.raises(ValueError, match="whole chunks"):
        e.prefill(2, prompt(3), None, Reuse(0, 100))


def test_a_prefix_copied_from_a_running_slot_leaves_it_bit_identical(exact_engine):
    e = exact_engine
    alone = run(e, 0, prompt(9), n=20)
    e.prefill(0, prompt(9), SamplingParams()).read()
    both = np.asarray([True, False, False])
    first = [e.step(both).read()[0] for _ in range(6)]
    e.prefill(1, prompt(9, 8, 7), SamplingParams(), Reuse(0, 128)).read()  # copied while slot 0 runs
    both[1] = True
    rest = [e.step(both).read()[0] for _ in range(14)]
    assert [t.id for t in first + rest] == alone[0][1:] and [t.logprob for t in first + rest] == alone[1][1:]


def test_on_mode_reuses_prompt_and_generated_tokens_with_equal_greedy_tokens(on_engine):
    e = on_engine
    ids, _ = run(e, 0, prompt(1), n=12)
    follow_up = prompt(1) + ids[:-1] + [40, 41]  # the reply's last token was never written
    fresh = run(e, 1, follow_up)
    assert run(e, 2, follow_up, Reuse(0, len(prompt(1)) + 12))[0] == fresh[0]


def test_max_len_edges_prefix_and_suffix_at_the_context_limit(exact_engine, on_engine):
    for e, reused in ((exact_engine, 192), (on_engine, 254)):
        mode = e.prefix_cache
        full = [RNG.randrange(96) for _ in range(255)]
        run(e, 0, full[:254] + [1], n=0)
        fresh = run(e, 1, full, n=1)  # 255 prompt tokens + 1 generated = the 256-token context
        cached = run(e, 1, full, Reuse(0, reused), n=1)
        assert cached == fresh if mode == "exact" else cached[0] == fresh[0], mode  # "on": equal greedy tokens
        with pytest.raises(ValueError):
            e.prefill(1, full, None, Reuse(0, 255))  # nothing left to prefill


def test_a_vq_model_refuses_prefix_caching():
    with pytest.raises(ValueError, match="VQ memory is a compressed state"):
        Engine(build_model(tiny_vq_config()), None, EngineOptions(slots=1, max_len=64, prefix_cache="on"))


# -- the runner -----------------------------------------------------------------------------------------
def test_batch_invariance_with_exact_reuse_among_requests_sharing_the_prefix(exact_engine):
    runner = InferenceRunner(exact_engine, max_queue=64)
    greedy, seeded = Request(prompt(1, 2, 3), 16), Request(prompt(4), 16, SamplingParams(temperature=0.9, seed=5))
    runner.prefix = PrefixCache(3, "off")
    runner.start(warmup=False)
    try:
        alone = [[t.id for t in runner.generate(r)] for r in (greedy, seeded)]
        runner.prefix = PrefixCache(3, "exact", granule=exact_engine.prefill_chunk)  # fresh: nothing stale
        results, threads = {}, []

        def go(name, request):
            results[name] = [t.id for t in runner.generate(request)]

        for i in range(6):
            noise = Request(prompt(*[RNG.randrange(96) for _ in range(i * 7)]), 3 + 2 * i)
            threads.append(threading.Thread(target=go, args=(f"n{i}", noise)))
        threads += [
            threading.Thread(target=go, args=("greedy", Request(greedy.prompt_ids, 16))),
            threading.Thread(target=go, args=("seeded", Request(seeded.prompt_ids, 16, seeded.sampling))),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        runner.stop()
    assert [results["greedy"], results["seeded"]] == alone
    assert runner.prefix.hit >= 5 * 128  # most of the 8 requests reused the shared prefix


def test_runner_reports_cached_tokens_and_does_not_reuse_stale_content():
    """The slots as the cache (static layout: a paged pool would still hold prompt(1, 2)'s blocks, rightly
    reused: test_paged_prefix_sharing, test_paged_reply_cache)."""
    runner = InferenceRunner(engine("on", layout="static"))
    first = runner.submit(Request(prompt(1), 4))
    while runner.iterate():
        pass
    again = runner.submit(Request(prompt(1, 2), 4))
    while runner.iterate():
        pass
    assert (first.cached_tokens, again.cached_tokens) == (0, len(prompt(1)))
    for t in (7, 8, 9):  # least recently used first: the third overwrites the slot holding prompt(1, 2)
        runner.submit(Request([t] * 40, 2))
    while runner.iterate():
        pass
    stale = runner.submit(Request(prompt(1, 2), 4))
    while runner.iterate():
        pass
    assert stale.cached_tokens == 0 and token_ids(events(stale)) == token_ids(events(again))


def test_host_0s_reuse_decision_reaches_the_other_hosts_with_the_prefill_call():
    sent = []
    leader = LeaderEngine(FakeEngine(slots=2), types.SimpleNamespace(broadcast=sent.append))
    leader.prefill(0, [1, 2, 3], None)
    leader.prefill(1, [1, 2, 3, 4], None, Reuse(0, 3))
    follower = FakeEngine(slots=2)
    assert follow(follower, [*sent, {"op": "exit"}]) == 0
    assert [c[1:] for c in follower.calls if c[0] == "prefill"] == [(0, [1, 2, 3]), (1, [1, 2, 3, 4], Reuse(0, 3))]
