"""The reasoning and tool-call parsers on outputs written the way each family writes them (from their
published chat templates and documentation), whole and streamed with every split of the text; the
auto-detection of each; and each format's tool grammar accepting the syntax its parser reads."""

from __future__ import annotations

import json

import pytest

from hkserve.api import reasoning, tool_parsers
from hkserve.api.reply import ReplyParser
from hkserve.api.tools import parse_tools
from hkserve.engine.constrained import GrammarCompiler, GrammarSpec

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
QWEN_CODER_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)

# (reasoning parser, tool format or None, model output, expected (reasoning, content, [(name, args)]))
CASES = {
    "deepseek_r1 (the prompt opened <think>)": (
        "deepseek_r1",
        None,
        "Okay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
        ("Okay, the user asks for 2 + 2. That is 4.\n", "The answer is **4**.", []),
    ),
    "deepseek_r1 repeating <think>": (
        "deepseek_r1",
        None,
        "<think>\nHmm, a greeting.\n</think>\n\nHello!",
        ("\nHmm, a greeting.\n", "Hello!", []),
    ),
    "deepseek_r1 cut short (length)": ("deepseek_r1", None, "Let me count: 1, 2, 3", ("Let me count: 1, 2, 3", "", [])),
    "qwen3 thinking": (
        "qwen3",
        None,
        "<think>\nThe user wants a haiku about autumn.\n</think>\n\nLeaves drift on cold wind",
        ("\nThe user wants a haiku about autumn.\n", "Leaves drift on cold wind", []),
    ),
    "qwen3 not thinking (enable_thinking false)": (
        "qwen3",
        None,
        "Hello! How can I help?",
        ("", "Hello! How can I help?", []),
    ),
    "qwen3 thinking, then a hermes call": (
        "qwen3",
        "hermes",
        "<think>\nI need the weather tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        ("\nI need the weather tool.\n", "", [("get_weather", {"city": "Paris"})]),
    ),
    "hermes: text then two calls": (
        None,
        "hermes",
        'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ("", "Checking. \n", [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]),
    ),
    "llama3_json after <|python_tag|>": (
        None,
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        ("", "", [("get_weather", {"city": "Paris"})]),
    ),
    "llama3_json bare, two calls": (
        None,
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}; {"name": "get_time", "parameters": {}}',
        ("", "", [("get_weather", {"city": "Rome", "days": 1}), ("get_time", {})]),
    ),
    "llama3_json plain answer": (None, "llama3_json", "Paris is the capital.", ("", "Paris is the capital.", [])),
    "llama3_json a JSON answer that is no call": (
        None,
        "llama3_json",
        '{"capital": "Paris"}',
        ("", '{"capital": "Paris"}', []),
    ),
    "mistral v3 list": (
        None,
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}}, {"name": "get_time", "arguments": {}}]',
        ("", "", [("get_weather", {"city": "Lyon"}), ("get_time", {})]),
    ),
    "mistral v11 name[ARGS]": (
        None,
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]get_time[ARGS]{}',
        ("", "Sure.", [("get_weather", {"city": "Nice"}), ("get_time", {})]),
    ),
    "mistral broken call stays content": (
        None,
        "mistral",
        "[TOOL_CALLS]get_weather[ARGS]{oops",
        ("", "[TOOL_CALLS]get_weather[ARGS]{oops", []),
    ),
    "qwen3_coder": (None, "qwen3_coder", QWEN_CODER_CALL, ("", "", [("get_weather", {"city": "New York", "days": 3})])),
    "qwen3 thinking, then a qwen3_coder call with a multi-line string": (
        "qwen3",
        "qwen3_coder",
        "<think>\nCall it.\n</think>\n\nOne moment.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Line one\nline </two>\n</parameter>\n</function>\n</tool_call>",
        ("\nCall it.\n", "One moment.\n", [("get_weather", {"city": "Line one\nline </two>"})]),
    ),
}


def _tools(fmt: str | None):
    return parse_tools([WEATHER, TIME], "auto", True, fmt) if fmt else None


def _run(parser: ReplyParser, pieces: list[str]) -> tuple[str, str, list]:
    """Feed the pieces; the reasoning, content and calls (name, parsed arguments) as a client
    reassembles them from the deltas."""
    thought, content, calls = "", "", {}
    for k, piece in enumerate(pieces):
        parts = parser.feed(piece, final=k == len(pieces) - 1)
        thought, content = thought + parts.reasoning, content + parts.content
        for d in parts.calls:
            if d.id is not None:
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return thought, content, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.parametrize("case", CASES)
def test_each_family_output_splits_whole_and_at_every_stream_boundary(case):
    parser_name, fmt, text, expected = CASES[case]
    whole = ReplyParser(parser_name, _tools(fmt))
    assert _run(whole, [text]) == expected
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole.calls] == expected[2]
    for cut in range(1, len(text)):  # a tag or marker split across two deltas, at every position
        assert _run(ReplyParser(parser_name, _tools(fmt)), [text[:cut], text[cut:]]) == expected, cut
    assert _run(ReplyParser(parser_name, _tools(fmt)), list(text)) == expected  # one character per delta


