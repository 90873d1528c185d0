"""Tool calling: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` as a prompt, a grammar and a
parser of the model's calls.

The call format is Hermes' (NousResearch Hermes, Qwen2.5, SmolLM3 write it):
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
A chat template that takes a `tools` variable gets the tools and the conversation as they are; for one
that does not (SmolLM2's), the built-in prompt below goes into the system message, past calls are
written back in the same format and tool results as <tool_response> user turns, which is how Hermes-
style templates render them. "required" and a named function are enforced by a grammar from the first
token; "auto" lets the model write text, and enforces the call once it writes `<tool_call>`; "none"
leaves the tools out of the prompt and the output unconstrained.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hkserve.api.structured import FieldError
from hkserve.engine.constrained import JSON_OPTIONS, GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HEAD = '\n{"name": "'
NAME_END = '", "arguments": '
TERM = "}\n" + CLOSE
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class Syntax(NamedTuple):
    """How a format writes its calls, for the grammar: open, then per call head + name + mid + arguments
    + tail, calls joined by sep, then close. "auto" lets free text come first, up to `trigger` (None:
    the calls must start the reply, as Llama's do). `lead`: a marker that may come before the calls
    where the tokenizer has it as a special token (Llama 3.1's `<|python_tag|>`)."""

    open: str
    head: str
    mid: str
    tail: str
    sep: str
    close: str
    trigger: str | None
    lead: str | None = None


SYNTAX = {
    "hermes": Syntax("", OPEN + HEAD, NAME_END, TERM, "\n", "", OPEN),
    "llama3_json": Syntax("", '{"name": "', '", "parameters": ', "}", "; ", "", None, "<|python_tag|>"),
    "mistral": Syntax("[TOOL_CALLS][", '{"name": "', '", "arguments": ', "}", ", ", "]", "[TOOL_CALLS]"),
    "qwen3_coder": Syntax("", OPEN + "\n<function=", ">\n", "</function>\n" + CLOSE, "\n", "", OPEN),
}


@dataclass
class Tools:
    functions: dict[str, dict]  # name -> {"name", "description", "parameters"}
    choice: str  # "none" | "auto" | "required" | a function's name
    parallel: bool = True
    format: str = "hermes"  # the format calls are written in (tool_parsers.FORMATS)
    special: dict[str, int] = field(default_factory=dict)  # the format's markers that are special tokens: their ids

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    # -- prompt ------------------------------------------------------------------------------------
    def template_tools(self) -> list[dict]:
        return [{"type": "function", "function": f} for f in self.functions.values()]

    def system_prompt(self) -> str:
        return SYSTEM_PROMPT.format(tools="\n".join(json.dumps(t) for t in self.template_tools()))

    # -- grammar -----------------------------------------------------------------------------------
    def grammar(self) -> GrammarSpec | None:
        """The Lark grammar the output must match, in this format's syntax, or None ("none")."""
        if not self.active:
            return None
        syntax = SYNTAX[self.format]
        names = [self.choice] if self.choice in self.functions else list(self.functions)
        rules = []
        for i, name in enumerate(names):
            schema = self.functions[name].get("parameters") or {"type": "object"}
            rules.append(f"body{i}: {_lark_str(name + syntax.mid)} args{i} {self._lark(syntax.tail)}")
            rules += _args_rules(f"args{i}", schema, self.format)
        bodies = " | ".join(f"body{i}" for i in range(len(names)))
        calls = f"({bodies})"
        if self.parallel and self.choice in ("auto", "required"):
            calls += f" ({self._lark(syntax.sep + syntax.head)} ({bodies}))*"
        calls += f" {self._lark(syntax.close)}" if syntax.close else ""
        first = syntax.open + syntax.head
        lead = f"({self._lark(syntax.lead)})? " if syntax.lead in self.special else ""
        if self.choice != "auto":
            head_rules = [f"start: {lead}{self._lark(first)} {calls}"]
        elif syntax.trigger is None:  # free text that does not start a call, or the calls
            head_rules = [
                f"start: NOCALL | {lead}{self._lark(first)} {calls}",
                r"NOCALL: /(.|\n)*/ & ~/[ \t\n]*\{(.|\n)*/",
            ]
        else:  # free text until the first trigger, then the calls
            trigger = re.escape(syntax.trigger).replace("/", "\\/")
            special = syntax.trigger in self.special  # the trigger is its token, after any text
            callstart = f"NOCALL? {self._lark(syntax.trigger)}" if special else "CALLSTART"
            head_rules = [
                f"start: NOCALL | {callstart} {self._lark(first[len(syntax.trigger) :])} {calls}",
                rf"NOCALL: /(.|\n)*/ & ~/(.|\n)*{trigger}(.|\n)*/",
            ] + ([] if special else [rf"CALLSTART: /(.|\n)*{trigger}/ & ~/(.|\n)*{trigger}(.|\n)+/"])
        return GrammarSpec("lark", "\n".join(head_rules + rules) + "\n")

    def _lark(self, text: str) -> str:
        """`text` as Lark: a marker that is a special token as that token (`<[id]>`: a special token is
        never spelled by plain ones), the rest as strings."""
        if not self.special:
            return _lark_str(text)
        parts = re.split("(" + "|".join(map(re.escape, self.special)) + ")", text)
        return " ".join(f"<[{self.special[p]}]>" if p in self.special else _lark_str(p) for p in parts if p) or '""'


def _args_rules(rule: str, schema: dict, fmt: str) -> list[str]:
    """The arguments' rules: one JSON value of the schema, or Qwen3-Coder's <parameter=...> blocks
    (its properties in order, the required ones present; strings as written, the rest as JSON)."""
    if fmt != "qwen3_coder":
        return [f"{rule}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}"]
    props, required = schema.get("properties") or {}, set(schema.get("required") or ())
    parts, rules = [], []
    for j, (prop, sub) in enumerate(props.items()):
        start = _lark_str(f"<parameter={prop}>\n")
        if isinstance(sub, dict) and sub.get("type") == "string":
            rules.append(f"{rule.upper()}_{j}: {_string_param(sub)}")
            block = f"{start} {rule.upper()}_{j}"
        else:
            sub = sub if isinstance(sub, dict) else {}
            rules.append(f"{rule}_{j}: %json {json.dumps({**sub, 'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}")
            block = f"{start} {rule}_{j} {_lark_str(chr(10) + '</parameter>' + chr(10))}"
        parts.append(block if prop in required else f"({block})?")
    return [f"{rule}: {' '.join(parts) or _lark_str('')}"] + rules


def _string_param(schema: dict) -> str:
    """A Qwen3-Coder string value and its end tag, as one terminal: one of an `enum`, at most `maxLength`
    characters, or any text up to the first end tag. (Other string constraints, such as `pattern`, are
    not enforced on this format's raw strings: refused.)"""
    end = r"\n<\/parameter>\n"
    if "enum" in schema:
        return " | ".join(_lark_str(f"{v}\n</parameter>\n") for v in schema["enum"] if isinstance(v, str))
    unsupported = sorted(set(schema) & {"pattern", "format", "minLength", "const"})
    if unsupported:
        raise FieldError("tools", f"qwen3_coder string parameters cannot be constrained by {', '.join(unsupported)}")
    length = f"{{0,{int(schema['maxLength'])}}}" if isinstance(schema.get("maxLength"), int) else "*"
    return rf"/(.|\n){length}{end}/ & ~/(.|\n)*{end[:-2]}(.|\n)*{end}/"


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def parse_tools(
    tools: Any, tool_choice: Any, parallel_tool_calls: Any, fmt: str = "hermes", special: dict[str, int] | None = None
) -> Tools | None:
    """The request's tools, or None when it has none (`special`: Tools.special). Raises FieldError for
    what cannot be honoured: a malformed tool, a duplicate or invalid name, a tool_choice naming a
    function not given."""
    if tool_choice is not None and not tools:
        if tool_choice == "none":
            return None
        raise FieldError("tool_choice", "tool_choice needs tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise FieldError("tools", "tools must be a list of function tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise FieldError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{name, parameters}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise FieldError("tools", f"tools[{i}].function.name must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}")
        if name in functions:
            raise FieldError("tools", f"tools[{i}]: the function name {name!r} is given twice")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise FieldError("tools", f"tools[{i}].function.parameters must be a JSON schema object")
        entry = {"name": name, "description": fn.get("description") or ""}
        if params is not None:
            entry["parameters"] = params
        functions[name] = entry
    choice = _choice(tool_choice if tool_choice is not None else "auto", functions)
    return Tools(functions, choice, parallel_tool_calls is not False, fmt, dict(special or {}))


def _choice(tool_choice: Any, functions: dict) -> str:
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FieldError(
            "tool_choice", "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name'}}"
        )
    if fn["name"] not in functions:
        raise FieldError("tool_choice", f"tool_choice names the function {fn['name']!r}, which is not in tools")
    return fn["name"]


def render_messages(messages: list[dict], tools: Tools | None, template_has_tools: bool) -> tuple[list[dict], Any]:
    """Messages and the template's `tools` variable for a conversation with tools, calls and results."""
    offered = tools is not None and tools.active
    if template_has_tools:
        out = [_with_parsed_arguments(m) for m in messages]
        return out, (tools.template_tools() if offered else None)
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [m["content"], *calls]))})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if offered:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools.system_prompt()}
        else:
            out.insert(0, {"role": "system", "content": tools.system_prompt()})
    return out, None


