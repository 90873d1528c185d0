"""tools.py on its own, without a model or a server: the request's tools as validated (each refusal
with its field and reason), the prompt and messages a template gets, the grammar of each format and
tool_choice (checked by what it accepts, on a byte tokenizer), and the Hermes parser's calls as OpenAI
streams them. Fast and fixture-free: `make mutate`'s in-process driver runs it per mutant."""

from __future__ import annotations

import json
import re

import pytest

from hkserve.api.structured import FieldError
from hkserve.api.tools import (
    CallDelta,
    ToolCallParser,
    Tools,
    held,
    parse_tools,
    render_messages,
)
from hkserve.engine.constrained import GrammarCompiler
from hkserve.train.vocab import byte_tokenizer

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOKENIZER = byte_tokenizer()
COMPILER = GrammarCompiler(TOKENIZER, 300)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME_CALL = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def refused(*args) -> tuple[str, str]:
    with pytest.raises(FieldError) as e:
        parse_tools(*args)
    return e.value.param, str(e.value)


# -- parse_tools ---------------------------------------------------------------------------------------
def test_no_tools_is_none_and_a_choice_without_tools_is_refused_unless_none():
    assert parse_tools(None, None, None) is None and parse_tools([], None, None) is None
    assert parse_tools(None, "none", None) is None and parse_tools([], "none", True) is None
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        assert refused(None, choice, None) == ("tool_choice", "tool_choice needs tools")


@pytest.mark.parametrize(
    "tools, message",
    [
        ({"type": "function"}, "tools must be a list of function tools"),
        (["get_weather"], "tools[0] must be {'type': 'function', 'function': {name, parameters}}"),
        ([{"type": "code", "function": {"name": "f"}}], "tools[0] must be"),
        ([{"type": "function", "function": "f"}], "tools[0] must be"),
        ([{"type": "function"}], "tools[0] must be"),
        ([WEATHER, {"function": {"name": ""}}], "tools[1].function.name must match [a-zA-Z0-9_-]{1,64}, got ''"),
        ([{"function": {"name": "a b"}}], "tools[0].function.name must match [a-zA-Z0-9_-]{1,64}, got 'a b'"),
        ([{"function": {"name": "x" * 65}}], "tools[0].function.name must match [a-zA-Z0-9_-]{1,64}, got 'xxx"),
        ([{"function": {"name": 7}}], "tools[0].function.name must match [a-zA-Z0-9_-]{1,64}, got 7"),
        ([WEATHER, WEATHER], "tools[1]: the function name 'get_weather' is given twice"),
        ([{"function": {"name": "f", "parameters": []}}], "tools[0].function.parameters must be a JSON schema object"),
    ],
)
def test_malformed_tools_are_refused_naming_the_tool_and_why(tools, message):
    param, text = refused(tools, None, None)
    assert param == "tools" and text.startswith(message)


def test_a_tool_is_kept_with_its_name_description_and_parameters_only():
    tools = parse_tools([WEATHER, {"function": {"name": "A-z_0" + "9" * 59, "extra": 1}}], None, None)
    assert tools.functions == {
        "get_weather": {"name": "get_weather", "description": "Weather", "parameters": CITY},
        "A-z_0" + "9" * 59: {"name": "A-z_0" + "9" * 59, "description": ""},  # 64 characters: the longest name
    }
    assert (tools.choice, tools.parallel, tools.format, tools.special) == ("auto", True, "hermes", {})
    assert tools.active


@pytest.mark.parametrize(
    "choice, parallel, expected",
    [
        ("none", None, ("none", True)),
        ("auto", False, ("auto", False)),
        ("required", True, ("required", True)),
        ({"type": "function", "function": {"name": "get_time"}}, 0, ("get_time", True)),  # only False turns it off
    ],
)
def test_tool_choice_and_parallel_calls_are_read(choice, parallel, expected):
    tools = parse_tools([WEATHER, TIME], choice, parallel, "mistral", {"[TOOL_CALLS]": 5})
    assert (tools.choice, tools.parallel, tools.format, tools.special) == (*expected, "mistral", {"[TOOL_CALLS]": 5})
    assert tools.active == (expected[0] != "none")


