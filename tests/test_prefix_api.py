"""The HTTP side of prefix caching on a fake runner: usage.prompt_tokens_details.cached_tokens (only
when the cache looked the prompt up; per prompt, the fewest of its choices) and the /metrics counters."""

from __future__ import annotations

import re

import httpx
from http_helpers import FakeRunner, LiveServer

from hkserve.api.app import create_app


class CachingRunner(FakeRunner):
    """FakeRunner whose requests report `cached` reused prompt tokens, in turn (None: cache off)."""

    def __init__(self, script, cached):
        super().__init__(script)
        self.cached = iter(cached)

    def submit(self, request, loop=None):
        stream = super().submit(request, loop)
        stream.cached_tokens = next(self.cached)
        return stream


def test_cached_tokens_in_usage_and_metrics(smollm2):
    tokenizer = smollm2[2]
    script = tokenizer.encode("Hello there") + [tokenizer.eos_id]
    body = {"model": "m", "prompt": ["one two three", "four five six"], "n": 2, "max_tokens": 2}
    server = LiveServer(create_app(CachingRunner(script, [3, 1, 2, 2, None]), tokenizer, "m", 256))
    try:
        usage = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": 1 + 2}
        off = httpx.post(server.url + "/v1/completions", json={**body, "prompt": "x", "n": 1}, timeout=30).json()
        assert "prompt_tokens_details" not in off["usage"]
        metrics = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    counter = {
        name: float(re.search(rf"^hkserve_prefix_cache_{name}_tokens_total (\S+)$", metrics, re.M).group(1))
        for name in ("hit", "lookup")
    }
    prompt = len(tokenizer.encode("one two three")), len(tokenizer.encode("four five six"))
    assert counter == {"hit": 3 + 1 + 2 + 2, "lookup": 2 * sum(prompt)}
