"""Multi-host with the paged default and the pool cache (issue 34): host 0's prefix cache may hand a
prompt cached blocks of the pool (a finished reply's, or a prompt's whose slot has moved on); its
followers must adopt the same blocks, so the Reuse they replay carries the block ids, not only the
source slot and length. A real tiny Engine on each side: after every pass the follower's block tables
and KV pool equal host 0's, and the second turn reuses the first turn's reply on both."""

from __future__ import annotations

import jax
import numpy as np
from helpers import init_params, tiny_config
from test_leader_replay import RecordingLeader

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams
from hkserve.multihost.hosts import LeaderEngine, follow

CONFIG = tiny_config(vocab_size=96, context_length=256)
F32 = jax.tree_util.tree_map(np.asarray, init_params(CONFIG, 3))
PROMPT = [(7 * i + 3) % 96 for i in range(70)]
OTHER = [(5 * i + 1) % 96 for i in range(40)]


def engine() -> Engine:
    options = EngineOptions(1, 256, (8, 32), prefix_cache="on", kv_layout="paged", block_size=16)
    return Engine(build_model(CONFIG), F32, options)


def test_a_follower_adopts_the_cached_blocks_host_0_reuses_and_holds_the_same_kv():
    """Planted (the reuse announced without its blocks): the follower's tables or KV part from host 0's."""
    leader_engine, follower_engine = engine(), engine()
    channel = RecordingLeader()
    runner = InferenceRunner(LeaderEngine(leader_engine, channel), max_queue=8)  # the test's thread is the loop
    replayed = 0

    def run(prompt: list[int], max_tokens: int) -> tuple[list[int], int]:
        nonlocal replayed
        stream = runner.submit(Request(prompt, max_tokens, SamplingParams(temperature=0.0)))
        while not stream.done:
            runner.iterate()
            assert follow(follower_engine, iter(channel.sent[replayed:] + [{"op": "exit"}])) == 0
            replayed = len(channel.sent)
            leader, follower = leader_engine.kv_pool, follower_engine.kv_pool
            assert (follower.table == leader.table).all() and follower.held == leader.held
            for ours, theirs in zip(
                jax.tree_util.tree_leaves(leader_engine.state), jax.tree_util.tree_leaves(follower_engine.state)
            ):
                np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
        events = list(stream)
        return [e.token.id for e in events if e.token is not None], stream.cached_tokens

    reply, _ = run(PROMPT, 20)
    run(OTHER, 4)  # takes the only slot: turn 1's blocks are the pool cache's alone
    _, cached = run(PROMPT + reply + OTHER[:5], 4)
    assert cached >= 80  # the prompt's 4 full blocks and the reply's: taken from the pool, on both hosts
    assert any(m.get("reuse") for m in channel.sent if m["op"] == "prefill")
