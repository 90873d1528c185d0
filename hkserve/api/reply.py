"""One reply's text split into what a client gets: reasoning, content and tool calls. The reasoning
parser takes the text first; the tool-call parser reads only the answer after it. Fed as the text
comes (`final` on the last piece), so a streamed reply splits exactly as the whole one.

Markers the parsers read may be special tokens (Mistral's `[TOOL_CALLS]`, Llama 3.1's `<|python_tag|>`),
which a decode skips: Markers names them, so the detokenizer writes them out for the parsers and the
parts a client sees drop them again."""

from __future__ import annotations

from typing import NamedTuple

from hkserve.api.reasoning import END, START, ReasoningParser
from hkserve.api.tool_parsers import make_parser
from hkserve.api.tools import CallDelta, Tools
from hkserve.checkpoint.tokenizer import Tokenizer


class Markers(NamedTuple):
    """The active parsers' markers that are special tokens of the model's tokenizer."""

    ids: frozenset[int] = frozenset()  # written out by the detokenizer (Completion's `keep`)
    texts: tuple[str, ...] = ()  # dropped from reasoning and content

    @classmethod
    def of(cls, tokenizer: Tokenizer, tools: Tools | None, reasoning: str | None = None) -> Markers:
        found = dict(tools.special) if tools is not None and tools.active else {}
        for text in (START, END) if reasoning else ():
            if tokenizer.special_id(text) is not None:
                found[text] = tokenizer.special_id(text)
        return cls(frozenset(found.values()), tuple(found))

    def hide(self, text: str) -> str:
        """`text` without the markers, as a decode that skips special tokens writes it."""
        for marker in self.texts:
            text = text.replace(marker, "")
        return text


class ReplyParts(NamedTuple):
    reasoning: str
    content: str
    calls: list[CallDelta]


class ReplyParser:
    def __init__(self, reasoning: str | None, tools: Tools | None, markers: Markers = Markers()):
        self.markers = markers
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
        return ReplyParts(self.markers.hide(reasoning), self.markers.hide(content), calls)
