"""Structured outputs and tool calls on the real SmolLM2 behind the live server, through the official
openai client: parsed pydantic models, schema-valid samples at temperature 1, enforced tool calls whose
stream reassembles to the whole call, bit-identical unconstrained neighbours, 400s for bad grammars."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import Enum
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from http_helpers import LiveServer, smollm2_server, validate
from pydantic import BaseModel, Field

from hkserve.api.app import create_app

NAME = "smollm2-135m-instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _serve(smollm2, slots: int, max_len: int):
    """The server and an openai client, with the runner and tokenizer kept for apps of other settings."""
    with smollm2_server(smollm2, NAME, slots=slots, max_queue=256, max_len=max_len) as (server, runner):
        server.runner, server.tokenizer = runner, smollm2[2]
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=900)


@pytest.fixture(scope="module")
def live(smollm2):
    """test_api_live's engine (8 slots of 512 tokens): the run's compile cache serves its programs, and no
    test here runs more than 8 requests at once, so a step decodes no idle rows (16 slots of 640, before)."""
    yield from _serve(smollm2, slots=8, max_len=512)


@pytest.fixture(scope="module")
def wide(smollm2):
    """16 slots of 640 tokens: the slow test's 80 samples of up to 480 tokens."""
    yield from _serve(smollm2, slots=16, max_len=640)


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):  # nested objects
    name: str = Field(max_length=20)
    address: Address


class Tags(BaseModel):  # an array with min/max items
    tags: list[str] = Field(min_length=1, max_length=3)


class Sky(str, Enum):
    sunny = "sunny"
    rainy = "rainy"
    cloudy = "cloudy"


class Weather(BaseModel):  # enums
    sky: Sky
    wind: Literal["calm", "windy"]


class Rating(BaseModel):  # integers and numbers with bounds
    stars: int = Field(ge=1, le=5)
    confidence: float = Field(ge=0, le=1)


class Contact(BaseModel):  # optional fields
    name: str = Field(max_length=20)
    email: str | None = None
    age: int | None = Field(default=None, ge=0, le=130)


class Ticket(BaseModel):  # a string pattern
    code: str = Field(pattern=r"^[A-Z]{3}-[0-9]{3}$")


MODELS = [Person, Tags, Weather, Rating, Contact, Ticket]