@pytest.mark.parametrize(
    "choice, message",
    [
        ("any", "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}"),
        (
            {"type": "function"},
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}",
        ),
        (
            {"function": {"name": 3}},
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}",
        ),
        ({"function": {"name": "nope"}}, "tool_choice names the function 'nope', which is not in tools"),
    ],
)
def test_a_bad_tool_choice_is_refused(choice, message):
    assert refused([WEATHER], choice, None) == ("tool_choice", message)


def test_tools_with_no_functions_or_choice_none_are_not_active():
    assert not Tools({}, "auto").active and not Tools({"f": {}}, "none").active and Tools({"f": {}}, "auto").active


# -- the prompt and the messages ---------------------------------------------------------------------
def test_the_builtin_prompt_lists_each_tool_as_one_json_line():
    tools = parse_tools([WEATHER, TIME], None, None)
    assert tools.template_tools() == [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": CITY}},
        {"type": "function", "function": {"name": "get_time", "description": ""}},
    ]
    prompt = tools.system_prompt()
    listed = prompt.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == tools.template_tools()
    assert prompt.startswith("# Tools\n") and prompt.endswith(
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}},
            {"id": "c3", "type": "function", "function": "broken"},
        ],
    },
    {"role": "tool", "content": "21 C", "tool_call_id": "c1"},
]


def test_a_template_with_tools_gets_them_and_the_calls_arguments_as_mappings():
    tools = parse_tools([WEATHER], None, None)
    messages, offered = render_messages(HISTORY, tools, template_has_tools=True)
    assert offered == tools.template_tools()
    assert messages[:2] == HISTORY[:2] and messages[3] == HISTORY[3]
    calls = messages[2]["tool_calls"]
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_time", "arguments": "not json"},  # left as sent: the template shows it as it is
        {"arguments": {}},
    ]
    assert HISTORY[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request is not changed
    assert render_messages(HISTORY[:2], None, True) == (HISTORY[:2], None)
    assert render_messages(HISTORY[:2], parse_tools([WEATHER], "none", None), True)[1] is None


def test_a_template_without_tools_gets_the_builtin_prompt_calls_as_text_and_results_as_user_turns():
    tools = parse_tools([WEATHER], None, None)
    messages, offered = render_messages(HISTORY, tools, template_has_tools=False)
    assert offered is None
    assert messages == [
        {"role": "system", "content": "Be brief.\n\n" + tools.system_prompt()},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": not json}\n</tool_call>\n'
            '<tool_call>\n{"name": "", "arguments": {}}\n</tool_call>',
        },
        {"role": "user", "content": "<tool_response>\n21 C\n</tool_response>"},
    ]
    spoken = {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
    }
    messages, _ = render_messages([HISTORY[1], spoken], tools, False)
    assert messages[0] == {"role": "system", "content": tools.system_prompt()}  # no system message: one is added
    assert messages[2]["content"] == 'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert render_messages(HISTORY[:2], parse_tools([WEATHER], "none", None), False)[0] == HISTORY[:2]
    assert render_messages([{"role": "user", "content": "x", "name": "n"}], None, False)[0] == [
        {"role": "user", "content": "x"}
    ]
    odd = {"role": "user", "content": "x", "tool_calls": HISTORY[2]["tool_calls"]}  # only an assistant calls
    assert render_messages([odd], None, False)[0] == [{"role": "user", "content": "x"}]


# -- the grammar ---------------------------------------------------------------------------------------
def accepts(tools: Tools, text: str) -> bool:
    """Whether the tools' grammar lets the model write exactly `text` and then end."""
    matcher = COMPILER.compile(tools.grammar()).matcher()
    ids = TOKENIZER.encode(text, add_bos=False)
    if matcher.validate_tokens(ids) != len(ids):
        return False
    matcher.consume_tokens(ids)
    return matcher.consume_token(TOKENIZER.eos_id)


