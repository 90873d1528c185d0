"""Tool-call markers that are special tokens (Mistral's `[TOOL_CALLS]` and `[ARGS]`, Llama 3.1's
`<|python_tag|>`): a decode skips special tokens, so the detokenizer must keep these for the tool
parser, and the client's text must still never show them. A tiny byte-level `tokenizers` tokenizer
that has them as special tokens, and the fake runner replaying their ids, over chat completions,
/v1/responses and /v1/messages, streamed and whole (tool_choice "auto": the call is the model's own)."""

from __future__ import annotations

import json

import anthropic.types as A
import httpx
import openai.types.responses as R
import pytest
from http_helpers import FakeRunner, LiveServer, sse_events, validate
from sdk_types import strict, strict_message_event, strict_response_event, typed_events
from special_tokenizer import ARGS, END_THINK, PYTHON_TAG, THINK, TOKENIZER, TOOL_CALLS, ids

from hkserve.api.app import create_app
from hkserve.api.reply import Markers
from hkserve.api.tool_parsers import MARKERS, special_tokens
from hkserve.api.tools import parse_tools
from hkserve.engine.constrained import GrammarCompiler
from hkserve.train.vocab import byte_tokenizer

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
PARIS = ("get_weather", {"city": "Paris"})
MARKER_STOPS = ["TOOL", "ARGS]", "<|", "python_tag"]  # in the markers' texts, in no text a client sees
# (parser, the model's output as (special token | text) pieces, the content a client sees, the calls)
OUTPUTS = {
    "mistral list": ("mistral", [TOOL_CALLS, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'], "", [PARIS]),
    "mistral [ARGS]": ("mistral", ["Sure.", TOOL_CALLS, "get_weather", ARGS, '{"city": "Paris"}'], "Sure.", [PARIS]),
    "llama3 after text": (
        "llama3_json",
        ["Let me look.", PYTHON_TAG, '{"name": "get_weather", "parameters": {"city": "Paris"}}'],
        "Let me look.",
        [PARIS],
    ),
    "mistral not a call": ("mistral", ["A", TOOL_CALLS, "B"], "AB", []),  # the marker never reaches a client
}


@pytest.fixture
def serve(request):
    def start(fmt: str, pieces: list[str], reasoning: str = "none") -> LiveServer:
        runner = FakeRunner(ids(pieces) + [TOKENIZER.eos_id])
        app = create_app(runner, TOKENIZER, "m", 4096, tool_call_parser=fmt, reasoning_parser=reasoning)
        server = LiveServer(app)
        request.addfinalizer(server.stop)
        return server

    return start


def test_the_markers_are_special_tokens_a_plain_decode_drops():
    for marker in (TOOL_CALLS, ARGS, PYTHON_TAG):
        assert len(ids([marker])) == 1 and TOKENIZER.decode(ids(["a", marker, "b"])) == "ab"
        assert TOKENIZER.decode(ids(["a", marker, "b"]), keep=frozenset(ids([marker]))) == f"a{marker}b"
    assert TOKENIZER.special_id("a") is None and TOKENIZER.special_id("[NOT_A_TOKEN]") is None
    spm = byte_tokenizer()  # SentencePiece writes control pieces as nothing: a kept one is put in
    text = spm.encode("a", add_bos=False) + [spm.eos_id] + spm.encode("b", add_bos=False)
    assert (spm.decode(text), spm.decode(text, keep=frozenset({spm.eos_id}))) == ("ab", "a</s>b")
    assert (spm.special_id("</s>"), spm.special_id("a"), spm.special_id("<0x61>")) == (spm.eos_id, None, None)
    special = special_tokens(TOKENIZER, "mistral")
    assert special == {TOOL_CALLS: ids([TOOL_CALLS])[0], ARGS: ids([ARGS])[0]}
    assert special_tokens(TOKENIZER, "hermes") == {}  # <tool_call> is no token here
    mistral = Markers.of(TOKENIZER, parse_tools([WEATHER], "auto", True, "mistral", special))
    assert mistral == Markers(frozenset(special.values()), MARKERS["mistral"])
    assert Markers.of(TOKENIZER, parse_tools([WEATHER], "none", True, "mistral", special)) == Markers()  # no tools


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize(
    "pieces",
    [
        [TOOL_CALLS, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'],
        [PYTHON_TAG, '{"name": "get_weather", "parameters": {"city": "Paris"}}'],
    ],
    ids=["mistral", "llama3_json"],
)
def test_the_tool_grammar_lets_the_model_write_a_special_marker_as_its_token(pieces, choice):
    """A special token is never spelled by plain tokens, so a grammar that wrote the marker as text
    would ban the token the model writes it with."""
    fmt = "mistral" if pieces[0] == TOOL_CALLS else "llama3_json"
    tools = parse_tools([WEATHER], choice, True, fmt, special_tokens(TOKENIZER, fmt))
    matcher = GrammarCompiler(TOKENIZER, TOKENIZER.vocab_size).compile(tools.grammar()).matcher()
    for k, token in enumerate(ids(pieces) + [TOKENIZER.eos_id]):
        assert matcher.consume_token(token), (k, matcher.get_error())
    assert matcher.is_stopped()
    if choice == "auto" and fmt == "mistral":  # text first, then the marker's token
        matcher = GrammarCompiler(TOKENIZER, TOKENIZER.vocab_size).compile(tools.grammar()).matcher()
        assert all(matcher.consume_token(t) for t in ids(["Sure.", *pieces]) + [TOKENIZER.eos_id])


def chat(server: LiveServer, stream: bool, stop: list[str] | None = None) -> tuple[str | None, list, str]:
    """(content, calls, finish_reason) of a chat reply, reassembled from the chunks when streamed."""
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 100}
    body["stop"] = stop
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        validate(r.json(), "CreateChatCompletionResponse")
        choice = r.json()["choices"][0]
        calls = choice["message"].get("tool_calls", [])
        named = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        return choice["message"]["content"], named, choice["finish_reason"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
        chunks = sse_events(r)[:-1]
    for chunk in chunks:
        validate(chunk, "CreateChatCompletionStreamResponse")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls: dict[int, list] = {}
    for t in (t for d in deltas for t in d.get("tool_calls", [])):
        calls.setdefault(t["index"], [t["function"].get("name"), ""])[1] += t["function"]["arguments"]
    content = "".join(d.get("content") or "" for d in deltas)
    return content, [(n, json.loads(a)) for n, a in calls.values()], chunks[-1]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("stop", [None, MARKER_STOPS], ids=["no stop", "stops in the markers"])
@pytest.mark.parametrize("case", OUTPUTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_reads_calls_after_special_markers_and_never_shows_them(serve, case, stream, stop):
    """A stop string matches only the text a client sees (engine/textstream.py), never a marker's."""
    fmt, pieces, content, calls = OUTPUTS[case]
    got_content, got_calls, reason = chat(serve(fmt, pieces), stream, stop)
    assert got_calls == calls
    assert (got_content or "") == content
    assert reason == ("tool_calls" if calls else "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_auto_tool_choice_returns_the_models_call_as_a_function_call_item(serve, stream):
    server = serve(*OUTPUTS["mistral [ARGS]"][:2])
    body = {"model": "m", "input": "Weather in Paris?", "tools": [{"type": "function", **WEATHER["function"]}]}
    if stream:
        with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=30) as r:
            events = typed_events(r)
        for event in events:
            strict_response_event(event)
        reply = strict(R.Response, events[-1]["response"])
    else:
        reply = strict(R.Response, httpx.post(server.url + "/v1/responses", json=body, timeout=30).json())
    assert [o.type for o in reply.output] == ["message", "function_call"]
    assert reply.output_text == "Sure." and reply.tool_choice == "auto"
    call = reply.output[1]
    assert (call.name, json.loads(call.arguments)) == PARIS and call.call_id.startswith("call_")


@pytest.mark.parametrize("stop", [None, MARKER_STOPS], ids=["no stop", "stops in the markers"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_auto_tool_choice_returns_the_models_call_as_a_tool_use_block(serve, stream, stop):
    server = serve(*OUTPUTS["llama3 after text"][:2])
    tool = {"name": "get_weather", "input_schema": CITY}
    body = {"model": "m", "max_tokens": 100, "tools": [tool], "tool_choice": {"type": "auto"}}
    if stop:
        body["stop_sequences"] = stop
    body["messages"] = [{"role": "user", "content": "Weather in Paris?"}]
    if not stream:
        reply = strict(A.Message, httpx.post(server.url + "/v1/messages", json=body, timeout=30).json())
        blocks = [(b.type, b.text if b.type == "text" else (b.name, b.input)) for b in reply.content]
        assert blocks == [("text", "Let me look."), ("tool_use", PARIS)] and reply.stop_reason == "tool_use"
        return
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=30) as r:
        events = typed_events(r)
    for event in events:
        strict_message_event(event)
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [s["type"] for s in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(d.get("text", "") for d in deltas) == "Let me look."
    assert json.loads("".join(d.get("partial_json", "") for d in deltas)) == PARIS[1]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"


def test_responses_and_messages_text_never_shows_a_special_marker(serve):
    server = serve(*OUTPUTS["mistral not a call"][:2])
    body = {"model": "m", "input": "Hi", "tools": [{"type": "function", **WEATHER["function"]}]}
    reply = strict(R.Response, httpx.post(server.url + "/v1/responses", json=body, timeout=30).json())
    assert reply.output_text == "AB" and [o.type for o in reply.output] == ["message"]
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}]}
    body["tools"] = [{"name": "get_weather", "input_schema": CITY}]
    message = strict(A.Message, httpx.post(server.url + "/v1/messages", json=body, timeout=30).json())
    assert [(b.type, b.text) for b in message.content] == [("text", "AB")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_special_reasoning_tags_split_the_reasoning_and_never_show(serve, stream):
    """DeepSeek-R1's output starts inside the reasoning (a repeated `<think>` is dropped) and closes it
    with `</think>`, here special tokens; then a Mistral call after its special marker."""
    pieces = [THINK, "Hmm.", END_THINK, "Hi.", TOOL_CALLS, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]']
    server = serve("mistral", pieces, reasoning="deepseek_r1")
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER], "max_tokens": 100}
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        validate(r.json(), "CreateChatCompletionResponse")
        message = r.json()["choices"][0]["message"]
        reasoning, content = message["reasoning_content"], message["content"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    else:
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            deltas = [c["choices"][0]["delta"] for c in sse_events(r)[:-1]]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [
            (t["function"]["name"], json.loads(t["function"]["arguments"]))
            for d in deltas
            for t in d.get("tool_calls", [])
        ]
    assert (reasoning, content, calls) == ("Hmm.", "Hi.", [PARIS])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_in_the_visible_text_still_ends_a_reply_with_markers(serve, stream):
    """The stop check still runs on what a client sees: "B" after a kept marker ends the reply there."""
    content, calls, reason = chat(serve(*OUTPUTS["mistral not a call"][:2]), stream, ["B"])
    assert (content or "", calls, reason) == ("A", [], "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_skip_the_markers_and_a_stop_in_one_never_matches(serve, stream):
    """Completions take no tools: nothing is kept, a marker decodes as nothing, as before markers were kept."""
    server = serve("mistral", ["A", TOOL_CALLS, "B", ARGS, "C"])
    body = {"model": "m", "prompt": "Hi", "max_tokens": 100, "stop": MARKER_STOPS + ["["], "stream": stream}
    if not stream:
        choice = httpx.post(server.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == ("ABC", "stop")
        return
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = sse_events(r)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "ABC"


def test_responses_take_no_stop_strings(serve):
    """/v1/responses has no stop parameter (OpenAI's Responses API has none): refused, never ignored."""
    server = serve(*OUTPUTS["mistral [ARGS]"][:2])
    body = {"model": "m", "input": "Hi", "stop": ["TOOL"], "tools": [{"type": "function", **WEATHER["function"]}]}
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "stop" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_and_usage_count_a_kept_marker_as_its_one_token(serve, stream):
    fmt, pieces = OUTPUTS["mistral [ARGS]"][:2]
    server, tokens = serve(fmt, pieces), ids(pieces)
    body = {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER], "max_tokens": 100, "logprobs": True}
    if not stream:
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).json()
        entries, usage = reply["choices"][0]["logprobs"]["content"], reply["usage"]
    else:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
            chunks = sse_events(r)[:-1]
        entries = [
            e for c in chunks if c["choices"] for e in (c["choices"][0].get("logprobs") or {}).get("content", [])
        ]
        usage = chunks[-1]["usage"]
    assert [bytes(e["bytes"]) for e in entries] == [TOKENIZER.token_bytes(t) for t in tokens]  # EOS shows none
    assert [e["token"] for e in entries if e["token"] in (TOOL_CALLS, ARGS)] == [TOOL_CALLS, ARGS]
    assert usage["completion_tokens"] == len(tokens) + 1  # EOS counted
