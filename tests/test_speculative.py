"""Speculative decoding on the tiny random model: the n-gram lookup, the policy, and exactness of the
verify step (tokens identical to plain decoding, logprobs equal) with every sampling setting."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, tiny_config, tiny_vq_config
from prometheus_client import CollectorRegistry, generate_latest

from hkserve.api.spec_metrics import register
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig, SpecPolicy
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model
from hkserve.model.ngram import first_draft, propose
from hkserve.model.sampling import SamplingParams


def test_lookup_takes_the_longest_suffix_at_its_most_recent_earlier_occurrence():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 6, 7, 8, 1, 6, 7, 9, 4, 2, 6, 7]  # suffix (6, 7): at ends 2 and 6; 1-gram 7 too
    padded = jnp.asarray([context + [0] * 4, [3, 3, 3, 3] + [0] * 12, [1, 2, 3, 4] + [0] * 12], jnp.int32)
    drafts = propose(padded, jnp.asarray([11, 3, 3]), k=3, sizes=(1, 2, 3))
    tokens, count = np.asarray(drafts.tokens), np.asarray(drafts.count)
    assert count[0] == 3 and tokens[0].tolist() == [9, 4, 2]  # after (6, 7) ending at 6, not at 2
    assert count[1] == 1 and tokens[1, 0] == 3  # (3, 3, 3) ends at 2: only position 3 follows it
    assert count[2] == 0  # 4 never occurred before
    longest = propose(padded, jnp.asarray([11, 3, 3]), k=3, sizes=(1,))
    assert np.asarray(longest.tokens)[0].tolist() == [9, 4, 2]  # 1-gram 7: its latest earlier end is 6 too
    # suffix (3, 2) never occurred: the 1-gram 2 decides, at its most recent earlier end (4)
    four = jnp.asarray([[1, 2, 9, 1, 2, 8, 3, 2, 0, 0]], jnp.int32)
    assert np.asarray(propose(four, jnp.asarray([7]), k=2, sizes=(1, 2)).tokens)[0].tolist() == [8, 3]


def test_policy_asks_more_of_a_slot_in_a_larger_batch():
    """A verify step costs more plain steps in a larger batch: 2 tokens per step pays alone, not among 8."""
    config = SpecConfig(k=4, window=2)  # row_cost 0.04: 1.6 (min_tokens) alone, 1 + 0.04 * 8 * 4 among 8
    policy = SpecPolicy(config, slots=8)
    assert policy.step_cost(1) == 1.6 and policy.step_cost(8) == pytest.approx(2.28)
    alone, all_eight = np.eye(8, dtype=bool)[0], np.ones(8, bool)
    for _ in range(3):
        assert policy.plan(alone)[0]
        policy.observe(0, drafted=4, emitted=2)
    assert not policy.resting(0)
    assert policy.plan(all_eight).all()
    for slot in range(8):
        policy.observe(slot, drafted=4, emitted=2)
        policy.observe(slot, drafted=4, emitted=2)
        assert policy.resting(slot)


def test_the_host_lookup_proposes_the_devices_first_draft():
    rng = np.random.default_rng(1)
    contexts = rng.integers(0, 4, (64, 24)).astype(np.int32)  # a small alphabet: many matches
    lasts = rng.integers(0, 24, 64)
    drafts = propose(jnp.asarray(contexts), jnp.asarray(lasts), k=2, sizes=(1, 2, 3))
    for row, last, token, count in zip(contexts, lasts, np.asarray(drafts.tokens), np.asarray(drafts.count)):
        host = first_draft(row[: last + 1].tolist(), (1, 2, 3))
        assert (host[0] if host else None) == (int(token[0]) if count else None)


def test_policy_turns_a_slot_off_when_it_does_not_pay_and_probes_again_later():
    config = SpecConfig(k=4, max_batch=2, min_tokens=2.0, window=2, probe=1, backoff=3, max_backoff=6)
    policy = SpecPolicy(config, slots=3)
    both = np.asarray([True, True, False])
    assert policy.plan(both).tolist() == [True, True, False]
    assert policy.plan(np.ones(3, bool)) is None  # above the crossover: plain
    for _ in range(2):
        policy.observe(0, drafted=4, emitted=5)
        policy.observe(1, drafted=4, emitted=1)
    assert policy.counts.drafted == 16 and policy.counts.accepted == 8 and policy.counts.verify_rows == 4
    assert policy.plan(both).tolist() == [True, False, False]  # slot 1 failed: off for 3 plans
    policy.plan(both), policy.plan(both)
    assert policy.plan(both).tolist() == [True, True, False]  # probing again
    policy.observe(1, drafted=0, emitted=1)  # probe fails at once: off for twice as long
    assert [policy.plan(both)[1] for _ in range(7)] == [False] * 6 + [True]
    policy.observe(1, drafted=4, emitted=1)  # probing again fails: off for 6
    assert policy.resting(1)
    policy.shadow(1, True), policy.shadow(1, False), policy.shadow(1, True), policy.shadow(1, True)
    assert policy.resting(1)
    policy.shadow(1, True)  # the lookup would have been right `wake` (3) times in a row: back on
    assert not policy.resting(1) and policy.plan(both)[1]
    policy.restart(1)  # a new request in the slot starts afresh
    assert policy.plan(both)[1]
    assert policy.plan(np.zeros(3, bool)) is None


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    model = build_model(config)
    engine = Engine(model, init_params(config, 0), EngineOptions(slots=2, max_len=96, prefill_buckets=(16, 64)))
    # Always drafting (min_tokens 0): the random model accepts little, and the test is the rule.
    return engine, SpeculativeEngine(engine, SpecConfig(k=4, min_tokens=0.0, max_batch=2))


def _run(engine, requests):
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        streams = [runner.submit(r) for r in requests]
        return [list(stream) for stream in streams]
    finally:
        runner.stop()


SETTINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=1.0, seed=3, top_k=12, top_p=0.8, min_p=0.05),
    SamplingParams(temperature=0.8, seed=5, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3),
    SamplingParams(logit_bias={20: 4.0, 39: -100}, frequency_penalty=-0.5),
]


def test_verify_emits_exactly_the_plain_tokens_and_logprobs_for_every_sampling_setting(tiny):
    verify_equals_plain(*tiny)


def verify_equals_plain(plain, spec) -> None:
    """A repetitive prompt under every sampling setting: the speculating engine's tokens, finish
    reasons, logprobs and top alternatives are the plain engine's, and some drafts were accepted."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 128, 12).tolist()
    requests = lambda: [Request(pattern * 3, 40, s, stop_ids=(), logprobs=3) for s in SETTINGS]
    before = spec.counts.accepted
    ours, theirs = _run(spec, requests()), _run(plain, requests())
    assert spec.counts.accepted > before  # runs of several tokens were emitted
    for setting, a, b in zip(SETTINGS, ours, theirs):
        assert [e.token.id for e in a[:-1]] == [e.token.id for e in b[:-1]], setting
        assert a[-1].finish_reason == b[-1].finish_reason == "length"
        for x, y in zip(a[:-1], b[:-1]):  # the same model, a [B, K+1] program instead of [B, 1]
            assert x.token.logprob == pytest.approx(y.token.logprob, abs=1e-5)
            assert [i for i, _ in x.token.top] == [i for i, _ in y.token.top]


