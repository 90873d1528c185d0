"""One reply's text split into what a client gets: reasoning, content and tool calls. The reasoning
parser takes the text first; the tool-call parser reads only the answer after it. Fed as the text
comes (`final` on the last piece), so a streamed reply splits exactly as the whole one."""

from __future__ import annotations

from typing import NamedTuple

from hkserve.api.reasoning import ReasoningParser
from hkserve.api.tool_parsers import make_parser
from hkserve.api.tools import CallDelta, Tools


class ReplyParts(NamedTuple):
    reasoning: str
    content: str
    calls: list[CallDelta]


class ReplyParser:
    def __init__(self, reasoning: str | None, tools: Tools | None):
        self.reasoning = ReasoningParser.named(reasoning) if reasoning else None
        text_content = tools is None or tools.choice == "auto"
        self.tools = make_parser(tools.format, tools.functions, text_content) if tools is not None else None
        self.text = ""  # everything fed

    @property
    def calls(self) -> list[dict]:
        return self.tools.calls if self.tools is not None else []

    @property
    def reasoning_text(self) -> str:
        """The output up to and including `</think>` (what reasoning_tokens counts)."""
        return self.text[: self.reasoning.reasoning_chars] if self.reasoning is not None else ""

    def feed(self, text: str, final: bool = False) -> ReplyParts:
        self.text += text
        reasoning, content = self.reasoning.feed(text, final) if self.reasoning is not None else ("", text)
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content, final)
        return ReplyParts(reasoning, content, calls)
