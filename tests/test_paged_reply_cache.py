"""A finished reply's KV blocks reusable by the next turn of a chat (issue 34), on a tiny random model:
turn 2's prompt is turn 1's prompt + reply + more, in a slot whose own memory was taken by another
request meanwhile, so only the pool cache (block_cache.py) can give it the reply. Mode "on" reuses the
reply's full blocks; mode "exact" none of the decode-written ones (not bit for bit a prefill's); both
reply as an uncached run. A reply's block found under a colliding key but holding other tokens is
refused by the cache's token check."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import init_params, tiny_config

from hkserve.engine import block_cache
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

CONFIG = tiny_config(vocab_size=96, sliding_window=24, sliding_layers=(True, False), context_length=384)
F32 = jax.tree_util.tree_map(np.asarray, init_params(CONFIG, 7))
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [(7 * i + 3) % 96 for i in range(100)]  # 6 full blocks of 16 and 4 tokens
OTHER = [(5 * i + 1) % 96 for i in range(100)]  # the request between the turns (no common prefix)
MORE = [(11 * i + 2) % 96 for i in range(20)]  # the user's next message
REPLY = 40  # turn 1's tokens: prompt + reply write positions 0..138 at least, blocks 0..7 full


def make_runner(layout: str, prefix_cache: str) -> InferenceRunner:
    """One slot, so the request between the turns takes turn 1's slot (its memory no longer the cache)."""
    blocks = {"block_size": 16} if layout == "paged" else {}
    options = EngineOptions(1, 384, (8, 64), prefix_cache=prefix_cache, kv_layout=layout, **blocks)
    return InferenceRunner(Engine(build_model(CONFIG), F32, options), max_queue=8)  # the test's thread is the loop


def run(runner: InferenceRunner, prompt: list[int], max_tokens: int):
    """One request to its end, the pool checked after each pass → (its tokens, its cached_tokens)."""
    stream = runner.submit(Request(prompt, max_tokens, GREEDY))
    while not stream.done:
        runner.iterate()
        if runner.engine.kv_pool is not None:
            runner.engine.kv_pool.check()
    events = list(stream)
    assert events[-1].finish_reason == "length", events[-1]
    return [e.token.id for e in events if e.token is not None], stream.cached_tokens


@pytest.fixture(scope="module")
def uncached():
    """Each prompt alone on the static layout without a prefix cache: the independent reference."""
    runner = make_runner("static", "off")
    return lambda prompt, max_tokens: run(runner, prompt, max_tokens)[0]


@pytest.mark.parametrize(
    "mode, reused",
    [
        ("on", 128),  # blocks 0..7: the prompt's 6 and the 2 the reply filled (positions 96..127)
        ("exact", 64),  # one whole 64-token chunk of the prompt's prefill; no decode-written block
    ],
)
def test_the_next_turn_reuses_the_replys_full_blocks_only_where_exactness_allows(mode, reused, uncached):
    """Planted (a finished reply not registered) "on" reuses 96; (mode "exact" registering it too) 128."""
    runner = make_runner("paged", mode)
    reply, cached = run(runner, PROMPT, REPLY)
    assert cached == 0 and reply == uncached(PROMPT, REPLY)
    assert run(runner, OTHER, 8)[1] == 0  # takes the only slot: turn 1's memory is now the pool's alone
    turn2 = PROMPT + reply + MORE
    tokens, cached = run(runner, turn2, 16)
    assert cached == reused
    assert tokens == uncached(turn2, 16)


def test_a_reply_block_under_a_colliding_key_with_other_tokens_is_refused(monkeypatch, uncached):
    """Every block's key made blind to its tokens (as a hash collision would be): turn 2 continues the
    prompt with other tokens than the reply, so its walk finds the reply's blocks under its own keys;
    the token check refuses them, and only the prompt's 6 blocks are reused. Planted (`match` without
    the token check) the reply's KV is reused under the wrong tokens: 128 cached, and the reply changes."""
    monkeypatch.setattr(block_cache, "chain_hash", lambda parent, tokens: hash((parent, len(tokens))))
    runner = make_runner("paged", "on")
    reply, _ = run(runner, PROMPT, REPLY)
    run(runner, OTHER, 8)
    other_reply = [(t + 1) % 96 for t in reply]  # not what turn 1 replied, position by position
    turn2 = PROMPT + other_reply + MORE
    tokens, cached = run(runner, turn2, 16)
    assert cached == 96
    assert tokens == uncached(turn2, 16)
