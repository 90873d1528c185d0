"""The HTTP layer against a fake runner: OpenAI shapes, errors, stop strings, streaming, disconnects."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import FakeRunner, LiveServer, sse_events, validate

from hkserve.api.app import create_app

SCRIPT_TEXT = "Hello world! The quick brown fox 🌍 jumps over the lazy dog."
MODEL = "fake-model"


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[2]


@pytest.fixture
def serve(tokenizer):
    servers = []

    def start(runner=None, **kw):
        runner = runner or FakeRunner(tokenizer.encode(SCRIPT_TEXT) + [tokenizer.eos_id])
        server = LiveServer(create_app(runner, tokenizer, MODEL, 256, **kw))
        servers.append(server)
        return server, runner

    yield start
    for s in servers:
        s.stop()


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def test_completion_and_chat_bodies_validate_and_end_at_eos(serve):
    server, _ = serve()
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 100})
    assert r.status_code == 200
    validate(r.json(), "CreateCompletionResponse")
    choice = r.json()["choices"][0]
    assert choice["text"] == SCRIPT_TEXT and choice["finish_reason"] == "stop"
    r = post(
        server,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    validate(r.json(), "CreateChatCompletionResponse")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["role"] == "assistant"
    assert len(choice["logprobs"]["content"]) == 3
    assert all(len(e["top_logprobs"]) == 2 for e in choice["logprobs"]["content"])
    validate(httpx.get(server.url + "/v1/models").json(), "ListModelsResponse")


@pytest.mark.parametrize("stop", [" bro", "k br", "fox 🌍 j", "lazy dog."])
def test_stop_strings_across_token_boundaries_never_leak(serve, stop):
    server, _ = serve()
    expected = SCRIPT_TEXT[: SCRIPT_TEXT.index(stop)]
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 100, "stop": [stop, "zzz"]})
    assert r.json()["choices"][0]["text"] == expected
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=30,
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stop": stop, "stream": True},
    ) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stream_is_utf8_safe_and_usage_comes_last(serve, tokenizer):
    server, _ = serve()
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=30,
        json={
            "prompt": "hi",
            "max_tokens": 100,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logprobs": 1,
        },
    ) as resp:
        events = sse_events(resp)
    chunks = events[:-1]
    for chunk in chunks:
        validate(chunk, "CreateCompletionResponse", streamed=True)
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert all("\ufffd" not in t for t in texts)
    assert "".join(texts) == SCRIPT_TEXT
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": 1,
        "completion_tokens": len(tokenizer.encode(SCRIPT_TEXT)) + 1,
        "total_tokens": 2 + len(tokenizer.encode(SCRIPT_TEXT)),
    }
    assert all("usage" not in c for c in chunks[:-1])  # the completion schema has no null usage


def test_n_choices_prompt_lists_and_echo(serve):
    server, runner = serve()
    r = post(server, "/v1/completions", {"prompt": ["a", "b c"], "n": 2, "max_tokens": 2, "echo": True, "seed": 7})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["choices"][2]["text"].startswith("b c")
    assert sorted(req.sampling.seed for req in runner.submitted) == [7, 8, 9, 10]
    assert body["usage"]["prompt_tokens"] == 1 + 2


ERROR_CASES = [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "n": 0}, 400, "n"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ({"prompt": "x", "logit_bias": {"5": 300}}, 400, "logit_bias"),
    ({"prompt": "x", "top_k": 2**31}, 400, "top_k"),  # past the device's int32
    ({"prompt": "x", "seed": 2**32}, 400, "seed"),
    ({"prompt": "x", "max_tokens": 300}, 400, "max_tokens"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", ERROR_CASES)
def test_invalid_requests_get_openai_errors(serve, body, status, param):
    server, _ = serve()
    r = post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    validate(r.json(), "ErrorResponse")
    if param:
        assert r.json()["error"]["param"] == param


def test_context_length_error_states_both_numbers(serve):
    server, _ = serve()
    r = post(server, "/v1/completions", {"prompt": [5] * 200, "max_tokens": 100})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "256" in message and "200 prompt tokens" in message and "100" in message
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_invalid_json_tools_and_unknown_fields(serve):
    server, _ = serve()
    r = httpx.post(
        server.url + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    validate(r.json(), "ErrorResponse")
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    )
    assert r.status_code == 400 and "tools" in r.json()["error"]["message"]
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "some_vendor_field": 1, "user": "u1"},
    )
    assert r.status_code == 200


def test_full_queue_is_429_with_retry_after(serve, tokenizer):
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT), max_queue=1, held=True)  # the first stays running
    server, _ = serve(runner)
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 20, "stream": True}):
        assert runner.wait_until(lambda: len(runner.running) == 1)
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        runner.go.set()
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    validate(r.json(), "ErrorResponse")


def test_api_key_is_required_when_set(serve):
    server, _ = serve(api_key="sekret")
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 401
    wrong = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    validate(wrong.json(), "ErrorResponse")
    for header in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):  # the scheme is case-insensitive
        ok = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers={"Authorization": header})
        assert ok.status_code == 200, header
    for header in ("Basic sekret", "Bearer sekret2", "Bearer", "sekret", "Bearer SEKRET"):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": header}).status_code == 401, header
    assert httpx.get(server.url + "/health").status_code == 200


def test_not_ready_is_503_until_the_runner_is_ready(serve, tokenizer):
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT), ready=False)
    server, _ = serve(runner)
    assert httpx.get(server.url + "/health").status_code == 503
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert r.status_code == 503
    validate(r.json(), "ErrorResponse")
    runner.ready.set()
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(serve, tokenizer, stream):
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT), delay=0.05)
    server, _ = serve(runner)
    body = {"prompt": "x", "max_tokens": 200, "stream": stream}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.3)
    assert runner.wait_until(lambda: not runner.running)
    assert len(runner.cancelled) == 1


def test_tokenize_and_detokenize_round_trip(serve, tokenizer):
    server, _ = serve()
    r = post(server, "/tokenize", {"prompt": SCRIPT_TEXT})
    assert r.json()["tokens"] == tokenizer.encode(SCRIPT_TEXT) and r.json()["count"] == len(r.json()["tokens"])
    assert post(server, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"] == SCRIPT_TEXT
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert chat == tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400


def test_metrics_expose_latencies_gauges_and_counters(serve):
    server, _ = serve()
    post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3})
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "hkserve_time_to_first_token_seconds_count 1.0",
        "hkserve_inter_token_latency_seconds_count 2.0",
        "hkserve_e2e_request_latency_seconds_count 1.0",
        "hkserve_queue_time_seconds_count 1.0",
        "hkserve_requests_running 0.0",
        "hkserve_requests_waiting 0.0",
        "hkserve_slots_total 4.0",
        "hkserve_kv_blocks_total 0.0",  # the static layout: no pool
        "hkserve_prompt_tokens_total 1.0",
        "hkserve_generation_tokens_total 3.0",
        'hkserve_requests_total{finish_reason="length"} 1.0',
    ):
        assert name in text, name


def test_ignore_eos_generates_max_tokens(serve):
    server, runner = serve()
    r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 40, "ignore_eos": True})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 40
    assert runner.submitted[-1].stop_ids == ()
