"""POST /v1/responses and POST /v1/messages on the real server (SmolLM2, live uvicorn), driven by the
official `openai` and `anthropic` clients unchanged: text (the golden chat reply), a tool call forced
by the constrained path and its result sent back, a JSON schema reply; every body and stream event
validated strictly by the SDKs' own types (tests/sdk_types.py)."""

from __future__ import annotations

import json

import anthropic
import anthropic.types as A
import httpx
import jsonschema
import openai
import openai.types.responses as R
import pytest
from http_helpers import LiveServer, smollm2_server
from sdk_types import strict, strict_message_event, strict_response_event, typed_events

NAME = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}  # anthropic>=2 takes no temperature argument; the API field goes as extra_body
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TEXT_ORDER = [  # a text reply's stream: the event types in order, deltas collapsed
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]
MESSAGE_ORDER = [
    "message_start",
    "ping",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
]


@pytest.fixture(scope="module")
def live(smollm2):
    with smollm2_server(smollm2, NAME, slots=4, max_queue=32) as (server, _):
        yield server


@pytest.fixture(scope="module")
def oai(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def case(golden):
    return next(c for c in golden["cases"] if "messages" in c)


def collapsed(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


def stream_events(server: LiveServer, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return typed_events(r)


# -- /v1/responses ------------------------------------------------------------------------------------
def test_responses_create_gives_the_golden_reply_and_validates_strictly(oai, case):
    raw = oai.responses.with_raw_response.create(
        model=NAME, input=case["messages"], temperature=0, max_output_tokens=32
    )
    reply = strict(R.Response, raw.http_response.json())
    assert reply.output_text == raw.parse().output_text == case["text"]
    assert reply.status == "completed" and reply.output[0].type == "message"
    assert reply.usage.input_tokens == len(case["prompt_ids"])
    assert reply.usage.output_tokens == len(case["greedy_ids"])
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens


def test_responses_stream_events_are_the_typed_sequence_and_validate_strictly(live, oai, case):
    with oai.responses.stream(model=NAME, input=case["messages"], temperature=0, max_output_tokens=32) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == case["text"]
    body = {"model": NAME, "input": case["messages"], "temperature": 0, "max_output_tokens": 32}
    events = stream_events(live, "/v1/responses", body)
    for event in events:
        strict_response_event(event)
    assert collapsed([e["type"] for e in events]) == TEXT_ORDER
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == case["text"]


def test_responses_length_limit_is_an_incomplete_response(live, oai, case):
    reply = oai.responses.create(model=NAME, input=case["messages"], temperature=0, max_output_tokens=3)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 3
    events = stream_events(live, "/v1/responses", {"input": "Hi", "temperature": 0, "max_output_tokens": 3})
    assert events[-1]["type"] == "response.incomplete"
    strict_response_event(events[-1])


def weather_tool() -> dict:
    return {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_SCHEMA,
    }


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_forced_tool_call_then_its_result_by_id_and_by_history(live, oai, choice):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    common = dict(model=NAME, temperature=0, max_output_tokens=48)
    forced = dict(tools=[weather_tool()], tool_choice=choice, parallel_tool_calls=False)  # one call, then the end
    raw = oai.responses.with_raw_response.create(input=question, **forced, **common)
    reply = strict(R.Response, raw.http_response.json())
    calls = [o for o in reply.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and reply.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER_SCHEMA)
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 21}'}
    by_id = oai.responses.create(previous_response_id=reply.id, input=[result], **common)
    call_item = {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather"}
    history = [*question, {**call_item, "arguments": calls[0].arguments}, result]
    by_history = oai.responses.create(input=history, **common)
    assert by_id.output_text and by_id.output_text == by_history.output_text  # the same conversation
    assert by_id.usage.input_tokens == by_history.usage.input_tokens
    events = stream_events(live, "/v1/responses", {"input": question, **forced, **common})
    for event in events:
        strict_response_event(event)
    types = collapsed([e["type"] for e in events])
    assert types == [
        *TEXT_ORDER[:2],
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == calls[0].arguments


def test_responses_json_schema_reply_validates(oai):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}
    raw = oai.responses.with_raw_response.create(
        model=NAME,
        instructions="Answer in JSON.",
        input="Describe a person called Ada who is 36.",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=64,
    )
    reply = strict(R.Response, raw.http_response.json())
    jsonschema.validate(json.loads(reply.output_text), PERSON_SCHEMA)
    assert reply.text.format.type == "json_schema" and reply.instructions == "Answer in JSON."


def test_responses_refuse_what_they_do_not_implement_and_unknown_previous_ids(live):
    for body in (
        {"input": "Hi", "reasoning": {"effort": "low"}},
        {"input": "Hi", "truncation": "auto"},
        {"input": "Hi", "tools": [{"type": "web_search"}]},
        {"input": [{"type": "image_generation_call"}]},
        {"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}},
        {"input": "Hi", "previous_response_id": "resp_unknown"},
    ):
        r = httpx.post(live.url + "/v1/responses", json=body, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- /v1/messages -------------------------------------------------------------------------------------
def test_messages_create_gives_the_golden_reply_and_validates_strictly(claude, case):
    raw = claude.messages.with_raw_response.create(
        model=NAME, messages=case["messages"], max_tokens=32, extra_body=GREEDY
    )
    reply = strict(A.Message, raw.http_response.json())
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == case["text"]
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    assert reply.usage.input_tokens == len(case["prompt_ids"])
    assert reply.usage.output_tokens == len(case["greedy_ids"])


def test_messages_stream_events_are_anthropics_and_validate_strictly(live, claude, case):
    with claude.messages.stream(model=NAME, messages=case["messages"], max_tokens=32, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == case["text"] and final.stop_reason == "end_turn"
    body = {"model": NAME, "messages": case["messages"], "max_tokens": 32, "temperature": 0}
    events = stream_events(live, "/v1/messages", body)
    for event in events:
        strict_message_event(event)
    assert collapsed([e["type"] for e in events]) == MESSAGE_ORDER
    assert events[-2]["usage"]["output_tokens"] == len(case["greedy_ids"])


def test_messages_stop_sequences_end_the_reply_and_are_named(claude, case):
    reply = claude.messages.create(
        model=NAME, messages=case["messages"], max_tokens=32, extra_body=GREEDY, stop_sequences=["classic"]
    )
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "classic"
    assert reply.content[0].text == case["text"].split("classic")[0]
    cut = claude.messages.create(model=NAME, messages=case["messages"], max_tokens=3, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize(
    "choice", [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}]
)
def test_messages_forced_tool_use_then_its_result(live, claude, choice):
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}
    question = {"role": "user", "content": "What is the weather in Paris?"}
    common = dict(model=NAME, max_tokens=48, extra_body=GREEDY)
    raw = claude.messages.with_raw_response.create(messages=[question], tools=[tool], tool_choice=choice, **common)
    reply = strict(A.Message, raw.http_response.json())
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": '{"temperature_c": 21}'}
    turn = [question, {"role": "assistant", "content": reply.content}]  # the SDK's blocks, sent back as they are
    answer = claude.messages.create(messages=[*turn, {"role": "user", "content": [result]}], **common)
    assert answer.stop_reason == "end_turn" and answer.content[0].type == "text" and answer.content[0].text
    body = {"messages": [question], "tools": [tool], "tool_choice": choice, "model": NAME, "max_tokens": 48, **GREEDY}
    events = stream_events(live, "/v1/messages", body)
    for event in events:
        strict_message_event(event)
    assert events[2]["content_block"]["type"] == "tool_use"
    streamed = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta")
    assert json.loads(streamed) == uses[0].input and events[-2]["delta"]["stop_reason"] == "tool_use"
    with claude.messages.stream(messages=[question], tools=[tool], tool_choice=choice, **common) as stream:
        assert stream.get_final_message().content[0].input == uses[0].input


def test_messages_errors_are_anthropic_bodies(live, claude):
    for body in (
        {"messages": [{"role": "user", "content": "Hi"}]},  # no max_tokens
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "metadata": {"user_id": "u"}},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 4},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 1.5},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "model": "claude-x"},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 600},
    ):
        r = httpx.post(live.url + "/v1/messages", json=body, timeout=30)
        assert 400 <= r.status_code < 500, (body, r.text)
        strict(A.ErrorResponse, r.json())
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=0)
    assert e.value.body["type"] == "error"
