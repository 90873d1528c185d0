"""InferenceRunner's scheduling on FakeEngine (tokens by arithmetic: the last token + 1).

Most tests never start the runner's thread: they call `runner.iterate()` themselves, so the test is
the loop and every event happens in an order it chooses."""

from __future__ import annotations

import threading

import pytest
from fake_engine import FakeEngine, events, final_event, token_ids

from hkserve.engine.requests import Overloaded, Request
from hkserve.engine.runner import InferenceRunner, RunnerStats


def make(slots: int = 1, **kwargs) -> tuple[FakeEngine, InferenceRunner]:
    keys = ("max_len", "strict_fits", "prefill_rows", "chunk", "prefill_buckets")
    engine_args = {k: kwargs.pop(k) for k in keys if k in kwargs}
    engine = FakeEngine(slots=slots, **engine_args)
    return engine, InferenceRunner(engine, **kwargs)


def drain(runner: InferenceRunner, limit: int = 100) -> None:
    """Iterate until nothing is in flight or queued."""
    for _ in range(limit):
        if not runner.iterate() and not runner.stats().waiting:
            return
    raise AssertionError(f"still busy after {limit} iterations")


def prefills(engine: FakeEngine) -> list[tuple[int, list[int]]]:
    return [(c[1], c[2]) for c in engine.calls if c[0] == "prefill"]


def test_the_step_token_budget_admits_in_order_and_at_least_one_prompt_per_iteration():
    """Buckets of at most 8: a pass that decodes nothing takes max(budget, the largest bucket) = 10."""
    engine, runner = make(slots=4, max_step_tokens=10, prefill_buckets=(8,))
    streams = [runner.submit(Request([i] * 4, 2)) for i in range(4)]
    runner.iterate()  # 4 + 4 + 4 tokens: the third prompt crosses the budget, the fourth waits
    assert prefills(engine) == [(0, [0] * 4), (1, [1] * 4), (2, [2] * 4)]
    assert runner.stats() == RunnerStats(4, 3, 1)
    runner.iterate()
    assert prefills(engine)[3:] == [(3, [3] * 4)]
    drain(runner)
    assert [token_ids(events(s)) for s in streams] == [[i + 1, i + 2] for i in range(4)]

    engine, runner = make(slots=2, max_step_tokens=10, prefill_buckets=(8,))
    runner.submit(Request([7] * 30, 1))  # longer than the budget: admitted alone
    runner.submit(Request([8] * 2, 1))
    runner.iterate()
    assert prefills(engine) == [(0, [7] * 30)]
    runner.iterate()
    assert prefills(engine)[1:] == [(1, [8] * 2)]

    engine, runner = make(slots=4, max_step_tokens=10, prefill_buckets=(8, 16))  # an idle pass: 16
    for i in range(4):
        runner.submit(Request([i] * 4, 2))
    runner.iterate()
    assert prefills(engine) == [(i, [i] * 4) for i in range(4)]  # 4 + 4 + 4 crosses 10 but not 16


def test_short_prompts_admitted_together_are_prefilled_in_groups_and_each_gets_its_own_row():
    engine, runner = make(slots=4, prefill_rows=2)  # prompts of up to 8 tokens: 2 per prefill_many call
    prompts = [[10, 11], [20] * 9, [30], [40, 41, 42]]  # the second is too long for a group
    streams = [runner.submit(Request(p, 2)) for p in prompts]
    runner.iterate()
    assert [c for c in engine.calls if c[0].startswith("prefill")] == [
        ("prefill", 1, [20] * 9),  # at once, in queue order
        ("prefill_many", [0, 2], [[10, 11], [30]]),  # the group is full
        ("prefill_many", [3], [[40, 41, 42]]),  # the rest, at the end of the admission
    ]
    drain(runner)
    assert [token_ids(events(s)) for s in streams] == [[p[-1] + 1, p[-1] + 2] for p in prompts]


def test_cancelling_a_queued_request_removes_it_at_the_next_iteration():
    engine, runner = make(slots=1)
    running = runner.submit(Request([10], 50))
    queued = runner.submit(Request([20], 50))
    runner.iterate()
    assert runner.stats() == RunnerStats(1, 1, 1)
    runner.cancel(queued.request.id)
    runner.iterate()
    assert runner.stats() == RunnerStats(1, 1, 0)
    assert [(e.token, e.finish_reason) for e in events(queued)] == [(None, "cancelled")]
    assert [slot for slot, _ in prefills(engine)] == [0]  # it never reached the engine
    assert token_ids(events(running)) == [11, 12]


def test_cancelling_a_running_request_frees_its_slot_for_the_next_in_the_same_iteration():
    engine, runner = make(slots=1)
    first = runner.submit(Request([10], 50))
    runner.iterate()
    second = runner.submit(Request([40], 3))
    runner.iterate()
    assert runner.stats() == RunnerStats(1, 1, 1)
    runner.cancel(first.request.id)
    runner.iterate()
    assert prefills(engine) == [(0, [10]), (0, [40])]  # the freed slot is refilled at once
    assert runner.stats() == RunnerStats(1, 1, 0)
    evs = events(first)
    assert evs[-1].finish_reason == "cancelled" and token_ids(evs) == [11, 12]
    drain(runner)
    assert token_ids(events(first)) == []  # its tokens still in flight were discarded
    evs = events(second)
    assert token_ids(evs) == [41, 42, 43] and evs[-1].finish_reason == "length"