def test_parse_returns_instances_of_six_pydantic_models(live):
    _, client = live

    def parse(model):
        messages = [{"role": "user", "content": f"Give an example {model.__name__} as JSON."}]
        return client.chat.completions.parse(
            model=NAME, messages=messages, response_format=model, temperature=0, max_tokens=120
        )

    with ThreadPoolExecutor(len(MODELS)) as pool:
        replies = list(pool.map(parse, MODELS))
    for model, reply in zip(MODELS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (model.__name__, choice.message.content)
        assert isinstance(choice.message.parsed, model), model.__name__


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_hundred_json_object_and_hundred_schema_samples_all_validate(wide):
    """200 samples at temperature 1.0 (10 requests x n=10 per kind, random seeds): all parse, all valid."""
    server, _ = wide
    person = [{"role": "user", "content": "Describe a person (name, age, pets) as a JSON object."}]
    bodies = [
        {"response_format": {"type": "json_object"}, "seed": seed}
        for seed in range(1000, 1100, 10)  # choice i samples with seed + i: 100 distinct seeds
    ] + [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}, "seed": seed}
        for seed in range(2000, 2100, 10)
    ]

    def post(body):  # room to finish: at temperature 1 a free-form string can run for a hundred tokens
        body = {**body, "messages": person, "temperature": 1.0, "n": 10, "max_tokens": 480}
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1200)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(post, bodies))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200][:1]
    bad, lengths, cut = [], [], 0
    for body, r in zip(bodies, replies):
        for choice in r.json()["choices"]:
            content = choice["message"]["content"]
            lengths.append(len(content))
            try:
                value = json.loads(content)
                if body["response_format"]["type"] == "json_object":  # closed in time if cut (json_budget.py)
                    assert isinstance(value, dict) and choice["finish_reason"] in ("stop", "length")
                    cut += choice["finish_reason"] == "length"
                else:
                    jsonschema.validate(value, SCHEMA)
                    assert choice["finish_reason"] == "stop"
            except (ValueError, AssertionError, jsonschema.ValidationError) as e:
                bad.append((body["seed"], choice["index"], choice["finish_reason"], content[-80:], str(e)[:80]))
    median = sorted(lengths)[len(lengths) // 2]
    print(f"\n{len(lengths)} samples, content length max {max(lengths)} median {median}, {cut} closed by the budget")
    assert len(lengths) == 200 and bad == []


def _call(client, tool_choice, seed, stream=False):
    return client.chat.completions.create(
        model=NAME,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,  # one call: short enough to finish inside max_tokens
        temperature=1.0,
        seed=seed,
        max_tokens=64,
        stream=stream,
    )


NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.timeout(1800)
def test_enforced_tool_calls_validate_and_stream_reassembles(live):
    """ "required" and a named function, whole and streamed, 2 seeds each: all in one batch."""
    _, client = live
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    cases = [(choice, seed) for choice in ("required", NAMED) for seed in range(2)]
    with ThreadPoolExecutor(2 * len(cases)) as pool:
        whole = pool.map(lambda c: _call(client, *c), cases)
        streamed = pool.map(lambda c: list(_call(client, *c, stream=True)), cases)
        whole, streamed = list(whole), list(streamed)
    for (tool_choice, _), reply, chunks in zip(cases, whole, streamed):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        validate(reply.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
        for call in choice.message.tool_calls:
            if tool_choice == NAMED:
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        # the stream's pieces, reassembled: id, type and name first, then argument fragments
        calls: dict[int, dict] = {}
        for chunk in chunks:
            for piece in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                if piece.id is not None:
                    assert piece.index not in calls and piece.function.name
                    calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
                calls[piece.index]["arguments"] += piece.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls
        ]
    # the conversation goes on with the call and its result
    call = whole[0].choices[0].message.tool_calls[0]
    follow = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    reply = client.chat.completions.create(
        model=NAME, messages=follow, tools=[WEATHER, TIME], temperature=0, max_tokens=24
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


def _tokens(server, body) -> list[str]:
    body = {**body, "max_tokens": 12, "logprobs": True, "model": NAME}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]]


def test_unconstrained_tokens_are_the_same_beside_constrained_neighbours(live):
    server, _ = live
    plain = [
        {"messages": [{"role": "user", "content": "Name three rivers."}], "temperature": 0},
        {"messages": [{"role": "user", "content": "Write a haiku."}], "temperature": 1.0, "seed": 7},
    ]
    with ThreadPoolExecutor(2) as pool:
        alone = list(pool.map(lambda b: _tokens(server, b), plain))
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    neighbours = [
        {
            "messages": [{"role": "user", "content": "A person as JSON."}],
            "response_format": fmt,
            "temperature": 1.0,
            "seed": s,
        }
        for s in range(4)
    ]
    with ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda b: _tokens(server, b), neighbours + plain))
    assert mixed[len(neighbours) :] == alone


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "[a-"}}, "response_format"),
        ({"structured_outputs": {"grammar": "start: missing_rule"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
def test_bad_grammars_and_tools_are_400s_with_openai_bodies(live, body, param):
    server, _ = live
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    validate(r.json(), "ErrorResponse")
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize("fmt", ["llama3_json", "mistral", "qwen3_coder"])
def test_each_format_s_enforced_call_is_read_back_whole_and_streamed(live, fmt):
    """The grammar makes SmolLM2 write the call in the format's own syntax, which its parser reads
    back: a call that validates, the same whole and streamed (same seed)."""
    server, _ = live
    app = create_app(server.runner, server.tokenizer, NAME, server.runner.engine.max_len, tool_call_parser=fmt)
    other = LiveServer(app)
    try:
        client = openai.OpenAI(base_url=other.url + "/v1", api_key="unused", max_retries=0, timeout=900)
        reply, chunks = _call(client, NAMED, 0), list(_call(client, NAMED, 0, stream=True))
    finally:
        other.stop()
    choice = reply.choices[0]
    validate(reply.model_dump(exclude_unset=True), "CreateChatCompletionResponse")
    assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), TIME["function"]["parameters"])
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in pieces] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
