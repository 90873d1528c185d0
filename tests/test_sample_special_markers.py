"""`hkserve sample` with tools on a model whose call markers are special tokens (Mistral's
`[TOOL_CALLS]`, Llama 3.1's `<|python_tag|>`): the line's grammar lets the model write the marker as its
token, the detokenizer keeps it for the parser, and the output line has the call and never the marker.
The fake runner replays the model's ids (no model)."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
from http_helpers import FakeRunner
from special_tokenizer import PYTHON_TAG, TOKENIZER, TOOL_CALLS, ids

from hkserve.cli.sample import Job, _complete
from hkserve.engine.constrained import GrammarCompiler

CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
PARIS = ["get_weather", {"city": "Paris"}]
# (format, tool_choice, the model's output as (special token | text) pieces, the text line, its calls)
CASES = {
    "mistral required": (
        "mistral",
        "required",
        [TOOL_CALLS, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'],
        "",
        [PARIS],
    ),
    "mistral auto after text": (
        "mistral",
        "auto",
        ["Sure.", TOOL_CALLS, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'],
        "Sure.",
        [PARIS],
    ),
    "llama3 required": (
        "llama3_json",
        "required",
        [PYTHON_TAG, '{"name": "get_weather", "parameters": {"city": "Paris"}}'],
        "",
        [PARIS],
    ),
    "mistral auto no call": ("mistral", "auto", ["A", TOOL_CALLS, "B"], "AB", []),
}


def job(fmt: str, choice: str) -> Job:
    args = argparse.Namespace(max_tokens=100, temperature=0.0, top_p=1.0, seed=0, tool_call_parser=fmt)
    line = {"id": "w", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER]}
    compiler = GrammarCompiler(TOKENIZER, TOKENIZER.vocab_size)
    made = Job(0, json.dumps({**line, "tool_choice": choice}), args, TOKENIZER, 4096, compiler)
    assert made.error is None, made.error
    return made


@pytest.mark.parametrize("case", [c for c in CASES if CASES[c][4]])  # a marker then no call breaks the grammar
def test_a_lines_grammar_takes_the_special_marker_as_its_token(case):
    fmt, choice, pieces, _, _ = CASES[case]
    matcher = job(fmt, choice).request.grammar.matcher()
    for k, token in enumerate(ids(pieces) + [TOKENIZER.eos_id]):
        assert matcher.consume_token(token), (k, matcher.get_error())
    assert matcher.is_stopped()


@pytest.mark.parametrize("case", CASES)
def test_the_output_line_has_the_call_after_a_special_marker_and_never_the_marker(case):
    fmt, choice, pieces, text, calls = CASES[case]
    runner = FakeRunner(ids(pieces) + [TOKENIZER.eos_id])
    result = asyncio.run(_complete(job(fmt, choice), runner, TOKENIZER))
    got = [[c["function"]["name"], json.loads(c["function"]["arguments"])] for c in result.get("tool_calls", [])]
    assert (result["text"], got) == (text, calls)
    assert result["finish_reason"] == ("tool_calls" if calls else "stop")
    assert result["usage"]["completion_tokens"] == len(ids(pieces)) + 1  # a marker is one token, EOS counted