def test_no_grammar_without_active_tools():
    assert Tools({}, "auto").grammar() is None and parse_tools([WEATHER], "none", None).grammar() is None


NAMED = {"type": "function", "function": {"name": "get_time"}}
HERMES = [  # (text, accepted by: required, auto, named get_time, required without parallel calls)
    (CALL, (True, True, False, True)),
    (TIME_CALL, (True, True, True, True)),
    (CALL + "\n" + TIME_CALL, (True, True, False, False)),
    (CALL + TIME_CALL, (False, False, False, False)),  # calls are joined by a newline
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', (False,) * 4),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>', (False,) * 4),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', (False,) * 4),
    ("Plain text.", (False, True, False, False)),
    ("Let me look.\n" + CALL, (False, True, False, False)),
    ("Let me look.\n<tool_call>\nno call", (False, False, False, False)),
    ("", (False, True, False, False)),
]


@pytest.mark.parametrize("text, expected", HERMES, ids=range(len(HERMES)))
def test_the_hermes_grammar_of_each_tool_choice(text, expected):
    choices = [("required", True), ("auto", True), (NAMED, True), ("required", False)]
    got = tuple(accepts(parse_tools([WEATHER, TIME], c, p), text) for c, p in choices)
    assert got == expected


W = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
T = '{"name": "get_time", "parameters": {}}'
M = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'


@pytest.mark.parametrize(
    "fmt, text, required, auto",
    [
        ("llama3_json", W, True, True),
        ("llama3_json", W + "; " + T, True, True),
        ("llama3_json", W + ";" + T, False, False),
        ("llama3_json", "Sure. " + W, False, True),  # text, then no call: the Llama call must start the reply
        ("llama3_json", ' {"x": 1}', False, False),  # a reply that starts with `{` is a call
        ("llama3_json", "Hello", False, True),
        ("mistral", M, True, True),
        ("mistral", M[:-1], False, False),
        ("mistral", "Sure." + M, False, True),
        ("mistral", "Sure. [TOOL_CALLS] no", False, False),
        ("mistral", "Sure.", False, True),
        ("qwen3_coder", "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", True, True),
        ("qwen3_coder", "Hi <tool_call>\n<function=get_time>\n</function>\n</tool_call>", False, True),
        (
            "qwen3_coder",
            '<tool_call>\n<function=get_weather>\n<parameter=city>\n"Rome"\n</parameter>\n</function>\n</tool_call>\n'
            "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            True,
            True,
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>",
            False,
            False,
        ),  # city is required
    ],
)
def test_each_format_grammar_by_what_it_accepts(fmt, text, required, auto):
    assert accepts(parse_tools([WEATHER, TIME], "required", True, fmt), text) == required
    assert accepts(parse_tools([WEATHER, TIME], "auto", True, fmt), text) == auto


def test_a_marker_that_is_a_special_token_is_written_as_that_token():
    grammar = parse_tools([TIME], "auto", True, "mistral", {"[TOOL_CALLS]": 7}).grammar().text
    assert grammar.startswith('start: NOCALL | NOCALL? <[7]> "[{\\"name\\": \\"" (body0)')
    assert "CALLSTART" not in grammar
    required = parse_tools([TIME], "required", True, "mistral", {"[TOOL_CALLS]": 7}).grammar().text
    assert required.startswith('start: <[7]> "[{\\"name\\": \\""')
    llama = parse_tools([TIME], "auto", True, "llama3_json", {"<|python_tag|>": 9}).grammar().text
    assert llama.startswith('start: NOCALL | (<[9]>)? "{\\"name\\": \\"" (body0)')
    hermes = parse_tools([TIME], "required", False, "hermes", {"<tool_call>": 4, "</tool_call>": 5}).grammar().text
    assert hermes.startswith('start: <[4]> "\\n{\\"name\\": \\"" (body0)')
    assert '"}\\n" <[5]>' in hermes
    assert "<[" not in parse_tools([TIME], "required", True, "llama3_json").grammar().text


