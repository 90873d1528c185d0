"""Completion: one request's runner events as text, finish reason, usage and logprobs."""

from __future__ import annotations

import asyncio

import pytest

from hkserve.engine.completion import Completion, GenerationFailed
from hkserve.engine.outputs import Token
from hkserve.engine.requests import Event, Request, RequestStream

TEXT = "Hello world! The quick brown fox 🌍 jumps."


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[2]


def replay(tokenizer, ids, finish, loop=None, max_tokens=100):
    """A stream that already holds the events a runner would push for `ids`, ending with `finish`."""
    request = Request(tokenizer.encode("hi"), max_tokens, stop_ids=tokenizer.stop_ids)
    stream = RequestStream(request, loop)
    for i in ids:
        stream.push(Event(request.id, Token(i, -0.5, [(i, -0.5)])))
    stream.push(Event(request.id, None, finish))
    return stream


def test_eos_shows_no_text_but_counts_in_usage(tokenizer):
    ids = tokenizer.encode(TEXT) + [tokenizer.eos_id]
    completion = Completion(replay(tokenizer, ids, "stop"), tokenizer, cancel=lambda _: None)
    deltas = list(completion)
    assert "".join(d.text for d in deltas) == completion.text == TEXT
    assert all("\ufffd" not in d.text for d in deltas)
    assert [t.id for d in deltas for t in d.logprobs] == ids[:-1]  # EOS has no visible logprob
    assert completion.finish_reason == "stop" and deltas[-1].finish_reason == "stop"
    assert completion.usage() == {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": 1 + len(ids)}


def test_a_stop_string_ends_early_cancels_the_request_and_drops_the_rest(tokenizer):
    cancelled = []
    ids = tokenizer.encode(TEXT)
    stream = replay(tokenizer, ids, "cancelled")
    completion = Completion(stream, tokenizer, cancelled.append, stop=["fox 🌍"])
    deltas = list(completion)
    assert completion.text == TEXT[: TEXT.index("fox 🌍")]
    assert completion.finish_reason == "stop" and cancelled == [stream.request.id]
    assert deltas[-1].finish_reason == "stop" and completion.tokens < len(ids)
    completion.cancel()  # ended already: no second cancel
    assert cancelled == [stream.request.id]


def test_async_iteration_and_runner_errors(tokenizer):
    async def run():
        stream = replay(tokenizer, tokenizer.encode("Hi"), "length", asyncio.get_running_loop())
        return [d async for d in Completion(stream, tokenizer, cancel=lambda _: None)]

    deltas = asyncio.run(run())
    assert "".join(d.text for d in deltas) == "Hi" and deltas[-1].finish_reason == "length"
    request = Request([1], 4)
    stream = RequestStream(request)
    stream.push(Event(request.id, None, "error", "device lost"))
    with pytest.raises(GenerationFailed, match="device lost"):
        list(Completion(stream, tokenizer, cancel=lambda _: None))