def _function(call: dict) -> dict:
    """A past call's function, {} when a client sent something else (the template then shows less)."""
    fn = call.get("function")
    return fn if isinstance(fn, dict) else {}


def _call_text(call: dict) -> str:
    fn = _function(call)
    args = fn.get("arguments")
    if not isinstance(args, str):
        args = json.dumps(args if args is not None else {})
    return f"{OPEN}{HEAD}{fn.get('name', '')}{NAME_END}{args}{TERM}"


def _with_parsed_arguments(message: dict) -> dict:
    """HF templates expect each call's arguments as a mapping, OpenAI sends a JSON string."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for c in message["tool_calls"]:
        fn = dict(_function(c))
        try:
            fn["arguments"] = json.loads(fn.get("arguments") or "{}")
        except (TypeError, json.JSONDecodeError):
            pass
        calls.append({**c, "function": fn})
    return {**message, "tool_calls": calls}


@dataclass
class CallDelta:
    """One piece of a call, as OpenAI streams it: the first has id and name, the rest argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def openai(self) -> dict:
        out: dict = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            out = {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, **out["function"]},
            }
        return out


@dataclass
class CallParser:
    """What every format's parser keeps: the calls so far (OpenAI's shape) and the text not yet read."""

    text_content: bool = True  # "auto": text outside calls is content; "required"/named: it is separators
    calls: list[dict] = field(default_factory=list)
    _buffer: str = ""

    def _open_call(self, name: str, arguments: str = "") -> CallDelta:
        """A new call, and its first delta (id and name)."""
        call_id = "call_" + uuid.uuid4().hex[:24]
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        return CallDelta(len(self.calls) - 1, arguments, call_id, name)


