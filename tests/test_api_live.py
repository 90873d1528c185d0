"""The real server (SmolLM2 on the engine, live uvicorn on 127.0.0.1) driven by the official openai client."""

from __future__ import annotations

import random
import threading
import time

import httpx
import openai
import pytest
from http_helpers import smollm2_server, sse_events, validate

NAME = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def live(smollm2):
    with smollm2_server(smollm2, NAME, slots=8, max_queue=128) as (server, runner):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield server, client, smollm2[2], runner


def test_golden_chat_case_at_temperature_zero_equals_reference(live, golden):
    _, client, _, _ = live
    case = next(c for c in golden["cases"] if "messages" in c)
    reply = client.chat.completions.create(model=NAME, messages=case["messages"], temperature=0, max_tokens=32)
    assert reply.choices[0].message.content == case["text"]
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(case["prompt_ids"])
    assert reply.usage.completion_tokens == len(case["greedy_ids"])
    validate(reply.model_dump(exclude_unset=True), "CreateChatCompletionResponse")


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_deltas_concatenate_to_the_non_stream_text_for_the_same_seed(live, kind):
    _, client, _, _ = live
    common = dict(model=NAME, temperature=0.9, top_p=0.95, seed=1234, max_tokens=24)
    if kind == "completion":
        whole = client.completions.create(prompt="Once upon a time", **common).choices[0].text
        chunks = list(client.completions.create(prompt="Once upon a time", stream=True, **common))
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    else:
        messages = [{"role": "user", "content": "Tell me about cats."}]
        whole = client.chat.completions.create(messages=messages, **common).choices[0].message.content
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **common))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and len(whole) > 20


def test_usage_counts_match_the_tokenizer_and_finish_reasons(live):
    server, client, tokenizer, _ = live
    prompt = "The capital of France is"
    reply = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=5, logprobs=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["count"]
    assert reply.usage.completion_tokens == 5 == len(choice.logprobs.tokens)
    assert tokenizer.encode(choice.text) == tokenizer.encode("".join(choice.logprobs.tokens))
    validate(reply.model_dump(exclude_unset=True), "CreateCompletionResponse")
    stopped = client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=64)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens < 64


def test_stop_string_spanning_tokens_ends_the_text_without_appearing(live):
    _, client, _, _ = live
    # greedy text is " Paris.\n\nThe answer is: ..." where "\n\nThe" spans three tokens
    for stream in (False, True):
        args = dict(model=NAME, prompt="The capital of France is", temperature=0, max_tokens=32, stop=["\n\nThe"])
        if stream:
            chunks = list(client.completions.create(stream=True, **args))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = client.completions.create(**args).choices[0]
            text, reason = choice.text, choice.finish_reason
        assert (text, reason) == (" Paris.", "stop")


def test_logit_bias_bans_the_greedy_token_and_forces_another(live):
    _, client, tokenizer, _ = live
    (paris,) = tokenizer.encode(" Paris", add_bos=False)
    (london,) = tokenizer.encode(" London", add_bos=False)
    args = dict(model=NAME, prompt="The capital of France is", max_tokens=3, logprobs=1)
    greedy = client.completions.create(temperature=0, **args).choices[0]
    assert greedy.logprobs.tokens[0] == " Paris"
    banned = client.completions.create(temperature=0, logit_bias={str(paris): -100}, **args).choices[0]
    assert " Paris" not in banned.logprobs.tokens
    # logprobs are the model's own: the draw under the ban took a less likely first token
    assert banned.logprobs.token_logprobs[0] < greedy.logprobs.token_logprobs[0]
    forced = client.completions.create(temperature=1.0, seed=3, logit_bias={str(london): 100}, **args).choices[0]
    assert forced.text == " London" * 3


def test_every_stream_chunk_models_and_errors_validate(live):
    server, _, _, _ = live
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=60,
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 12,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 3,
            "n": 2,
            "stream_options": {"include_usage": True},
        },
    ) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        validate(chunk, "CreateChatCompletionStreamResponse")
    assert events[-2]["usage"]["completion_tokens"] > 0 and events[-2]["choices"] == []
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        timeout=60,
        json={"model": NAME, "prompt": "Hi", "max_tokens": 8, "stream": True, "logprobs": 2},
    ) as resp:
        for chunk in sse_events(resp)[:-1]:
            validate(chunk, "CreateCompletionResponse", streamed=True)
    validate(httpx.get(server.url + "/v1/models").json(), "ListModelsResponse")
    r = httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 600})
    assert r.status_code == 400 and "512" in r.json()["error"]["message"]
    validate(r.json(), "ErrorResponse")


def _stream_text(url: str, messages, max_tokens: int, disconnect_after: int | None = None) -> str:
    body = {"model": NAME, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": True}
    text = ""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        for i, line in enumerate(resp.iter_lines()):
            if disconnect_after is not None and i >= disconnect_after:
                return text  # leaving the block closes the connection mid-stream
            if line.startswith("data: {"):
                chunk = __import__("json").loads(line[6:])
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
    return text


def _golden_messages(case):
    return case.get("messages") or [{"role": "user", "content": case["prompt"]}]


def test_16_concurrent_streams_and_50_random_disconnects_leave_the_server_correct(live, golden):
    server, client, _, runner = live
    case = next(c for c in golden["cases"] if "messages" in c)
    results: dict[int, str] = {}

    def run(i: int):
        results[i] = _stream_text(server.url, case["messages"], 32)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert [results[i] for i in range(16)] == [case["text"]] * 16

    rng = random.Random(3)
    threads = [
        threading.Thread(
            target=_stream_text,
            args=(server.url, [{"role": "user", "content": f"Story {i}"}], 64, rng.randrange(1, 12)),
        )
        for i in range(50)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    deadline = time.time() + 120  # the loop frees cancelled slots within a step or two; slack for a loaded machine
    while time.time() < deadline and runner.stats().running:
        time.sleep(0.05)
    metrics = httpx.get(server.url + "/metrics").text
    assert "hkserve_requests_running 0.0" in metrics and "hkserve_requests_waiting 0.0" in metrics
    reply = client.chat.completions.create(model=NAME, messages=case["messages"], temperature=0, max_tokens=32)
    assert reply.choices[0].message.content == case["text"]