QWEN_STRINGS = {
    "type": "object",
    "properties": {
        "unit": {"type": "string", "enum": ["C", "F"]},
        "note": {"type": "string", "maxLength": 3},
        "days": {"type": "integer"},
        "text": {"type": "string"},
    },
    "required": ["unit"],
}


def qwen(params: str) -> str:
    return f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"


@pytest.mark.parametrize(
    "params, ok",
    [
        ("<parameter=unit>\nC\n</parameter>\n", True),
        ("<parameter=unit>\nK\n</parameter>\n", False),
        ("<parameter=note>\nab\n</parameter>\n", False),  # the required unit is missing
        ("<parameter=unit>\nF\n</parameter>\n<parameter=note>\nabc\n</parameter>\n", True),
        ("<parameter=unit>\nF\n</parameter>\n<parameter=note>\nabcd\n</parameter>\n", False),
        ("<parameter=unit>\nC\n</parameter>\n<parameter=days>\n12\n</parameter>\n", True),
        ("<parameter=unit>\nC\n</parameter>\n<parameter=days>\nten\n</parameter>\n", False),
        ("<parameter=unit>\nC\n</parameter>\n<parameter=text>\nline\n</parameter> no\n</parameter>\n", False),
        ("<parameter=unit>\nC\n</parameter>\n<parameter=text>\nline\nline </two>\n</parameter>\n", True),
        ("<parameter=unit>\nC\n</parameter>\n<parameter=text>\na\n</parameters\n</parameter>\n", True),
        ('<parameter=unit>\nC\n</parameter>\n<parameter=days>\n"12"\n</parameter>\n', False),  # JSON of the type
        ("<parameter=days>\n1\n</parameter>\n<parameter=unit>\nC\n</parameter>\n", False),  # in schema order
    ],
)
def test_qwen3_coder_parameters_follow_the_schema(params, ok):
    tool = {"function": {"name": "f", "parameters": QWEN_STRINGS}}
    assert accepts(parse_tools([tool], "required", True, "qwen3_coder"), qwen(params)) == ok


def test_qwen3_coder_refuses_string_constraints_it_cannot_enforce_and_takes_no_parameters():
    for key in ("pattern", "format", "minLength", "const"):
        tool = {"function": {"name": "f", "parameters": {"properties": {"s": {"type": "string", key: "x"}}}}}
        with pytest.raises(FieldError) as e:
            parse_tools([tool], "required", True, "qwen3_coder").grammar()
        assert (
            e.value.param == "tools" and str(e.value) == f"qwen3_coder string parameters cannot be constrained by {key}"
        )
    both = {
        "function": {
            "name": "f",
            "parameters": {"properties": {"s": {"type": "string", "pattern": "a", "minLength": 1}}},
        }
    }
    with pytest.raises(FieldError, match="^qwen3_coder string parameters cannot be constrained by minLength, pattern$"):
        parse_tools([both], "required", True, "qwen3_coder").grammar()
    bare = parse_tools([{"function": {"name": "f"}}], "required", True, "qwen3_coder")
    assert accepts(bare, qwen("")) and not accepts(bare, qwen("<parameter=a>\n1\n</parameter>\n"))
    loose = {"function": {"name": "f", "parameters": {"properties": {"n": True}}}}  # any JSON value
    loose_tools = parse_tools([loose], "required", True, "qwen3_coder")
    assert accepts(loose_tools, qwen('<parameter=n>\n[1, "a"]\n</parameter>\n'))
    assert not accepts(loose_tools, qwen('<parameter=n>\n[1,"a"]\n</parameter>\n'))  # the JSON options apply


