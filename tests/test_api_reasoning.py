"""Reasoning content, the tool-call formats and the refused fields over HTTP, against the fake runner
replaying a family's output through SmolLM2's tokenizer; bodies and chunks checked against OpenAI's
published schemas."""

from __future__ import annotations

import httpx
import pytest
from http_helpers import FakeRunner, LiveServer, sse_events, validate

from hkserve.api.app import create_app
from hkserve.checkpoint.tokenizer import Tokenizer

R1_OUTPUT = "Okay, 2 + 2 is 4.\n</think>\n\nIt is 4."
MISTRAL_OUTPUT = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
QWEN3_LIKE = (
    "{% for i in range(messages | length) %}{% set m = messages[i] %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
    "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[2]


@pytest.fixture
def serve(tokenizer, request):
    def start(output: str, tok: Tokenizer | None = None, **kw):
        """A server whose fake model writes `output` (then EOS); stopped when the test ends."""
        tok = tok or tokenizer
        runner = FakeRunner(tok.encode(output, add_bos=False) + [tok.eos_id])
        server = LiveServer(create_app(runner, tok, "m", 512, **kw))
        request.addfinalizer(server.stop)
        return server, runner

    return start


def chat(server, stream: bool = False, **body):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, **body}
    if not stream:
        return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    for chunk in events[:-1]:
        validate(chunk, "CreateChatCompletionStreamResponse")
    return events[:-1]


def test_reasoning_content_is_split_whole_and_streamed_and_counted(serve, tokenizer):
    server, _ = serve(R1_OUTPUT, reasoning_parser="deepseek_r1")
    r = chat(server)
    assert r.status_code == 200
    validate(r.json(), "CreateChatCompletionResponse")
    message, usage = r.json()["choices"][0]["message"], r.json()["usage"]
    assert (message["reasoning_content"], message["content"]) == ("Okay, 2 + 2 is 4.\n", "It is 4.")
    reasoning_tokens = len(tokenizer.encode("Okay, 2 + 2 is 4.\n</think>", add_bos=False))
    assert usage["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}
    chunks = chat(server, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, reverse=True)  # every reasoning delta comes before any content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": reasoning_tokens}


def test_without_a_reasoning_parser_the_think_text_stays_content(serve):
    server, _ = serve(R1_OUTPUT, reasoning_parser="none")
    message = chat(server).json()["choices"][0]["message"]
    assert message["content"] == R1_OUTPUT and "reasoning_content" not in message


@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_call_comes_back_as_tool_calls(serve, stream):
    server, _ = serve(MISTRAL_OUTPUT, tool_call_parser="mistral")
    if not stream:
        r = chat(server, tools=[WEATHER])
        validate(r.json(), "CreateChatCompletionResponse")
        choice = r.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]]
        assert choice["message"]["content"] is None
    else:
        chunks = chat(server, stream=True, tools=[WEATHER])
        choice = next(c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
        pieces = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls", [])]
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in pieces]
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert choice["finish_reason"] == "tool_calls"


def test_auto_detection_on_smollm2_finds_no_reasoning_and_hermes_calls(serve, tokenizer):
    server, _ = serve("x")
    context = server.server.config.app.state.context
    assert (context.reasoning_parser, context.tool_format) == (None, "hermes")
    assert tokenizer.has_token("<|im_start|>") and not tokenizer.has_token("<think>")


def test_chat_template_kwargs_reach_the_template(serve, tokenizer):
    tok = Tokenizer("hf", tokenizer.backend, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, chat_template=QWEN3_LIKE)
    server, runner = serve("Hello.", tok)
    assert server.server.config.app.state.context.reasoning_parser == "qwen3"  # the template closes </think>
    assert chat(server, chat_template_kwargs={"enable_thinking": False}).status_code == 200
    assert chat(server).status_code == 200
    off, on = (tok.decode(r.prompt_ids) for r in runner.submitted)
    assert off.endswith("assistant\n<think>\n\n</think>\n\n") and on.endswith("assistant\n")
    for bad in ({"messages": []}, {"range": 3}):  # the template's own variable; a global it calls
        r = chat(server, chat_template_kwargs=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "min_tokens": 5}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "use_beam_search": True}, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["audio"]}, None),
    ],
)
def test_fields_that_would_be_ignored_are_refused(serve, path, body, param):
    server, _ = serve("x")
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400
    validate(r.json(), "ErrorResponse")
    field = param or next(k for k in body if k not in ("prompt", "messages"))
    assert field in r.json()["error"]["message"] and r.json()["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 1})
    assert ok.status_code == 200