def test_reasoning_text_is_the_output_up_to_the_end_tag():
    parser = ReplyParser("qwen3", None)
    for ch in "<think>\nhm\n</think>\n\nHi":
        parser.feed(ch)
    parser.feed("", final=True)
    assert parser.reasoning_text == "<think>\nhm\n</think>"


# The generation-prompt ends of the published chat templates (abridged): DeepSeek-R1's distills open
# <think>; Qwen3's closes an empty one when thinking is off; SmolLM2's has none.
R1_TEMPLATE = "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
QWEN3_TEMPLATE = (
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and "
    "enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
PLAIN_TEMPLATE = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"


@pytest.mark.parametrize(
    "template, has_think, expected",
    [
        (R1_TEMPLATE, False, "deepseek_r1"),
        (QWEN3_TEMPLATE, True, "qwen3"),
        (PLAIN_TEMPLATE, True, "qwen3"),  # a <think> token in the vocabulary
        (PLAIN_TEMPLATE, False, None),
        (None, False, None),
    ],
)
def test_reasoning_parser_auto_detection(template, has_think, expected):
    assert reasoning.choose("auto", template, has_think) == expected
    assert reasoning.choose("none", template, has_think) is None
    assert reasoning.choose("qwen3", template, has_think) == "qwen3"


@pytest.mark.parametrize(
    "snippet, expected",
    [
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ('{"name": function name, "parameters": dictionary of argument name and its value}', "llama3_json"),
        ("{{- '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
        ("<tool_call>\\n<function=' + tool_call.name + '>\\n<parameter=' + name", "qwen3_coder"),
        ('<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}', "hermes"),
        (None, "hermes"),
    ],
)
def test_tool_call_parser_auto_detection(snippet, expected):
    assert tool_parsers.choose("auto", snippet) == expected
    with pytest.raises(ValueError):
        tool_parsers.choose("xml", snippet)


# Each format's constrained output, as the grammar lets the model write it, read back by its parser.
GRAMMAR_OUTPUTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
}


@pytest.fixture(scope="module")
def compiler(smollm2):
    return GrammarCompiler(smollm2[2], smollm2[2].vocab_size)


def _accepts(compiler, spec: GrammarSpec, text: str) -> bool:
    matcher = compiler.compile(spec).matcher()
    ok = all(matcher.consume_token(t) for t in compiler.tokenizer.encode(text, add_bos=False))
    return ok and matcher.is_accepting()


@pytest.mark.parametrize("fmt", tool_parsers.FORMATS)
@pytest.mark.parametrize("choice", ["required", "named", "auto"])
def test_each_format_grammar_writes_what_its_parser_reads(compiler, fmt, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    tools = parse_tools([WEATHER, TIME], tool_choice, True, fmt)
    text = GRAMMAR_OUTPUTS[fmt]
    assert _accepts(compiler, tools.grammar(), text)
    other = GRAMMAR_OUTPUTS["mistral" if fmt != "mistral" else "hermes"]
    assert not _accepts(compiler, tools.grammar(), other) or choice == "auto"  # auto: another syntax is text
    parsed = _run(ReplyParser(None, tools), [text])
    assert parsed == ("", "", [("get_weather", {"city": "Paris", "days": 2})])
    if choice == "auto":
        assert _accepts(compiler, tools.grammar(), "It is sunny.")


@pytest.mark.parametrize("parser_name", reasoning.PARSERS)
def test_a_response_format_constrains_only_the_answer_after_the_reasoning(compiler, parser_name):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = reasoning.answer_only(GrammarSpec("json_schema", json.dumps(schema)), parser_name)
    opened = "" if parser_name == "deepseek_r1" else "<think>"
    assert _accepts(compiler, spec, opened + "Free {text} here.\n</think>\n\n" + '{"n": 4}')
    assert not _accepts(compiler, spec, opened + "Free text.\n</think>\n\nnot json")
    assert _accepts(compiler, spec, '{"n": 4}') == (parser_name == "qwen3")  # qwen3 may skip thinking


def test_qwen3_coder_string_parameters_keep_enum_and_max_length(compiler):
    unit = {"type": "string", "enum": ["celsius", "fahrenheit"]}
    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}, "unit": unit}}
    tool = {"type": "function", "function": {"name": "w", "parameters": {**params, "required": ["city", "unit"]}}}
    grammar = parse_tools([tool], "required", False, "qwen3_coder").grammar()

    def call(city: str, unit: str) -> str:
        params = f"<parameter=city>\n{city}\n</parameter>\n<parameter=unit>\n{unit}\n</parameter>\n"
        return f"<tool_call>\n<function=w>\n{params}</function>\n</tool_call>"

    assert _accepts(compiler, grammar, call("Paris", "celsius"))
    assert not _accepts(compiler, grammar, call("Paris", "kelvin"))
    assert not _accepts(compiler, grammar, call("Londres", "celsius"))
    pattern = {
        "type": "function",
        "function": {
            "name": "w",
            "parameters": {"type": "object", "properties": {"c": {"type": "string", "pattern": "^a$"}}},
        },
    }
    with pytest.raises(ValueError, match="pattern"):
        parse_tools([pattern], "required", False, "qwen3_coder").grammar()