def test_a_request_filling_its_context_ends_where_the_plain_one_does(tiny):
    fills_context_as_plain(*tiny)


def fills_context_as_plain(plain, spec) -> None:
    """A request whose max_tokens reaches --max-len (96) exactly: the same tokens and length as plain."""
    prompt = [3, 4, 5, 6] * 10
    requests = lambda: [Request(prompt, 96 - len(prompt), SamplingParams(), stop_ids=())]
    (a,), (b,) = _run(spec, requests()), _run(plain, requests())
    assert [e.token.id for e in a[:-1]] == [e.token.id for e in b[:-1]] and len(a) == 96 - len(prompt) + 1


def test_a_vq_memory_is_refused():
    config = tiny_vq_config()
    model = build_model(config)
    with pytest.raises(ValueError, match="KV memory"):
        SpeculativeEngine(Engine(model, init_params(config, 0), EngineOptions(slots=1, max_len=64)))


def test_metrics_report_drafted_and_accepted_tokens(tiny):
    _, spec = tiny
    registry = CollectorRegistry()
    register(registry, InferenceRunner(spec))
    text = generate_latest(registry).decode()
    assert f"hkserve_spec_draft_tokens_total {float(spec.counts.drafted)}" in text
    assert f"hkserve_spec_accepted_tokens_total {float(spec.counts.accepted)}" in text
    assert "hkserve_spec_mean_accepted_length" in text
    empty = CollectorRegistry()
    register(empty, InferenceRunner(tiny[0]))  # a plain engine: nothing added
    assert "spec" not in generate_latest(empty).decode()
