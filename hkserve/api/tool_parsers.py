"""The tool-call formats of the families served, as parsers of the model's text (`--tool-call-parser`):

- hermes (Hermes, Qwen2.5, SmolLM3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  tools.ToolCallParser, which streams a call's arguments as they come;
- llama3_json (Llama 3.1-3.3): a reply that is `{"name": ..., "parameters": {...}}` (after
  `<|python_tag|>` or alone), several joined by `;`;
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` once per call;
- qwen3_coder: `<tool_call>\\n<function=name>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`,
  string values as written, others as JSON.

Each parser is fed the reply's text as it comes (`feed(text, final) -> (content, call deltas)`); the
block formats stream content up to the call marker and give each call whole, in one delta, once the
reply ends. Text that does not parse as calls stays content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hkserve.api.tools import CallDelta, CallParser, ToolCallParser, Tools, held, parse_tools
from hkserve.checkpoint.tokenizer import Tokenizer

FORMATS = ("hermes", "llama3_json", "mistral", "qwen3_coder")
CHOICES = ("auto", *FORMATS)
PYTHON_TAG, TOOL_CALLS, ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
MARKERS = {  # per format, the marker texts its parser reads (a tokenizer may have them as special tokens)
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": (PYTHON_TAG,),
    "mistral": (TOOL_CALLS, ARGS),
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
}
QWEN_CALL = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>\n?(.*?)</function>\s*</tool_call>", re.S)
QWEN_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
Parsed = list[tuple[str, dict]]  # (name, arguments) per call


@dataclass(kw_only=True)
class BlockParser(CallParser):
    """Content until a call marker (or, for `at_start`, an opening at the reply's start), then calls
    parsed once the reply is whole."""

    parse: Callable[[str], Parsed | None]
    markers: tuple[str, ...]
    at_start: tuple[str, ...] = ()
    _state: str = "start"  # start | text | calls

    def feed(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        content, deltas = "", []
        if self._state == "start":
            head = self._buffer.lstrip()
            if head.startswith(self.at_start) and self.at_start:
                self._state = "calls"
            elif not final and (not head or any(m.startswith(head) for m in self.at_start)):
                return "", []
            else:
                self._state = "text"
        if self._state == "text":
            found = [i for i in (self._buffer.find(m) for m in self.markers) if i >= 0]
            if found:
                content, self._buffer, self._state = self._buffer[: min(found)], self._buffer[min(found) :], "calls"
            else:
                keep = 0 if final else max(held(self._buffer, m) for m in self.markers)
                content = self._buffer[: len(self._buffer) - keep]
                self._buffer = self._buffer[len(content) :]
        if self._state == "calls" and final:
            parsed = self.parse(self._buffer)
            if parsed is None:  # not calls after all: the text stays the reply's
                content += self._buffer
            deltas = [self._open_call(name, json.dumps(args, ensure_ascii=False)) for name, args in parsed or []]
            self._buffer = ""
        return (content if self.text_content else ""), deltas


def _json_values(text: str, separators: str) -> list | None:
    """The JSON values `text` holds one after another (apart from whitespace and `separators`)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return out
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        out.append(value)


def _named(value, args_key: str) -> tuple[str, dict] | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(args_key, value.get("arguments", {}))
    return (value["name"], args) if isinstance(args, dict) else None


def _all(items: list) -> Parsed | None:
    return None if not items or None in items else items


def parse_llama3(text: str) -> Parsed | None:
    values = _json_values(text.strip().removeprefix(PYTHON_TAG), ";")
    return _all([_named(v, "parameters") for v in values]) if values is not None else None


def parse_mistral(text: str) -> Parsed | None:
    out: list = []
    for block in text.strip().split(TOOL_CALLS)[1:]:
        block = block.strip()
        if block.startswith("["):  # [{"name": ..., "arguments": ...}, ...]
            values = _json_values(block, "")
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return None
            out += [_named(v, "arguments") for v in values[0]]
            continue
        name, sep, rest = block.partition(ARGS)
        values = _json_values(rest, "") if sep else None
        if not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        out.append((name.strip(), values[0]))
    return _all(out) if not text.strip().split(TOOL_CALLS)[0] else None


def qwen3_coder_parser(functions: dict[str, dict]) -> Callable[[str], Parsed | None]:
    """Qwen3-Coder's calls, their string values as written and the rest read as JSON by the schema."""

    def parse(text: str) -> Parsed | None:
        out, at = [], 0
        for match in QWEN_CALL.finditer(text):
            if match.start() != at:
                return None
            name, body = match.group(1).strip(), match.group(2)
            props = (functions.get(name, {}).get("parameters") or {}).get("properties") or {}
            args = {
                p.group(1).strip(): _value(p.group(2), props.get(p.group(1).strip())) for p in QWEN_PARAM.finditer(body)
            }
            out.append((name, args))
            at = match.end()
        return out if out and not text[at:].strip() else None

    return parse


def _value(text: str, schema: dict | None):
    if isinstance(schema, dict) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def make_parser(fmt: str, functions: dict[str, dict], text_content: bool):
    """A fresh parser of format `fmt` for one reply."""
    if fmt == "hermes":
        return ToolCallParser(text_content=text_content)
    if fmt == "llama3_json":
        return BlockParser(
            parse=parse_llama3, markers=(PYTHON_TAG,), at_start=("{", PYTHON_TAG), text_content=text_content
        )
    if fmt == "mistral":
        return BlockParser(parse=parse_mistral, markers=(TOOL_CALLS,), text_content=text_content)
    return BlockParser(parse=qwen3_coder_parser(functions), markers=("<tool_call>",), text_content=text_content)


def special_tokens(tokenizer: Tokenizer, fmt: str) -> dict[str, int]:
    """The markers of format `fmt` that are special tokens of `tokenizer`, and their ids (Tools.special:
    the grammar writes them as tokens, the detokenizer keeps them for the parser)."""
    found = {marker: tokenizer.special_id(marker) for marker in MARKERS[fmt]}
    return {marker: i for marker, i in found.items() if i is not None}


def model_tools(tokenizer: Tokenizer, fmt: str, tools: Any, choice: Any, parallel: Any) -> Tools | None:
    """A request's tools written in the model's call format `fmt`, its markers that are special tokens
    as those tokens (a grammar that spelled one as text would ban the token the model writes it with).
    The chat routes and `hkserve sample` alike; raises FieldError as parse_tools does."""
    return parse_tools(tools, choice, parallel, fmt, special_tokens(tokenizer, fmt))


def detect(template: str | None) -> str:
    """The format a chat template writes calls in (`--tool-call-parser auto`); hermes when unknown."""
    template = template or ""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if TOOL_CALLS in template:
        return "mistral"
    if PYTHON_TAG in template or '"parameters": ' in template:
        return "llama3_json"
    return "hermes"


def choose(name: str, template: str | None) -> str:
    if name not in CHOICES:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(CHOICES)}, got {name!r}")
    return detect(template) if name == "auto" else name
