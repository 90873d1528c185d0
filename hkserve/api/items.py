"""A chat reply as output items, incrementally: text and tool calls, in the order the model wrote them.

The Responses and Anthropic Messages formats turn the same steps into their own stream events, and
build their whole bodies from the same steps over the whole text, so a streamed reply reassembles to
exactly the whole one. Tool calls are read by tool_parsers.make_parser's parser (the format the grammar and
the prompt use)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from hkserve.api.reply import Markers
from hkserve.api.tool_parsers import make_parser
from hkserve.api.tools import Tools


@dataclass
class Item:
    kind: str  # "text" | "call"
    text: str = ""  # the text, or the call's arguments (JSON text) so far
    call_id: str = ""  # a call's id (the parser's "call_...")
    name: str = ""  # a call's function
    key: str = field(default_factory=lambda: uuid.uuid4().hex[:24])  # the item's own id, prefixed by each format


class Step(NamedTuple):
    kind: str  # "open" | "delta" | "close"
    index: int  # the item's position in the output
    item: Item
    piece: str = ""  # a delta's new text or argument text


class ItemBuilder:
    """Feeds the model's text in; gives back the steps that open, extend and close output items.

    With tools on, whitespace between calls is held until text follows it, so no item is only
    whitespace; without tools every character is text."""

    def __init__(self, tools: Tools | None, markers: Markers = Markers()):
        self.markers = markers  # special-token markers the parser reads and no item shows (reply.py)
        active = tools is not None and tools.active
        # the model's own call format (--tool-call-parser), as the chat route reads it
        self.parser = make_parser(tools.format, tools.functions, tools.choice == "auto") if active else None
        self.items: list[Item] = []
        self._open: Item | None = None
        self._pending = ""  # whitespace held while tools are on

    def feed(self, text: str, final: bool = False) -> list[Step]:
        content, deltas = self.parser.feed(text, final) if self.parser is not None else (text, [])
        steps = self._text(self.markers.hide(content))
        for d in deltas:
            if d.id is not None:
                steps += self._close()
                self._open = Item("call", call_id=d.id, name=d.name or "")
                self.items.append(self._open)
                steps.append(Step("open", len(self.items) - 1, self._open))
            if d.arguments:
                self._open.text += d.arguments
                steps.append(Step("delta", len(self.items) - 1, self._open, d.arguments))
        if final:
            steps += self._close()
        return steps

    def _text(self, content: str) -> list[Step]:
        if self.parser is not None:
            content, self._pending = self._pending + content, ""
            if not content.strip():
                self._pending = content
                return []
        if not content:
            return []
        steps = []
        if self._open is None or self._open.kind != "text":
            steps += self._close()
            self._open = Item("text")
            self.items.append(self._open)
            steps.append(Step("open", len(self.items) - 1, self._open))
        self._open.text += content
        steps.append(Step("delta", len(self.items) - 1, self._open, content))
        return steps

    def _close(self) -> list[Step]:
        if self._open is None:
            return []
        item, self._open = self._open, None
        return [Step("close", self.items.index(item), item)]

    @property
    def calls(self) -> list[Item]:
        return [i for i in self.items if i.kind == "call"]
