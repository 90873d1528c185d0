"""A request as the runner takes it, and the stream of its events as its consumer reads them (blocking
iteration, or `async for` on an asyncio loop, woken once per decode step through handoff.py)."""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from hkserve.engine.constrained import Grammar
from hkserve.engine.handoff import mailbox_for
from hkserve.engine.outputs import ScoredToken, Token
from hkserve.model.sampling import SamplingParams


class Overloaded(RuntimeError):
    """The admission queue is full: try again later (HTTP 429)."""


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # default: greedy
    stop_ids: tuple[int, ...] = ()  # finishing tokens (EOS and any stop token ids)
    logprobs: int = 0  # top alternatives wanted per token
    prompt_logprobs: int | None = None  # score the prompt, with this many top alternatives per token
    grammar: Grammar | None = None  # the output must match it (structured outputs, tool calls)
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    submitted_at: float = field(default_factory=time.monotonic)


class Event(NamedTuple):
    """One generated token, the scored prompt (first, when asked for), or the end of a request
    (finish_reason set: stop | length | cancelled | error)."""

    request_id: str
    token: Token | None
    finish_reason: str | None = None
    error: str | None = None
    prompt: list[ScoredToken] | None = None  # prompt tokens 1.. (the first cannot be scored)
    error_public: bool = False  # the error is the server's state (an abort: a lost host), for clients to see


class RequestStream:
    """The events of one request in order; the last one has `finish_reason`.

    Blocking iteration (`for event in stream`) or asyncio (`async for`), when created with a loop."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.loop = loop
        self.admitted_at: float | None = None
        self.cached_tokens: int | None = None  # prompt tokens whose KV was reused (None: not looked up)
        self.order = 0  # arrival order (the runner's count at submit): the older runs first when blocks run out
        self.generated: list[int] = []  # tokens delivered: a preempted request recomputes prompt + these
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._mailbox = mailbox_for(loop) if loop else None  # one loop wake-up per step (handoff.py)
        self.done = False  # set, under the runner's lock, once the final event is pushed

    def push(self, event: Event) -> None:
        if self._mailbox is not None:
            self._mailbox.post(self._async, event)
        else:
            self._sync.put(event)

    def __iter__(self):
        while True:
            event = self._sync.get()
            yield event
            if event.finish_reason is not None:
                return

    async def __aiter__(self):
        while True:
            event = await self._async.get()
            yield event
            if event.finish_reason is not None:
                return
