"""Fuzzing the API with request bodies generated from OpenAI's own request schemas
(../shared/fixtures/openai/openapi-subset.json: CreateCompletionRequest, CreateChatCompletionRequest),
and for /v1/responses and /v1/messages from the strategies below (their fields as the APIs document
them, with wrong kinds mixed in), plus hostile mutations (issue 15): no 5xx, every error an OpenAI
error body (Anthropic's on /v1/messages, checked by the anthropic SDK's own type), and the server
still answers a golden request afterwards. Fast against a fake runner; a short run against SmolLM2."""

from __future__ import annotations

import json

import anthropic.types as A
import httpx
import pytest
from helpers import FIXTURES
from http_helpers import FakeRunner, LiveServer, validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from sdk_types import strict, strict_message_event, strict_response_event

from hkserve.api.app import create_app
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model

SPEC = FIXTURES / "openai" / "openapi-subset.json"
SCHEMAS = {"/v1/completions": "CreateCompletionRequest", "/v1/chat/completions": "CreateChatCompletionRequest"}
SCRIPT_TEXT = "Hello world! The quick brown fox jumps over the lazy dog."
# Fields of the schemas that are generated: what this server reads, and a few it must refuse. (The
# rest, e.g. tools' JSON schemas, cost hypothesis-jsonschema seconds per example and reach nothing.)
FIELDS = {
    *("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stop", "temperature", "top_p"),
    *("seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "suffix"),
    *("stream", "stream_options", "user", "best_of"),
}
MESSAGE_FIELDS = ("role", "content", "name")
NOT_SCHEMA = {"description", "example", "examples", "default", "discriminator", "deprecated", "title"}

HOSTILE_VALUES = [
    "2147483648",
    "-1",
    "0",
    "4",
    "1e400",
    "NaN",
    "Infinity",
    "-Infinity",
    "1" * 5000,
    "9" * 400,
    "[" * 1000 + "]" * 1000,
    '"\\udc00"',
    '"a\\ud800b"',
    "[true, false]",
    "[[1, 2], [true]]",
    "[1, 49152]",
    "[-1]",
    "true",
    "null",
    "{}",
    "[]",
    "[[]]",
    '""',
    '"' + "a" * 5000 + '"',
    '{"\u00b2": 1}',
    '{"49152": 1}',
    '{"-1": 1}',
    '{"' + "7" * 400 + '": 1}',
    '{"5": 1e400}',
    '[{"role": "user", "content": "\\udc00"}]',
    '[{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]',
    '[{"role": "user", "content": ' + "[" * 50 + "]" * 50 + "}]",
]
HOSTILE_FIELDS = [
    *("prompt", "messages", "max_tokens", "n", "top_k", "top_p", "temperature", "seed", "logit_bias", "stop"),
    *("logprobs", "top_logprobs", "repetition_penalty", "min_p", "presence_penalty", "model", "stream", "echo"),
    *("stream_options", "max_completion_tokens", "\udc00", "prompt" * 1000),
    *("chat_template_kwargs", "best_of"),
]
KNOWN_MUTATIONS = [  # issue 15's findings, each on an otherwise valid body
    ("top_k", "2147483648"),
    ("seed", "4294967296"),
    ("logit_bias", '{"49152": 1}'),
    ("logit_bias", '{"-1": 1}'),
    ("logit_bias", '{"' + "7" * 400 + '": 1}'),
    ("logit_bias", '{"\u00b2": 1}'),
    ("prompt", '"\udc00"'),
    ("prompt", "[true, false]"),
    ("prompt", "[[5, 49152]]"),
    ("messages", '[{"role": "user", "content": "\udc00"}]'),
    ("messages", '[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]'),
    ("extra", "[" * 1000 + "]" * 1000),
    ("max_tokens", "1" * 5000),
    ("repetition_penalty", "Infinity"),
    ("temperature", "NaN"),
    ("n", "16"),
    ("stream", "true"),
]
MINIMAL = {
    "/v1/completions": {"prompt": "Hi", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
}
TOKEN_LIMIT = {"/v1/responses": "max_output_tokens"}  # each route's max_tokens field (else max_tokens)
TEXT = st.text(max_size=12)
FUNCTION_SCHEMA = st.sampled_from([{"type": "object"}, {"type": "object", "properties": {"a": {"type": "integer"}}}])
BROKEN_BODIES = [b"", b"{", b"[]", b"null", b'"x"', b"\xff\xfe", b'{"prompt": "x"}' + b" " * 10, b"{" * 100_000]


def _resolve(node, schemas: dict, depth: int = 0):
    """The schema with $refs inlined, OpenAPI's `nullable` as anyOf null, object allOfs merged and oneOf
    as anyOf (generation only needs valid members, not exactly one)."""
    if isinstance(node, list):
        return [_resolve(v, schemas, depth) for v in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return _resolve(schemas[node["$ref"].rsplit("/", 1)[-1]], schemas, depth + 1) if depth < 12 else {}
    out = {k: _resolve(v, schemas, depth) for k, v in node.items() if k not in NOT_SCHEMA and not k.startswith("x-")}
    if "allOf" in out and all(part.get("type") == "object" for part in out["allOf"]):
        parts = out.pop("allOf")
        out["type"] = "object"
        out["properties"] = {k: v for part in parts for k, v in part.get("properties", {}).items()}
        out["required"] = sorted({r for part in parts for r in part.get("required", [])})
    if "oneOf" in out:
        out["anyOf"] = out.pop("oneOf")
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out


def _fields(schema: dict, keep) -> st.SearchStrategy:
    props = {k: from_schema(v) for k, v in schema["properties"].items() if k in keep}
    required = set(schema.get("required", ()))
    optional = {k: v for k, v in props.items() if k not in required}
    return st.fixed_dictionaries({k: v for k, v in props.items() if k in required}, optional=optional)


def request_bodies() -> dict[str, st.SearchStrategy]:
    """Per route, request bodies valid under OpenAI's schema (messages drawn per message kind)."""
    assert SPEC.is_file(), f"the OpenAI schema fixture is missing: {SPEC} (set HKSERVE_SHARED)"
    schemas = json.loads(SPEC.read_text())["components"]["schemas"]
    out = {}
    for path, name in SCHEMAS.items():
        schema = _resolve(schemas[name], schemas)
        bodies = _fields(schema, FIELDS - {"messages"})
        if "messages" in schema["properties"]:
            kinds = schema["properties"]["messages"]["items"]["anyOf"]
            messages = st.lists(st.one_of([_fields(kind, MESSAGE_FIELDS) for kind in kinds]), min_size=1, max_size=3)
            bodies = st.builds(lambda body, m: {**body, "messages": m}, bodies, messages)
        out[path] = bodies
    out["/v1/responses"] = responses_bodies()
    out["/v1/messages"] = messages_bodies()
    return out


def responses_bodies() -> st.SearchStrategy:
    """POST /v1/responses bodies: input items and the fields the Responses API documents."""
    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": TEXT})
    item = st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "developer", "assistant", "tool"])},
            optional={"type": st.just("message"), "content": st.one_of(TEXT, st.lists(part, max_size=2))},
        ),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": TEXT, "arguments": TEXT}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}),
    )
    tool = st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"]), "name": st.sampled_from(["f", "g", "", "a b"])},
        optional={"parameters": FUNCTION_SCHEMA, "description": TEXT, "strict": st.booleans()},
    )
    fmt = st.sampled_from(
        [{"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {"type": "object"}}]
        + [{"type": "json_schema"}, {"type": "xml"}]
    )
    optional = {
        "model": st.just("m"),  # valid values: a field's error stops a request before the rest is read
        "instructions": TEXT,
        "max_output_tokens": st.integers(1, 40),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.one_of(
            st.sampled_from(["none", "auto", "required", "bogus"]),
            st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "h"])}),
        ),
        "parallel_tool_calls": st.booleans(),
        "text": st.fixed_dictionaries({"format": fmt}),
        "store": st.booleans(),
        "metadata": st.dictionaries(TEXT, TEXT, max_size=2),
        "stream": st.booleans(),
    }
    return st.fixed_dictionaries({"input": st.one_of(TEXT, st.lists(item, max_size=3))}, optional=optional)


