"""InferenceRunner: continuous batching of requests over the Engine's slots.

Concurrency — who owns what:
  * Any thread (HTTP handlers, the CLI, tests) calls `submit` and `cancel`. `submit` validates and
    puts the request on a bounded queue (full → `Overloaded`); `cancel` records the id under a lock.
  * One background thread, the loop, owns the Engine (all device work), the slot table and every
    request's progress. Nothing else touches them.
  * Results flow back through each request's `RequestStream`, which the loop feeds thread-safely
    and the consumer reads by blocking iteration or `async for`.

The loop runs one step behind the device: it dispatches step n, then reads step n-1's tokens (their
host copy started when they were dispatched), so the device never waits for Python. A request that
ends is noticed one step late; the extra token computed for it is discarded.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from hkserve.engine.engine import DecodeStateLost, Engine, PendingTokens, Token
from hkserve.model.sampling import SamplingParams

log = logging.getLogger("hkserve.runner")


class Overloaded(RuntimeError):
    """The admission queue is full: try again later (HTTP 429)."""


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)  # default: greedy
    stop_ids: tuple[int, ...] = ()  # finishing tokens (EOS and any stop token ids)
    logprobs: int = 0  # top alternatives wanted per token
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    submitted_at: float = field(default_factory=time.monotonic)


class Event(NamedTuple):
    """One generated token, or the end of a request (finish_reason set: stop | length | cancelled | error)."""

    request_id: str
    token: Token | None
    finish_reason: str | None = None
    error: str | None = None


class RequestStream:
    """The events of one request in order; the last one has `finish_reason`.

    Blocking iteration (`for event in stream`) or asyncio (`async for`), when created with a loop."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop | None = None):
        self.request = request
        self.loop = loop
        self.admitted_at: float | None = None
        self._sync: queue.SimpleQueue = queue.SimpleQueue()
        self._async: asyncio.Queue | None = asyncio.Queue() if loop else None
        self.done = False  # set by the loop thread once the final event is pushed

    def push(self, event: Event) -> None:
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._async.put_nowait, event)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                pass
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


class _Slot(NamedTuple):
    stream: RequestStream
    produced: int


class RunnerStats(NamedTuple):
    slots: int
    running: int
    waiting: int