@dataclass
class ToolCallParser(CallParser):
    """Hermes' calls from the model's text, incrementally: text that may still become part of a call
    marker is held back until it cannot. Streaming and whole responses both go through it, so a
    streamed call reassembles to exactly the whole one."""

    _state: str = "text"  # text | head | args

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        content, deltas = "", []
        while True:
            if self._state == "text":
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = 0 if final else held(self._buffer, OPEN)
                    content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content += self._buffer[:at]
                self._buffer, self._state = self._buffer[at + len(OPEN) :], "head"
            elif self._state == "head":
                end = self._buffer.find(NAME_END)
                if end < 0 or not self._buffer.startswith(HEAD):
                    if final:  # an unfinished call: its text stays content
                        content, self._buffer = content + OPEN + self._buffer, ""
                    break
                deltas.append(self._open_call(self._buffer[len(HEAD) : end]))
                self._buffer, self._state = self._buffer[end + len(NAME_END) :], "args"
            else:
                at = self._buffer.find(TERM)
                done = at >= 0
                cut = at if done else len(self._buffer) - (0 if final else held(self._buffer, TERM))
                piece = self._buffer[:cut]
                if piece:
                    self.calls[-1]["function"]["arguments"] += piece
                    deltas.append(CallDelta(len(self.calls) - 1, piece))
                self._buffer = self._buffer[cut + (len(TERM) if done else 0) :]
                if not done:
                    break
                self._state = "text"
        if not self.text_content:
            content = ""
        return content, _merged(deltas)


def held(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (it may yet become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _merged(deltas: list[CallDelta]) -> list[CallDelta]:
    """Argument pieces of the same call in one update joined (fewer, larger stream chunks)."""
    out: list[CallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1] = CallDelta(d.index, out[-1].arguments + d.arguments, out[-1].id, out[-1].name)
        else:
            out.append(d)
    return out
