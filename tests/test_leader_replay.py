"""Host 0's LeaderEngine announces each device call and the followers replay it: a batched prefill
(prefill_many) reaches a follower's engine as the same call, slots, prompts and settings; under the
paged layout a follower's block pool follows host 0's through preemptions and releases."""

from __future__ import annotations

import json

import numpy as np
from fake_engine import FakeEngine

from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.sampling import SamplingParams
from hkserve.multihost.hosts import LeaderEngine, follow


class RecordingLeader:
    def __init__(self):
        self.sent: list[dict] = []

    def broadcast(self, message: dict) -> None:
        self.sent.append(json.loads(json.dumps(message)))  # as the channel carries it: JSON


def test_a_batched_prefill_and_a_step_are_replayed_identically_by_a_follower():
    leader_engine, follower_engine = FakeEngine(slots=4, prefill_rows=2), FakeEngine(slots=4, prefill_rows=2)
    channel = RecordingLeader()
    engine = LeaderEngine(leader_engine, channel)
    settings = [SamplingParams(temperature=0.5, seed=3), None]
    first = engine.prefill_many([2, 0], [[5, 6], [7]], settings).read()
    engine.step(np.asarray([True, False, True, False])).read()
    assert [m["op"] for m in channel.sent] == ["prefill_many", "step"]
    assert follow(follower_engine, iter(channel.sent + [{"op": "exit"}])) == 0
    assert follower_engine.calls == leader_engine.calls
    assert [t.id for t in first] == [7, 8]
    assert channel.sent[0]["settings"][0]["temperature"] == 0.5 and channel.sent[0]["settings"][0]["seed"] == 3


class MaskRecorder:
    """An engine stand-in that records the grammar-constrained calls and their masks."""

    def __init__(self):
        self.calls: list[tuple] = []

    def prefill(self, slot, prompt_ids, settings, bitmask=None):
        self.calls.append(
            ("prefill", slot, list(prompt_ids), None if bitmask is None else np.asarray(bitmask).tolist())
        )

    def score_prefill(self, slot, prompt_ids, settings, bitmask=None):
        self.calls.append(("score", slot, list(prompt_ids), None if bitmask is None else np.asarray(bitmask).tolist()))

    def step_forward(self, active):
        self.calls.append(("forward", np.asarray(active).tolist()))
        return len(self.calls)  # stands for the pending logits

    def step_sample(self, forward, bitmask):
        self.calls.append(("sample", forward, np.asarray(bitmask).tolist()))


def test_grammar_masks_reach_a_follower_with_the_prefill_and_the_split_step():
    leader_engine, follower_engine, channel = MaskRecorder(), MaskRecorder(), RecordingLeader()
    engine = LeaderEngine(leader_engine, channel)
    first = np.asarray([[-1, 5]], np.int32)  # [1, W]: a prefill's first mask
    masks = np.asarray([[-(2**31), 7], [0, -1]], np.int32)  # [B, W], extreme int32 values included
    engine.prefill(1, [4, 5], SamplingParams(), bitmask=first)
    engine.score_prefill(0, [6], None)
    engine.step_sample(engine.step_forward(np.asarray([True, True])), masks)
    assert [m["op"] for m in channel.sent] == ["prefill", "score_prefill", "step_forward", "step_sample"]
    assert follow(follower_engine, iter(channel.sent + [{"op": "exit"}])) == 0
    assert follower_engine.calls == leader_engine.calls
    assert follower_engine.calls[-1] == ("sample", 3, masks.tolist())


def test_a_follower_replaying_a_paged_run_with_preemptions_holds_host_0s_block_tables_after_every_pass():
    """Paged (issue 34): host 0's block pool decides which blocks each slot holds; a follower's pool
    makes the same decisions only if it replays every call that changes one — prefills (a preempted
    request's resume with its `generated` tokens too), steps, and releases — in order."""
    rng = np.random.default_rng(5)
    requests = [
        Request(rng.integers(1, 100, rng.integers(1, 10)).tolist(), int(rng.integers(5, 20))) for _ in range(16)
    ]
    leader_engine, follower_engine = (FakeEngine(slots=8, kv_blocks=16, block_size=4) for _ in range(2))
    channel = RecordingLeader()
    runner = InferenceRunner(LeaderEngine(leader_engine, channel), max_queue=64)  # never started: we are the loop
    streams = [runner.submit(r) for r in requests]
    replayed = 0
    while not all(s.done for s in streams):
        runner.iterate()
        assert follow(follower_engine, iter(channel.sent[replayed:] + [{"op": "exit"}])) == 0
        replayed = len(channel.sent)
        leader, follower = leader_engine.kv_pool, follower_engine.kv_pool
        assert (follower.table == leader.table).all() and follower.held == leader.held
    assert runner.preemptions > 0 and follower_engine.calls == leader_engine.calls
    assert any(m.get("generated") for m in channel.sent if m["op"] == "prefill")  # resumes were announced
    assert follower_engine.kv_pool.used == leader_engine.kv_pool.used == 0
