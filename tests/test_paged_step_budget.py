"""Token-budget steps (`max_step_tokens`, issue 34 step 4) through Engine and InferenceRunner on the tiny
random model of test_paged_engine: a long prompt prefilled one 32-token chunk per pass, decode steps of
its neighbours between its chunks, replies exactly those of the one-shot prefill (greedy and seeded),
alone and among neighbours, on both KV layouts and with the prefix cache's exact mode."""

from __future__ import annotations

import pytest
from test_paged_engine import CONFIG, F32, neighbours, run

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

LONG = Request([(7 * i + 3) % 96 for i in range(130)], 12, SamplingParams(temperature=0.0))  # 5 chunks of 32
SEEDED = Request([(5 * i + 1) % 96 for i in range(100)], 12, SamplingParams(temperature=0.9, seed=3))


def make(layout: str, max_step_tokens: int | None, prefix_cache: str = "off") -> InferenceRunner:
    args = {"block_size": 16} if layout == "paged" else {}
    options = EngineOptions(
        slots=4, max_len=160, prefill_buckets=(8, 32), kv_layout=layout, prefix_cache=prefix_cache, **args
    )
    engine = Engine(build_model(CONFIG), F32, options)
    return InferenceRunner(engine, max_queue=64, max_step_tokens=max_step_tokens)


def prefilling_passes(runner: InferenceRunner, requests: list[Request]) -> tuple[list[list[int]], int]:
    """The replies, and the passes after which some prompt was still part way through its prefill."""
    passes = []
    replies = run(runner, requests, watch=lambda r: passes.append(any(j.done for j in r._prefills.values())))
    return replies, sum(passes)


@pytest.mark.parametrize("layout", ["static", "paged"])
def test_a_prompt_prefilled_over_several_passes_replies_as_the_one_shot_prefill(layout):
    one_shot, chunked = make(layout, None), make(layout, 4 + 32)  # rows + one chunk of 32 a pass
    mixed = neighbours(6, seed=5)
    mixed[2:2], mixed[5:5] = [LONG], [SEEDED]
    want_alone = [run(one_shot, [r])[0] for r in (LONG, SEEDED)]
    want_mixed = run(one_shot, mixed)
    got_alone = [prefilling_passes(chunked, [r]) for r in (LONG, SEEDED)]
    assert [g[0][0] for g in got_alone] == want_alone
    assert [g[1] for g in got_alone] == [4, 3]  # 5 and 4 chunks: one a pass
    got_mixed, passes = prefilling_passes(chunked, mixed)
    assert got_mixed == want_mixed
    assert [got_mixed[2], got_mixed[5]] == want_alone  # batch invariance
    assert passes >= 7
    if layout == "paged":
        chunked.engine.kv_pool.check()
        assert chunked.engine.kv_pool.used == 0


def test_exact_prefix_reuse_is_kept_with_chunked_prefills():
    """Mode exact: the second prompt reuses the first's 128 prefilled tokens and replies bit for bit
    as uncached, though both prefills went 64 tokens a pass."""
    common = [(11 * i + 2) % 96 for i in range(128)]
    first, second = Request(common + [1, 2, 3], 8), Request(common + [4, 5], 8)
    uncached = make("paged", None, "exact")
    want = [run(uncached, [first])[0], run(make("paged", None, "exact"), [second])[0]]
    chunked = make("paged", 4 + 64, "exact")
    got_first, passes = prefilling_passes(chunked, [first])
    streams_second = prefilling_passes(chunked, [second])
    assert [got_first[0], streams_second[0][0]] == want
    assert passes == 2 and streams_second[1] == 0  # 3 chunks of 64, then the cached 128 + one chunk
    assert chunked.prefix.hit == 128
