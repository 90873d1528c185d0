"""OpenAI Responses API shapes: the Response object and its typed stream events (response.created,
response.in_progress, output_item.added, content_part.added, output_text.delta, ... response.completed),
each with its sequence_number. Output items come from items.py's ItemBuilder: a message item for
text, a function_call item per tool call."""

from __future__ import annotations

import time
import uuid

from hkserve.api.generation import Generation, Update
from hkserve.api.items import Item, ItemBuilder, Step
from hkserve.api.protocol import APIError
from hkserve.api.reply import Markers
from hkserve.api.response_store import ResponseStore
from hkserve.api.responses_request import ResponsesRequest, output_messages
from hkserve.api.tools import Tools


class ResponsesFormat:
    def __init__(
        self,
        model: str,
        body: ResponsesRequest,
        tools: Tools | None,
        store: ResponseStore,
        conversation: list[dict],  # the input as chat messages, with the previous responses' (no instructions)
        markers: Markers = Markers(),  # special-token markers the parser reads and the output hides
    ):
        self.model, self.body, self.tools, self.store, self.conversation = model, body, tools, store, conversation
        self.id = "resp_" + uuid.uuid4().hex
        self.created_at = time.time()
        self.sequence = 0
        self.builder = ItemBuilder(tools, markers)
        self.status = "in_progress"

    # -- the Response object ---------------------------------------------------------------------------
    def response(self, gen: Generation, output: list[dict], finished: bool) -> dict:
        b = self.body
        incomplete = finished and any(c.finish_reason == "length" for c in gen.choices)
        status = ("incomplete" if incomplete else "completed") if finished else "in_progress"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tool_choice": self._tool_choice(),
            "tools": [{"parameters": None, "strict": None, "description": None, **t} for t in b.tools or []],
            "text": b.echoed_text(),
            "truncation": "disabled",
            "metadata": b.metadata or {},
            "usage": self._usage(gen) if finished else None,
        }

    def _tool_choice(self):
        choice = self.body.tool_choice
        return choice if choice is not None else ("auto" if self.body.tools else "none")

    @staticmethod
    def _usage(gen: Generation) -> dict:
        u = gen.usage()
        cached = u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        }

    def _item(self, item: Item, status: str) -> dict:
        if item.kind == "call":
            return {
                "id": "fc_" + item.key,
                "type": "function_call",
                "status": status,
                "call_id": item.call_id,
                "name": item.name,
                "arguments": item.text if status != "in_progress" else "",
            }
        content = [self._part(item.text)] if status != "in_progress" else []
        return {"id": "msg_" + item.key, "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def _part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _item_status(self, gen: Generation) -> str:
        return "incomplete" if any(c.finish_reason == "length" for c in gen.choices) else "completed"

    def _finish(self, gen: Generation) -> dict:
        """The finished Response; its conversation kept for previous_response_id when `store`."""
        status = self._item_status(gen)
        output = [self._item(i, status) for i in self.builder.items]
        if self.body.store:
            text = "".join(i.text for i in self.builder.items if i.kind == "text")
            calls = [(i.call_id, i.name, i.text) for i in self.builder.calls]
            self.store.put(self.id, self.conversation + output_messages(text, calls))
        return self.response(gen, output, True)

    # -- whole body and stream ----------------------------------------------------------------------
    def final(self, gen: Generation, per_choice: list[list[Update]]) -> dict:
        self.builder.feed("".join(u.text for u in per_choice[0]), final=True)
        return self._finish(gen)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def chunks(self, gen: Generation, update) -> list[dict]:
        """Events for the start (update None), one update, or the end (update "usage")."""
        if update is None:
            head = self.response(gen, [], False)
            return [self._event("response.created", response=head), self._event("response.in_progress", response=head)]
        if update == "usage":
            final = self._finish(gen)
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            return [self._event(kind, response=final)]
        steps = self.builder.feed(update.text, final=update.finish_reason is not None)
        status = self._item_status(gen)
        return [event for step in steps for event in self._step_events(step, status)]

    def _step_events(self, step: Step, status: str) -> list[dict]:
        item, at = step.item, {"output_index": step.index}
        if item.kind == "call":
            ref = {"item_id": "fc_" + item.key, **at}
            if step.kind == "open":
                return [self._event("response.output_item.added", item=self._item(item, "in_progress"), **at)]
            if step.kind == "delta":
                return [self._event("response.function_call_arguments.delta", delta=step.piece, **ref)]
            return [
                self._event("response.function_call_arguments.done", arguments=item.text, **ref),
                self._event("response.output_item.done", item=self._item(item, status), **at),
            ]
        ref = {"item_id": "msg_" + item.key, **at, "content_index": 0}
        if step.kind == "open":
            return [
                self._event("response.output_item.added", item=self._item(item, "in_progress"), **at),
                self._event("response.content_part.added", part=self._part(""), **ref),
            ]
        if step.kind == "delta":
            return [self._event("response.output_text.delta", delta=step.piece, logprobs=[], **ref)]
        return [
            self._event("response.output_text.done", text=item.text, logprobs=[], **ref),
            self._event("response.content_part.done", part=self._part(item.text), **ref),
            self._event("response.output_item.done", item=self._item(item, status), **at),
        ]

    def error(self, e: APIError) -> dict:
        """A failure mid-stream as the Responses API's error event."""
        return self._event("error", code=e.code or e.type, message=e.message, param=e.param)
