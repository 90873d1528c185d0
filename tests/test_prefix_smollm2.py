"""Prefix caching on the real default model (issue 17's must-shows): greedy tokens with the cache equal
those without it — the golden cases run twice, and (slow: `-m slow`) a 4-turn chat over HTTP (KV reused
from earlier prompts and replies) and 16 concurrent requests sharing a 300-token system prompt."""

from __future__ import annotations

import re
import threading

import httpx
import pytest
from http_helpers import LiveServer

from hkserve.api.app import create_app
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.prefix_cache import DEFAULT_MODE, PrefixCache
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams

NAME = "smollm2-135m-instruct"
SYSTEM = "You are a helpful assistant for a bicycle shop. " + " ".join(
    f"Rule {i}: answer questions about part number {1000 + i} politely and briefly." for i in range(24)
)


@pytest.fixture(scope="module")
def runner(smollm2):
    _, info, _, params = smollm2
    engine = Engine(build_model(info.config), params, EngineOptions(slots=4, max_len=512, prefix_cache=DEFAULT_MODE))
    runner = InferenceRunner(engine, max_queue=64).start(warmup=False)
    yield runner
    runner.stop()


def use_cache(runner: InferenceRunner, mode: str, min_reuse: int = 16) -> None:
    """A fresh record in `mode` (set while the runner is idle; nothing the old record knew is reused)."""
    runner.prefix = PrefixCache(runner.engine.slots, mode, runner.engine.prefill_chunk or 1, min_reuse)


def greedy(runner, ids, n, stop_ids=()) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens reused) of one request."""
    stream = runner.submit(Request(list(ids), n, SamplingParams(temperature=0.0), tuple(stop_ids)))
    tokens = [e.token.id for e in stream if e.token is not None]
    return tokens, stream.cached_tokens


def test_golden_cases_run_twice_equal_the_reference_with_the_second_run_from_the_cache(runner, golden, smollm2):
    stop = smollm2[2].stop_ids
    use_cache(runner, DEFAULT_MODE, min_reuse=1)  # the golden prompts are short: let every one of them hit
    for run in range(2):
        for case in golden["cases"]:
            tokens, cached = greedy(runner, case["prompt_ids"], 32, stop)
            assert tokens == case["greedy_ids"], (run, case["name"])
            if run:
                assert cached == len(case["prompt_ids"]) - 1, case["name"]  # all but the last prompt token


@pytest.mark.slow  # ~6 min on the loaded 2-core machine: the golden-twice test above covers the default suite
def test_a_four_turn_chat_over_http_equals_the_uncached_replies_and_reports_cached_tokens(runner, smollm2):
    tokenizer = smollm2[2]
    server = LiveServer(create_app(runner, tokenizer, NAME, runner.engine.max_len))
    try:
        use_cache(runner, DEFAULT_MODE)
        messages, uncached = [{"role": "system", "content": "You are a terse assistant."}], []
        questions = ["Name a fruit.", "What colour is it?", "Name another one.", "Which of the two is sweeter?"]
        for turn, question in enumerate(questions):
            messages.append({"role": "user", "content": question})
            body = {"model": NAME, "messages": messages, "max_tokens": 24, "temperature": 0}
            reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600).json()
            text, usage = reply["choices"][0]["message"]["content"], reply["usage"]
            prompt = tokenizer.encode_chat(messages)
            # reused: the previous turn's prompt and reply (its re-tokenised text as far as it matches)
            assert usage["prompt_tokens_details"]["cached_tokens"] >= (uncached[-1][1] if turn else 0)
            uncached.append((prompt, len(prompt)))
            messages.append({"role": "assistant", "content": text})
        metrics = httpx.get(server.url + "/metrics").text
        use_cache(runner, "off")
        for (prompt, _), m in zip(uncached, messages[2::2]):
            tokens, cached = greedy(runner, prompt, 24, tokenizer.stop_ids)
            text = tokenizer.decode([t for t in tokens if t not in tokenizer.stop_ids])
            assert text == m["content"] and cached is None
    finally:
        server.stop()
    hits, looked_up = (
        float(re.search(rf"^hkserve_prefix_cache_{name}_tokens_total (\S+)$", metrics, re.M).group(1))
        for name in ("hit", "lookup")
    )
    assert looked_up == sum(n for _, n in uncached) and hits >= sum(n for _, n in uncached[:-1])


@pytest.mark.slow
def test_sixteen_concurrent_requests_sharing_a_300_token_system_prompt(runner, smollm2):
    tokenizer = smollm2[2]
    prompts = [
        tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Part {1000 + i}?"}])
        for i in range(16)
    ]
    assert min(len(p) for p in prompts) >= 300

    def all_at_once() -> list[tuple[list[int], int]]:
        results = [None] * 16

        def one(i):
            results[i] = greedy(runner, prompts[i], 8, tokenizer.stop_ids)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        return results

    use_cache(runner, "off")
    uncached = all_at_once()
    use_cache(runner, DEFAULT_MODE)
    cached = all_at_once()
    assert [t for t, _ in cached] == [t for t, _ in uncached]
    assert sum(n for _, n in cached) >= 15 * 300  # all but the first copied the system prompt
