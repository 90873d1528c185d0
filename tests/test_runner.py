"""InferenceRunner end to end on a tiny random model: sampling semantics under continuous batching.
Scheduling itself (admission, cancellation, overload, abort) is tested on FakeEngine: test_runner_scheduling.py."""

from __future__ import annotations

import random
import threading
import time

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Overloaded, Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.state import ContextLengthError
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96)
MODEL = build_model(CONFIG)
PARAMS = init_params(CONFIG, 7)
PROMPT = [5, 17, 33, 2, 64, 9, 11]


@pytest.fixture(scope="module")
def runner():
    # attention windows 128/256 (the context is 256): batch mates change the window a request sees
    runner = InferenceRunner(
        Engine(MODEL, PARAMS, EngineOptions(slots=4, max_len=512, prefill_buckets=(8, 16, 32))), max_queue=256
    )
    runner.start()
    yield runner
    runner.stop()


def ids(tokens) -> list[int]:
    return [t.id for t in tokens]


def model_logprobs(prompt) -> np.ndarray:
    logits, _ = MODEL.forward(
        PARAMS, np.asarray([prompt], np.int32), init_memory(CONFIG, 1, len(prompt)), np.asarray([len(prompt)], np.int32)
    )
    return np.asarray(jax.nn.log_softmax(logits[0, -1]))