class InferenceRunner:
    def __init__(self, engine: Engine, max_queue: int = 64, prefill_budget: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        # Prompt tokens admitted per loop iteration (at least one request): a burst fills the free
        # slots in a few iterations while running requests wait at most ~one budget of prefill per token.
        self.prefill_budget = prefill_budget
        self._waiting: collections.deque[RequestStream] = collections.deque()  # bounded by max_queue
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # signalled on submit / cancel / stop
        self._slots: list[_Slot | None] = [None] * engine.slots
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()

    # -- any thread -----------------------------------------------------------------------------
    def start(self, warmup: bool = True) -> InferenceRunner:
        if warmup:
            self.engine.warmup()
        self._thread = threading.Thread(target=self._loop, name="hkserve-runner", daemon=True)
        self._thread.start()
        self.ready.set()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop; requests still queued or running end with finish_reason "cancelled"."""
        self._stop.set()
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def abort(self, error: str) -> None:
        """From any thread: the engine can no longer run (a lost host). End every request with
        `error` now: the loop thread may be blocked inside a device call that will never return."""
        self.ready.clear()
        self._stop.set()
        self._fail_all(error)
        with self._wake:
            self._wake.notify()

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue a request. Raises ContextLengthError / ValueError for bad requests, Overloaded when full."""
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        self.engine.check_fits(len(request.prompt_ids), request.max_tokens)
        vocab = self.engine.model.config.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        request.sampling.check_vocab(vocab)
        if request.logprobs > self.engine.n_top:
            raise ValueError(f"at most {self.engine.n_top} top logprobs are available, {request.logprobs} requested")
        if self._stop.is_set():
            raise Overloaded("the runner is shutting down")
        stream = RequestStream(request, loop)
        with self._wake:
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"the admission queue is full ({self.max_queue} waiting)")
            self._waiting.append(stream)
            self._wake.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        """End a request: a waiting one leaves the queue now (its place is free for the next submit), a
        running one frees its slot at the next step. A no-op for finished requests."""
        with self._wake:
            waiting = next((s for s in self._waiting if s.request.id == request_id), None)
            if waiting is not None:
                self._waiting.remove(waiting)
                waiting.done = True
            else:
                self._cancelled.add(request_id)
                self._wake.notify()
        if waiting is not None:
            waiting.push(Event(request_id, None, "cancelled"))

    def stats(self) -> RunnerStats:
        return RunnerStats(self.engine.slots, sum(s is not None for s in self._slots), len(self._waiting))

    def generate(self, request: Request) -> list[Token]:
        """Blocking convenience: submit and collect the tokens."""
        tokens = []
        for event in self.submit(request):
            if event.error:
                raise RuntimeError(event.error)
            if event.token is not None:
                tokens.append(event.token)
        return tokens

    # -- loop thread ----------------------------------------------------------------------------
    def _finish(self, slot: int | None, stream: RequestStream, reason: str, error: str | None = None) -> None:
        if not stream.done:
            stream.done = True
            stream.push(Event(stream.request.id, None, reason, error))
        if slot is not None:
            self._slots[slot] = None

    def _sweep_cancelled(self) -> None:
        """End cancelled requests: running ones free their slot, waiting ones leave the queue."""
        with self._lock:
            if not self._cancelled:
                return
            cancelled = set(self._cancelled)
            dropped = [s for s in self._waiting if s.request.id in cancelled]
            self._waiting = collections.deque(s for s in self._waiting if s.request.id not in cancelled)
        for stream in dropped:
            self._finish(None, stream, "cancelled")
        for i, s in enumerate(self._slots):
            if s is not None and s.stream.request.id in cancelled:
                self._finish(i, s.stream, "cancelled")
        with self._lock:  # every such request has ended now (or never existed)
            self._cancelled -= cancelled

    def _admit(self) -> list[tuple[int, RequestStream, PendingTokens]]:
        admitted = []
        free = [i for i, s in enumerate(self._slots) if s is None]
        spent = 0
        while free and (not admitted or spent < self.prefill_budget):
            with self._lock:
                if not self._waiting:
                    break
                stream = self._waiting.popleft()
            slot = free.pop(0)
            request = stream.request
            spent += len(request.prompt_ids)
            stream.admitted_at = time.monotonic()
            try:
                pending = self.engine.prefill(slot, request.prompt_ids, request.sampling)
            except Exception as e:  # this request only: its slot stays free, the others go on
                if not isinstance(e, ValueError):
                    log.exception("prefill of request %s failed", request.id)
                self._finish(None, stream, "error", f"the request could not be started: {e}")
                if isinstance(e, DecodeStateLost):
                    raise  # every slot's state went with it: the loop fails the others and resets
                continue
            self._slots[slot] = _Slot(stream, 0)
            admitted.append((slot, stream, pending))
        return admitted

    def _emit(self, slot: int, stream: RequestStream, token: Token) -> None:
        """Deliver one token of the request in `slot`; finish it on a stop id or max_tokens."""
        if stream.done or self._slots[slot] is None or self._slots[slot].stream is not stream:
            return  # finished (or cancelled) while this token was in flight: discard
        request = stream.request
        produced = self._slots[slot].produced + 1
        self._slots[slot] = _Slot(stream, produced)
        top = token.top[: request.logprobs]
        stream.push(Event(request.id, Token(token.id, token.logprob, top)))
        if token.id in request.stop_ids:
            self._finish(slot, stream, "stop")
        elif produced >= request.max_tokens:
            self._finish(slot, stream, "length")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve()
            except Exception as e:  # a device failure: fail everything, go on from a clean state
                log.exception("runner loop failed")
                self._fail_all(f"internal error: {type(e).__name__}: {e}")
                self.engine.reset()
        self._fail_all(None)

    def _serve(self) -> None:
        # Each entry: (owners [(slot, stream)], pending tokens, rows indexed by slot?)
        in_flight: list[tuple[list[tuple[int, RequestStream]], PendingTokens, bool]] = []
        while not self._stop.is_set():
            self._sweep_cancelled()
            dispatched = [([(slot, stream)], pending, False) for slot, stream, pending in self._admit()]
            active = np.asarray([s is not None for s in self._slots])
            if active.any():
                owners = [(i, s.stream) for i, s in enumerate(self._slots) if s is not None]
                dispatched.append((owners, self.engine.step(active), True))
            for owners, pending, by_slot in in_flight:  # the previous iteration's results
                tokens = pending.read()
                for slot, stream in owners:
                    self._emit(slot, stream, tokens[slot] if by_slot else tokens[0])
            in_flight = dispatched
            if not in_flight:
                with self._wake:  # idle: sleep until a submit, cancel or stop
                    if not self._waiting and not self._cancelled and not self._stop.is_set():
                        self._wake.wait(timeout=1.0)

    def _fail_all(self, error: str | None) -> None:
        reason = "error" if error else "cancelled"
        for i, s in enumerate(self._slots):
            if s is not None:
                self._finish(i, s.stream, reason, error)
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for stream in waiting:
            self._finish(None, stream, reason, error)
