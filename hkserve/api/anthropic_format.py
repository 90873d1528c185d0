"""Anthropic Messages API shapes: the Message object and its stream events (message_start, ping,
content_block_start / _delta / _stop, message_delta, message_stop). Content blocks come from
items.py's ItemBuilder: a text block for text, a tool_use block per tool call."""

from __future__ import annotations

import json
import uuid

from hkserve.api.anthropic_errors import anthropic_body
from hkserve.api.generation import Generation, Update
from hkserve.api.items import Item, ItemBuilder, Step
from hkserve.api.protocol import APIError
from hkserve.api.reply import Markers
from hkserve.api.tools import Tools


class MessagesFormat:
    def __init__(self, model: str, tools: Tools | None, markers: Markers = Markers()):
        """`markers`: special-token markers the parser reads and the content hides (reply.py)."""
        self.model = model
        self.id = "msg_" + uuid.uuid4().hex
        self.builder = ItemBuilder(tools, markers)

    def _stop(self, gen: Generation) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence) once the reply ended."""
        choice = gen.choices[0]
        if choice.finish_reason is None:
            return None, None
        if choice.finish_reason == "length":
            return "max_tokens", None
        if choice.completion.stop_sequence is not None:
            return "stop_sequence", choice.completion.stop_sequence
        return ("tool_use" if self.builder.calls else "end_turn"), None

    @staticmethod
    def _block(item: Item, whole: bool) -> dict:
        if item.kind == "call":
            return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": _input(item) if whole else {}}
        return {"type": "text", "text": item.text if whole else ""}

    def message(self, gen: Generation, content: list[dict]) -> dict:
        reason, sequence = self._stop(gen)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": _output_tokens(gen)},
        }

    def final(self, gen: Generation, per_choice: list[list[Update]]) -> dict:
        self.builder.feed("".join(u.text for u in per_choice[0]), final=True)
        return self.message(gen, [self._block(i, True) for i in self.builder.items])

    def chunks(self, gen: Generation, update) -> list[dict]:
        """Events for the start (update None), one update, or the end (update "usage")."""
        if update is None:
            start = self.message(gen, [])
            start["usage"]["output_tokens"] = 0
            return [{"type": "message_start", "message": start}, {"type": "ping"}]
        if update == "usage":
            reason, sequence = self._stop(gen)
            usage = {"output_tokens": _output_tokens(gen)}
            delta = {"stop_reason": reason, "stop_sequence": sequence}
            return [{"type": "message_delta", "delta": delta, "usage": usage}, {"type": "message_stop"}]
        steps = self.builder.feed(update.text, final=update.finish_reason is not None)
        return [self._event(step) for step in steps]

    def _event(self, step: Step) -> dict:
        if step.kind == "open":
            return {"type": "content_block_start", "index": step.index, "content_block": self._block(step.item, False)}
        if step.kind == "close":
            return {"type": "content_block_stop", "index": step.index}
        if step.item.kind == "call":
            delta = {"type": "input_json_delta", "partial_json": step.piece}
        else:
            delta = {"type": "text_delta", "text": step.piece}
        return {"type": "content_block_delta", "index": step.index, "delta": delta}

    @staticmethod
    def error(e: APIError) -> dict:
        return anthropic_body(e)


def _output_tokens(gen: Generation) -> int:
    return sum(c.completion.tokens for c in gen.choices)


def _input(item: Item) -> dict:
    """A call's arguments as the tool_use block's input; {} for a call cut off by max_tokens (its
    arguments are then not whole JSON: the stop_reason says so)."""
    try:
        value = json.loads(item.text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}