def messages_bodies() -> st.SearchStrategy:
    """POST /v1/messages bodies: text, tool_use and tool_result blocks and the fields Anthropic documents."""
    block = st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image"]), "text": TEXT}),
        st.fixed_dictionaries(
            {"type": st.just("tool_use"), "id": TEXT, "name": TEXT, "input": st.one_of(st.just({}), TEXT)}
        ),
        st.fixed_dictionaries(
            {"type": st.just("tool_result"), "tool_use_id": TEXT},
            optional={
                "content": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}))),
                "is_error": st.booleans(),
            },
        ),
    )
    message = st.fixed_dictionaries(
        {
            "role": st.sampled_from(["user", "assistant", "system"]),
            "content": st.one_of(TEXT, st.lists(block, max_size=3)),
        }
    )
    tool = st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "g", ""])}, optional={"input_schema": FUNCTION_SCHEMA, "description": TEXT}
    )
    optional = {
        "model": st.just("m"),
        "system": st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2)),
        "stop_sequences": st.lists(TEXT, max_size=3),
        "temperature": st.floats(0, 1),
        "top_p": st.floats(0.01, 1),
        "top_k": st.integers(1, 100),
        "tools": st.lists(tool, max_size=2),
        "tool_choice": st.one_of(
            st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "none", "bogus"])}),
            st.fixed_dictionaries({"type": st.just("tool"), "name": st.sampled_from(["f", "h"])}),
        ),
        "stream": st.booleans(),
    }
    required = {"messages": st.lists(message, max_size=3), "max_tokens": st.integers(1, 40)}
    return st.fixed_dictionaries(required, optional=optional)