def test_arguments_follow_each_functions_schema_and_no_parameters_means_an_object():
    tools = parse_tools([WEATHER, TIME], "required", True)
    assert accepts(tools, '<tool_call>\n{"name": "get_time", "arguments": {"any": [1, 2]}}\n</tool_call>')
    assert not accepts(tools, '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>')
    assert not accepts(tools, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


# -- the Hermes parser ---------------------------------------------------------------------------------
def parse(pieces: list[str], text_content: bool = True) -> tuple[str, list[CallDelta], ToolCallParser]:
    parser = ToolCallParser(text_content=text_content)
    content, deltas = "", []
    for k, piece in enumerate(pieces):
        c, d = parser.feed(piece, final=k == len(pieces) - 1)
        content, deltas = content + c, deltas + d
    return content, deltas, parser


def test_calls_come_back_in_openais_shape_with_fresh_ids():
    content, deltas, parser = parse(["Sure.\n" + CALL + "\n" + TIME_CALL + " Done."])
    assert content == "Sure.\n\n Done."
    ids = [c["id"] for c in parser.calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 2
    assert parser.calls == [
        {"id": ids[0], "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": ids[1], "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert [d.openai() for d in deltas] == [
        {
            "index": 0,
            "id": ids[0],
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"index": 1, "id": ids[1], "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]  # the pieces of one update joined into the call's first delta
    assert CallDelta(2, "x").openai() == {"index": 2, "function": {"arguments": "x"}}


def test_streamed_pieces_give_the_same_calls_and_argument_pieces_of_one_update_are_joined():
    text = "A <b> " + CALL
    for cut in range(1, len(text)):
        content, deltas, parser = parse([text[:cut], text[cut:]])
        assert content == "A <b> " and [c["function"] for c in parser.calls] == [
            {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        ], cut
        assert "".join(d.arguments for d in deltas) == '{"city": "Paris"}'
    _, deltas, _ = parse(list(text))
    assert [d.arguments for d in deltas if d.id is None] == list('{"city": "Paris"}')  # one per character
    parser = ToolCallParser()
    parser.feed('<tool_call>\n{"name": "f", "arguments": ')
    content, deltas = parser.feed('{"a": 1, "b": 2', final=False)
    assert content == "" and [(d.index, d.arguments, d.id) for d in deltas] == [(0, '{"a": 1, "b": 2', None)]


def test_text_that_may_start_a_call_is_held_until_it_cannot():
    parser = ToolCallParser()
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.feed("box>") == ("<toolbox>", [])
    assert parser.feed("x}\n</tool_", final=False) == ("x}\n</tool_", [])
    assert parser.feed("<", final=True) == ("<", [])


def test_an_unfinished_or_malformed_call_stays_content():
    assert parse(['Hi <tool_call>\n{"name": "f"'])[:2] == ('Hi <tool_call>\n{"name": "f"', [])
    assert parse(['<tool_call>{"name": "f", "arguments": {}}'])[0] == '<tool_call>{"name": "f", "arguments": {}}'
    content, _, parser = parse(['<tool_call>\n{"name": "f", "arguments": {"a": 1'])
    assert content == "" and parser.calls[0]["function"] == {"name": "f", "arguments": '{"a": 1'}
    _, deltas, parser = parse(['<tool_call>\n{"name": "f", "arguments": {"a": 1}\n'])  # ends inside the terminator
    assert parser.calls[0]["function"]["arguments"] == '{"a": 1}\n' == "".join(d.arguments for d in deltas)


def test_without_text_content_only_the_calls_come_back():
    content, deltas, parser = parse(["Sure.\n" + CALL + "\nBye"], text_content=False)
    assert content == "" and len(parser.calls) == 1 and deltas[0].name == "get_weather"


def test_held_is_the_longest_end_that_begins_the_marker():
    assert [held(t, "<tool_call>") for t in ("", "x", "x<", "<tool", "<tool_call", "<tool_call>", "<t<to")] == [
        0,
        0,
        1,
        5,
        10,
        0,
        3,
    ]
    assert held("ab", "b") == 0  # a one-character marker is whole or absent