def test_tokens_are_read_one_step_behind_in_order_and_the_extra_token_is_discarded():
    engine, runner = make(slots=1)
    stream = runner.submit(Request([10], 2))
    runner.iterate()  # prefill (→ 11) and step (→ 12) dispatched, nothing read yet
    assert events(stream) == [] and engine.calls == [("prefill", 0, [10]), ("step", [0])]
    runner.iterate()  # step (→ 13) dispatched before 11 and 12 are read and end the request
    evs = events(stream)
    assert token_ids(evs) == [11, 12] and evs[-1].finish_reason == "length"
    assert engine.last[0] == 13 and engine.calls[-1] == ("step", [0])
    assert runner.iterate() is False  # 13 is read and dropped; nothing more runs
    assert events(stream) == [] and engine.calls[-1] == ("step", [0]) and runner.stats().running == 0

    stream = runner.submit(Request([90], 20))  # wraps around the vocabulary of 100
    drain(runner)
    assert token_ids(events(stream)) == [(90 + k) % 100 for k in range(1, 21)]


def test_stop_token_ends_the_request_with_stop():
    _, runner = make(slots=1)
    stream = runner.submit(Request([10], 50, stop_ids=(13,)))
    drain(runner)
    evs = events(stream)
    assert token_ids(evs) == [11, 12, 13] and evs[-1].finish_reason == "stop"


def test_a_full_queue_raises_overloaded_until_a_request_is_admitted():
    _, runner = make(slots=1, max_queue=2)
    runner.submit(Request([1], 4))
    runner.submit(Request([2], 4))
    with pytest.raises(Overloaded, match="2 waiting"):
        runner.submit(Request([3], 4))
    runner.iterate()  # the first is admitted: one place is free again
    runner.submit(Request([3], 4))
    with pytest.raises(Overloaded):
        runner.submit(Request([4], 4))


def test_abort_from_another_thread_is_carried_out_by_the_loop():
    _, runner = make(slots=1)
    running = runner.submit(Request([10], 50))
    runner.iterate()
    queued = runner.submit(Request([20], 50))
    watcher = threading.Thread(target=runner.abort, args=("lost host 1 of 2 (gone)",))
    watcher.start()
    watcher.join()
    assert not runner.ready.is_set()
    assert events(running) == [] and events(queued) == []  # the watcher touched neither
    with pytest.raises(Overloaded):
        runner.submit(Request([30], 2))
    runner.iterate()
    for stream in (running, queued):
        (last,) = events(stream)
        assert (last.finish_reason, last.error) == ("error", "lost host 1 of 2 (gone)")
        assert last.error_public  # the server's state, for the client to see (HTTP keeps internals out)
    assert runner.stats() == RunnerStats(1, 0, 0)


def test_abort_ends_the_requests_of_a_running_loop():
    _, runner = make(slots=2, max_len=10**9)
    runner.start(warmup=False)
    try:
        streams = [runner.submit(Request([i], 10**8)) for i in range(3)]
        first = iter(streams[0])
        assert next(first).token.id == 1  # the loop is running
        runner.abort("lost host 1")
        for stream in streams:
            last = list(first if stream is streams[0] else stream)[-1]
            assert (last.finish_reason, last.error) == ("error", "lost host 1")
    finally:
        runner.stop()


def test_abort_ends_the_requests_itself_when_the_loop_is_stuck_in_a_device_call():
    engine = FakeEngine(slots=1, gate=threading.Event())
    runner = InferenceRunner(engine)
    runner.abort_grace_s = 0.05
    runner.start(warmup=False)
    try:
        running = runner.submit(Request([10], 20))
        queued = runner.submit(Request([20], 20))
        assert engine.stepping.wait(10)  # the loop is inside a step that will not return
        runner.abort("lost host 1")
        for stream in (running, queued):
            last = final_event(stream)
            assert (last.finish_reason, last.error, last.error_public) == ("error", "lost host 1", True)
    finally:
        engine.gate.set()
        runner.stop()
    assert events(running) == [] and events(queued) == []  # the loop, back, pushed nothing more


def test_stats_are_the_snapshot_of_the_last_iteration():
    _, runner = make(slots=2)
    before = runner.stats()
    runner.submit(Request([1], 2))
    runner.submit(Request([2], 2))
    runner.submit(Request([3], 2))
    assert runner.stats() is before == RunnerStats(2, 0, 0)  # nothing counted until the loop looks
    runner.iterate()
    assert runner.stats() == RunnerStats(2, 2, 1)
    drain(runner)
    assert runner.stats() == RunnerStats(2, 0, 0)


def test_a_slot_reaching_the_context_length_ends_only_its_request():
    engine, runner = make(slots=2, max_len=8, strict_fits=False)
    long = runner.submit(Request([10, 11, 12, 13], 100))
    short = runner.submit(Request([50, 51], 6))
    drain(runner)
    evs = events(long)  # 4 prompt tokens + 4 stepped = 8, plus the token sampled by the last step
    assert token_ids(evs) == [14, 15, 16, 17, 18] and evs[-1].finish_reason == "length" and not evs[-1].error
    evs = events(short)
    assert token_ids(evs) == [52, 53, 54, 55, 56, 57] and evs[-1].finish_reason == "length"
    assert ("reset",) not in engine.calls
    after = runner.submit(Request([70], 3))  # and the runner goes on serving
    drain(runner)
    assert token_ids(events(after)) == [71, 72, 73]


def test_started_runner_serves_concurrent_requests():
    _, runner = make(slots=2, max_queue=16)
    runner.start()
    try:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            results[i] = [t.id for t in runner.generate(Request([i * 10], 5))]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == {i: [i * 10 + k for k in range(1, 6)] for i in range(6)}
    finally:
        runner.stop()