def test_greedy_and_seeded_tokens_are_identical_alone_or_among_other_requests(runner):
    greedy = Request(PROMPT, 24)
    seeded = Request(PROMPT[:4], 24, SamplingParams(temperature=0.9, top_p=0.95, seed=1234))
    alone = [ids(runner.generate(greedy)), ids(runner.generate(seeded))]

    rng = random.Random(0)
    results = {}

    def run(name, request, delay):
        time.sleep(delay)
        results[name] = ids(runner.generate(request))

    threads = [
        threading.Thread(
            target=run,
            args=(
                f"noise{i}",
                Request(
                    [rng.randrange(CONFIG.vocab_size) for _ in range(rng.randrange(1, 200))],
                    rng.randrange(1, 30),
                    SamplingParams(temperature=rng.choice([0.0, 1.0]), seed=i),
                ),
                rng.uniform(0, 0.3),
            ),
        )
        for i in range(12)
    ]
    threads += [
        threading.Thread(target=run, args=("greedy", Request(PROMPT, 24), 0.05)),
        threading.Thread(target=run, args=("seeded", Request(PROMPT[:4], 24, seeded.sampling), 0.12)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [results["greedy"], results["seeded"]] == alone


def test_same_seed_same_tokens_and_different_seed_differs(runner):
    a = ids(runner.generate(Request(PROMPT, 16, SamplingParams(temperature=1.0, seed=5))))
    b = ids(runner.generate(Request(PROMPT, 16, SamplingParams(temperature=1.0, seed=5))))
    c = ids(runner.generate(Request(PROMPT, 16, SamplingParams(temperature=1.0, seed=6))))
    assert a == b and a != c


def test_top_k_one_and_tiny_top_p_equal_greedy(runner):
    greedy = ids(runner.generate(Request(PROMPT, 16)))
    assert ids(runner.generate(Request(PROMPT, 16, SamplingParams(temperature=1.3, top_k=1, seed=3)))) == greedy
    assert ids(runner.generate(Request(PROMPT, 16, SamplingParams(temperature=1.3, top_p=1e-6, seed=3)))) == greedy


def test_min_p_filters_unlikely_tokens(runner):
    """min_p applies to the temperature-scaled distribution (as in vLLM and transformers)."""
    logprobs = model_logprobs(PROMPT)
    allowed = set(np.flatnonzero(logprobs / 2.0 >= logprobs.max() / 2.0 + np.log(0.5)))
    firsts = {
        runner.generate(Request(PROMPT, 1, SamplingParams(temperature=2.0, min_p=0.5, seed=s)))[0].id for s in range(30)
    }
    assert firsts <= allowed
    unfiltered = {runner.generate(Request(PROMPT, 1, SamplingParams(temperature=2.0, seed=s)))[0].id for s in range(30)}
    assert not unfiltered <= allowed


def test_logit_bias_bans_and_forces_tokens(runner):
    greedy = ids(runner.generate(Request(PROMPT, 8)))
    banned = ids(runner.generate(Request(PROMPT, 8, SamplingParams(logit_bias={greedy[0]: -100}))))
    assert greedy[0] not in banned
    forced = ids(runner.generate(Request(PROMPT, 8, SamplingParams(temperature=1.0, seed=1, logit_bias={42: 100}))))
    assert forced == [42] * 8


def test_penalties_act_on_generated_and_prompt_tokens(runner):
    plain = ids(runner.generate(Request(PROMPT, 24)))
    assert len(set(plain)) < len(plain)  # the random model repeats itself
    frequency = ids(runner.generate(Request(PROMPT, 24, SamplingParams(frequency_penalty=2.0))))
    presence = ids(runner.generate(Request(PROMPT, 24, SamplingParams(presence_penalty=2.0))))
    assert len(set(frequency)) == len(frequency) == len(set(presence)) == 24
    repetition = ids(runner.generate(Request(PROMPT, 24, SamplingParams(repetition_penalty=1e4))))
    assert not set(repetition) & set(PROMPT) and len(set(repetition)) == 24


def test_top_logprobs_match_log_softmax_and_sum_to_at_most_one(runner):
    (token,) = runner.generate(Request(PROMPT, 1, logprobs=5))
    reference = model_logprobs(PROMPT)
    top_ids = [i for i, _ in token.top]
    assert top_ids == list(np.argsort(-reference)[:5])
    np.testing.assert_allclose([lp for _, lp in token.top], reference[top_ids], atol=1e-5)
    assert np.exp([lp for _, lp in token.top]).sum() <= 1.0 + 1e-6
    assert token.logprob == pytest.approx(reference[token.id], abs=1e-5)


def test_stop_ids_and_max_tokens_finish_with_the_right_reason(runner):
    greedy = ids(runner.generate(Request(PROMPT, 10)))
    events = list(runner.submit(Request(PROMPT, 10, stop_ids=(greedy[3],))))
    assert [e.token.id for e in events if e.token] == greedy[: greedy.index(greedy[3]) + 1]
    assert events[-1].finish_reason == "stop"
    events = list(runner.submit(Request(PROMPT, 5)))
    assert len([e for e in events if e.token]) == 5 and events[-1].finish_reason == "length"


def test_bad_requests_are_refused_with_clear_errors(runner):
    with pytest.raises(ContextLengthError, match="256.*270"):
        runner.submit(Request(list(range(30)), 240))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.submit(Request([CONFIG.vocab_size + 3], 4))
    with pytest.raises(ValueError, match="max_tokens"):
        runner.submit(Request(PROMPT, 0))


def test_long_prompt_is_prefilled_in_chunks(runner):
    prompt = [(i * 7) % CONFIG.vocab_size for i in range(70)]  # 32 + 32 + 6
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(np.argmax(model_logprobs(seq))))
    assert ids(runner.generate(Request(prompt, 6))) == seq[len(prompt) :]


BAD_PROMPT = [3, 1, 4, 1, 5]  # the request whose prefill fails in the tests below


def fail_prefill_of(engine, prompt, when):
    """Make engine.prefill and engine.prefill_many (short prompts, several per call) raise for `prompt`:
    before any device work, after it (the slot holds the prompt), or after consuming the donated decode
    state (every slot lost)."""
    for name, has in (
        ("prefill", lambda args: list(args[1]) == prompt),
        ("prefill_many", lambda args: prompt in args[1]),
    ):
        real = getattr(engine, name)

        def failing(*args, real=real, name=name, has=has):
            if not has(args):
                return real(*args)
            if when == "after":
                real(*args)
            if when == "state lost":
                for leaf in jax.tree_util.tree_leaves(engine.state):
                    leaf.delete()
                here = getattr(engine, name)
                setattr(engine, name, real)  # it checks the state itself: go through it once more, for real
                try:
                    return real(*args)
                finally:
                    setattr(engine, name, here)
            raise RuntimeError("injected prefill failure")

        setattr(engine, name, failing)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_request_failing_at_prefill_fails_only_itself(when):
    runner = InferenceRunner(
        Engine(MODEL, PARAMS, EngineOptions(slots=2, max_len=64, prefill_buckets=(8,))), max_queue=8
    )
    runner.start(warmup=False)
    try:
        expected = [ids(runner.generate(Request(p, n))) for p, n in ((PROMPT, 40), (PROMPT[2:], 12))]
        fail_prefill_of(runner.engine, BAD_PROMPT, when)
        running = iter(runner.submit(Request(PROMPT, 40)))
        first = next(running)  # running: its first token is out
        bad = runner.submit(Request(BAD_PROMPT, 12))
        after = runner.submit(Request(PROMPT[2:], 12))  # takes the slot the bad request left
        (failed,) = list(bad)
        assert failed.finish_reason == "error" and "injected prefill failure" in failed.error
        assert [first.token.id] + [e.token.id for e in running if e.token] == expected[0]
        assert [e.token.id for e in after if e.token] == expected[1]
    finally:
        runner.stop()


def test_a_request_submitted_as_its_predecessor_fails_is_served_after_the_reset():
    """A client that resubmits the moment its request fails (here: on the loop thread, inside that
    failure's handling, so the order is fixed) gets its new request served, not failed with the rest."""
    runner = InferenceRunner(
        Engine(MODEL, PARAMS, EngineOptions(slots=2, max_len=64, prefill_buckets=(8,))), max_queue=8
    )
    runner.start(warmup=False)
    try:
        expected = ids(runner.generate(Request(PROMPT, 12)))
        fail_prefill_of(runner.engine, BAD_PROMPT, "state lost")
        running = runner.submit(Request(PROMPT, 40))
        events = iter(running)
        next(events)
        again, push = [], running.push

        def resubmit_then_push(event):  # resubmitted before this thread can see the error
            if event.finish_reason == "error":
                again.append(runner.submit(Request(PROMPT, 12)))
            push(event)

        running.push = resubmit_then_push
        assert list(runner.submit(Request(BAD_PROMPT, 12)))[-1].finish_reason == "error"
        assert list(events)[-1].finish_reason == "error"
        (stream,) = again
        out = list(stream)
        assert out[-1].finish_reason == "length", out[-1].error
        assert [e.token.id for e in out if e.token] == expected
    finally:
        runner.stop()


def test_a_prefill_that_loses_the_decode_state_fails_all_then_the_runner_recovers():
    runner = InferenceRunner(
        Engine(MODEL, PARAMS, EngineOptions(slots=2, max_len=64, prefill_buckets=(8,))), max_queue=8
    )
    runner.start(warmup=False)
    try:
        expected = ids(runner.generate(Request(PROMPT, 12)))
        fail_prefill_of(runner.engine, BAD_PROMPT, "state lost")
        running = iter(runner.submit(Request(PROMPT, 40)))
        next(running)
        bad = runner.submit(Request(BAD_PROMPT, 12))
        assert list(bad)[-1].finish_reason == "error"
        last = list(running)[-1]
        assert last.finish_reason == "error"  # its state was lost with the others'
        assert not last.error_public  # an internal failure: its details stay in the server's log
        assert ids(runner.generate(Request(PROMPT, 12))) == expected
    finally:
        runner.stop()


def test_cancelling_a_waiting_request_frees_its_queue_place_at_once():
    runner = InferenceRunner(
        Engine(MODEL, PARAMS, EngineOptions(slots=1, max_len=64, prefill_buckets=(8,))), max_queue=2
    )
    first, second = runner.submit(Request(PROMPT, 4)), runner.submit(Request(PROMPT, 4))  # not started
    runner.cancel(second.request.id)
    assert list(second)[-1].finish_reason == "cancelled"
    third = runner.submit(Request(PROMPT, 4))  # no Overloaded: the cancelled one no longer counts
    with pytest.raises(Overloaded):  # first and third fill the queue of 2
        runner.submit(Request(PROMPT, 4))
    runner.start(warmup=False)
    try:
        assert list(first)[-1].finish_reason == "length" and list(third)[-1].finish_reason == "length"
    finally:
        runner.stop()


def test_batched_prefill_keeps_batch_invariance():
    """Short prompts admitted together share one rows program call; each request's tokens are those
    it gets alone (one padded row in the same program), whatever its batch mates' prompts and settings."""
    engine = Engine(MODEL, PARAMS, EngineOptions(slots=5, max_len=64, prefill_buckets=(8, 16), prefill_rows=4))
    assert (engine.rows_program(7), engine.rows_program(9), engine.rows_program(17)) == ((8, 4), (16, 2), None)
    rows_per_call = []
    real = engine.prefill_many
    engine.prefill_many = lambda *a: rows_per_call.append(len(a[1])) or real(*a)
    runner = InferenceRunner(engine)  # never started: this thread is the loop

    def run(requests):
        streams = [runner.submit(r) for r in requests]
        while not all(s.done for s in streams):
            runner.iterate()
        return [[e.token.id for e in s if e.token] for s in streams]

    greedy = Request(PROMPT, 12)
    seeded = Request(PROMPT[:4], 12, SamplingParams(temperature=0.9, top_p=0.95, seed=1234))
    alone = run([greedy]) + run([seeded])
    assert rows_per_call == [1, 1]
    mates = [
        Request([9, 8, 7, 6, 5, 4], 9, SamplingParams(temperature=1.0, top_k=3, seed=7)),
        Request(PROMPT, 12, greedy.sampling),  # the target ...
        Request([1, 2, 3], 5, SamplingParams(repetition_penalty=1.3, logit_bias={4: 5.0})),
        Request(PROMPT[:4], 12, seeded.sampling),  # ... and the other one
        Request(list(range(20)), 6),  # too long for a rows program: the one-row path, same iteration
    ]
    together = run(mates)
    assert rows_per_call == [1, 1, 4]
    assert [together[1], together[3]] == alone
