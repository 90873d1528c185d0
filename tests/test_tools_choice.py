"""`tool_choice: "none"` with tools, and `parallel_tool_calls: false`, through the HTTP API (issue 38).

"none" is checked against a fake runner whose script is a well-formed call: the prompt must not offer
the tools (neither through a template that renders them nor through the built-in system prompt) and the
reply must keep that text as content, with no `tool_calls`. `parallel_tool_calls: false` is checked by
its grammar (a second call is refused, EOS is the only way on) and end to end on the tiny random model,
whose sampling would write more calls if the grammar let it."""

from __future__ import annotations

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient
from helpers import init_params, tiny_config
from http_helpers import FakeRunner

from hkserve.api.app import create_app
from hkserve.api.tools import parse_tools
from hkserve.checkpoint.tokenizer import Tokenizer
from hkserve.engine.constrained import GrammarCompiler
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.train.vocab import byte_tokenizer

TURNS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
TEMPLATES = {
    "builtin-prompt": TURNS,  # no `tools` variable: the server writes its own tool prompt
    "template-tools": "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}" + TURNS,
}
PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def tokenizer(template: str) -> Tokenizer:
    plain = byte_tokenizer()
    return Tokenizer("sentencepiece", plain.backend, bos_id=plain.bos_id, eos_id=plain.eos_id, chat_template=template)


@pytest.mark.parametrize("template", TEMPLATES, ids=list(TEMPLATES))
def test_tool_choice_none_offers_no_tools_and_returns_no_tool_calls(template):
    tok = tokenizer(TEMPLATES[template])
    assert tok.template_takes_tools == (template == "template-tools")
    runner = FakeRunner(tok.encode(CALL, add_bos=False) + [tok.eos_id])
    client = TestClient(create_app(runner, tok, "fake", 4096))
    replies = {}
    for choice in ("none", "auto"):
        body = {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 200}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        request = runner.submitted[-1]
        replies[choice] = (tok.decode(request.prompt_ids), request.grammar, r.json()["choices"][0])
        stream = client.post("/v1/chat/completions", json={**body, "stream": True})
        deltas = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
        replies[choice] += (deltas,)
    prompt, grammar, choice, deltas = replies["none"]
    assert "get_weather" not in prompt and "<tools>" not in prompt and "TOOLS" not in prompt
    assert grammar is None
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == CALL
    assert "tool_calls" not in choice["message"]
    assert all("tool_calls" not in d["choices"][0]["delta"] for d in deltas if d["choices"])
    assert "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas if d["choices"]) == CALL
    # The control: "auto" with the same script offers the tool and parses the call.
    prompt, grammar, choice, _ = replies["auto"]
    assert "get_weather" in prompt and grammar is not None
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1


def test_without_parallel_calls_the_grammar_refuses_a_second_call_and_allows_only_eos():
    tok = byte_tokenizer()
    compiler = GrammarCompiler(tok, 300)
    one, second = tok.encode(CALL, add_bos=False), tok.encode("\n" + CALL, add_bos=False)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", "auto", named):
        for parallel in (False, True):
            matcher = compiler.compile(parse_tools([WEATHER], choice, parallel).grammar()).matcher()
            assert matcher.consume_tokens(one) and matcher.is_accepting(), (choice, parallel)
            more = parallel and choice != named  # a named function is called once either way
            assert matcher.validate_tokens(second) == (len(second) if more else 0), (choice, parallel)
            assert matcher.is_stopped() == (not more), (choice, parallel)


@pytest.fixture(scope="module")
def tiny_client():
    config = tiny_config(vocab_size=300, context_length=512)
    model = build_model(config)
    engine = Engine(model, init_params(config, 9), EngineOptions(slots=2, max_len=512, prefill_buckets=(256,)))
    runner = InferenceRunner(engine)
    runner.start(warmup=False)
    try:
        yield TestClient(create_app(runner, tokenizer(TEMPLATES["template-tools"]), "tiny", 512))
    finally:
        runner.stop()


def test_parallel_tool_calls_false_gives_exactly_one_call(tiny_client):
    """Seeded sampling at temperature 1.5: after its call the random model would often go on to another
    if the grammar let it ("required": the call starts at the first token)."""
    for seed in range(6):
        body = {
            "messages": MESSAGES,
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 160,
            "temperature": 1.5,
            "seed": seed,
        }
        r = tiny_client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        tool_calls = choice["message"].get("tool_calls") or []
        assert choice["finish_reason"] == "tool_calls" and len(tool_calls) == 1, (seed, choice)
        assert tool_calls[0]["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(tool_calls[0]["function"]["arguments"]), PARAMS)
