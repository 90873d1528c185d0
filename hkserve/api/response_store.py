"""The Responses API's `previous_response_id`: each stored response's conversation (its input and its
reply, as chat messages), in memory, bounded by count and by bytes, least recently used out first.

A lost response (evicted, or from before a restart) is a 400 naming previous_response_id."""

from __future__ import annotations

import json
from collections import OrderedDict

from hkserve.api.protocol import APIError

MAX_RESPONSES = 1024  # responses kept
MAX_BYTES = 64 * 2**20  # their conversations' JSON, in bytes (a larger one alone is not kept)


class ResponseStore:
    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES):
        self.max_responses, self.max_bytes = max_responses, max_bytes
        self._items: OrderedDict[str, tuple[list[dict], int]] = OrderedDict()  # id -> (messages, bytes)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response_id: str, messages: list[dict]) -> None:
        size = len(json.dumps(messages).encode())
        if size > self.max_bytes:
            return
        self._items[response_id] = (messages, size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped

    def get(self, response_id: str) -> list[dict]:
        """The conversation so far (a copy), most recently used now; a 400 when it is not kept."""
        if response_id not in self._items:
            raise APIError(
                400,
                f"Previous response with id '{response_id}' not found (this server keeps the last"
                f" {self.max_responses} responses, up to {self.max_bytes} bytes, in memory)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self._items.move_to_end(response_id)
        return [dict(m) for m in self._items[response_id][0]]