def _splice(body: dict, field: str, raw: str) -> bytes:
    """The body with `field` set to a raw JSON text (which json.dumps could not write, e.g. 1,000 deep)."""
    rest = json.dumps({k: v for k, v in body.items() if k != field})
    key = json.dumps(field)
    return ("{" + key + ": " + raw + (", " + rest[1:] if rest != "{}" else "}")).encode("utf-8", "surrogatepass")


@st.composite
def requests(draw, bodies: dict[str, st.SearchStrategy], tame: bool = False):
    """(path, raw body): a schema-valid body, maybe without its (probably unknown) model, maybe mutated."""
    path = draw(st.sampled_from(sorted(bodies)))
    body = draw(bodies[path])
    if draw(st.booleans()):
        body.pop("model", None)
    if tame:  # the real engine: a few short choices per request
        for field, most in (("n", 2), ("max_tokens", 8), ("max_completion_tokens", 8), ("max_output_tokens", 8)):
            if isinstance(body.get(field), int) and body[field] > most:
                body[field] = most
        body.setdefault(TOKEN_LIMIT.get(path, "max_tokens"), 8)
    mutation = draw(st.sampled_from(["none", "known", "known", "field", "broken"]))
    if mutation == "known":
        field, raw = draw(st.sampled_from(KNOWN_MUTATIONS))
        return path, _splice(MINIMAL[path], field, raw)
    if mutation == "field":
        return path, _splice(body, draw(st.sampled_from(HOSTILE_FIELDS)), draw(st.sampled_from(HOSTILE_VALUES)))
    if mutation == "broken":
        return path, draw(st.sampled_from(BROKEN_BODIES))
    return path, json.dumps(body).encode()


def check(response: httpx.Response, path: str) -> None:
    """No 5xx; every error an OpenAI error body (Anthropic's on /v1/messages), in a stream too; every
    event of the typed streams (/v1/responses, /v1/messages) one of the SDK's."""
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        if path == "/v1/messages":
            strict(A.ErrorResponse, response.json())
        else:
            validate(response.json(), "ErrorResponse")
    elif response.headers["content-type"].startswith("text/event-stream"):
        typed = {"/v1/responses": strict_response_event, "/v1/messages": strict_message_event}.get(path)
        for line in response.text.splitlines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: ") :])
            if typed is not None:
                typed(event)
                assert event["type"] != "error", event
            elif "error" in event:
                validate(event, "ErrorResponse")
                assert event["error"]["type"] != "server_error", event


def fuzz(server: LiveServer, bodies, examples: int, tame: bool = False) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as client:

        @settings(
            max_examples=examples,
            derandomize=True,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(requests(bodies, tame))
        def one(request):
            path, raw = request
            check(client.post(path, content=raw, headers={"content-type": "application/json"}), path)

        one()


@pytest.fixture(scope="module")
def bodies():
    return request_bodies()


def test_fuzzed_requests_against_a_fake_runner(smollm2, bodies):
    tokenizer = smollm2[2]
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT) + [tokenizer.eos_id])
    server = LiveServer(create_app(runner, tokenizer, "m", 256))
    try:
        fuzz(server, bodies, examples=300)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 100}, timeout=30)
        assert r.json()["choices"][0]["text"] == SCRIPT_TEXT
    finally:
        server.stop()


def test_fuzzed_responses_and_messages_requests_against_a_fake_runner(smollm2, bodies):
    """The two newest routes alone (in the mixed run above they get a quarter of the examples)."""
    tokenizer = smollm2[2]
    runner = FakeRunner(tokenizer.encode(SCRIPT_TEXT) + [tokenizer.eos_id])
    server = LiveServer(create_app(runner, tokenizer, "m", 256))
    try:
        fuzz(server, {p: bodies[p] for p in ("/v1/responses", "/v1/messages")}, examples=200)
        r = httpx.post(server.url + "/v1/messages", json={**MINIMAL["/v1/messages"], "max_tokens": 100}, timeout=30)
        assert r.json()["content"][0]["text"] == SCRIPT_TEXT
    finally:
        server.stop()


def test_fuzzed_requests_against_smollm2_then_a_golden_chat(smollm2, bodies, golden):
    _, info, tokenizer, params = smollm2
    engine = Engine(
        build_model(info.config), params, EngineOptions(slots=4, max_len=128, prefill_buckets=(16, 64), n_top=5)
    )
    runner = InferenceRunner(engine, max_queue=32).start(warmup=False)
    server = LiveServer(create_app(runner, tokenizer, "smollm2", engine.max_len))
    try:
        fuzz(server, bodies, examples=25, tame=True)
        case = next(c for c in golden["cases"] if "messages" in c)
        body = {"messages": case["messages"], "temperature": 0, "max_tokens": 32}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.json()["choices"][0]["message"]["content"] == case["text"]
        assert runner.stats().running == 0 and runner.stats().waiting == 0
    finally:
        server.stop()
        runner.stop()
