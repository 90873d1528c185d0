"""InferenceRunner: continuous batching of requests over the Engine's slots.

Concurrency — who owns what:
  * Any thread (HTTP handlers, the CLI, tests) calls `submit`, `cancel`, `abort` and `stats`.
    `submit` validates and appends the request to the admission queue `_waiting` (bounded, full →
    `Overloaded`); `cancel` ends a request still in `_waiting` at once (it holds no slot, so its
    queue place is free for the next submit) and otherwise records the id in `_cancelled`; `abort`
    records its error and stops the loop. These three only touch `_waiting`, `_open`, `_cancelled`
    and the abort error under `_lock`, then wake the loop. `stats` reads `_stats`, an immutable
    snapshot the loop publishes after each iteration.
  * One background thread, the loop, owns the Engine (all device work), the slot table `_slots`, the
    in-flight device results and every request's progress; it alone takes requests off `_waiting` and
    ends requests: finished, cancelled, or failed when the runner is aborted or stopped.
  * One exception, for a loop that cannot answer: when the loop thread is still inside a device call
    `abort_grace_s` after an abort (a lost host's collective never returns), `abort` ends the requests
    still open itself, through `_open` (never through `_slots` or `_waiting`). A request's final event
    is pushed once, under `_lock`, by whichever comes first.
  * Results flow back through each request's `RequestStream`, which the loop feeds thread-safely
    and the consumer reads by blocking iteration or `async for`.

Admission (queued requests into free slots, their prefills dispatched) is the loop's other half, in
admission.py; a long prompt's prefill goes a few chunks per pass, within the pass's token budget
(`max_step_tokens`), while the running requests keep getting a token every pass. Under the paged KV
layout each pass first makes its step's blocks fit (preemption.py, applying the pure policy of
scheduler.py): the newest running requests may go back to the queue's front, to resume later from
their prompt and generated tokens.

The loop runs one step behind the device: it dispatches step n, then reads step n-1's tokens (their
host copy started when they were dispatched), so the device never waits for Python. A request that
ends is noticed one step late; the extra token computed for it is discarded.

Grammar-constrained requests (structured outputs, tool calls) need each token's mask before it is
sampled, and the mask depends on the token before. A step with a constrained row is split: the loop
dispatches the model half, then reads the previous tokens (and this pass's prefills) and advances the
matchers while the device runs it, then dispatches the sampling half with the masks (on the CPU the
engine runs both halves as one program at that point: Engine.split_masks). Steps with no constrained
row are unchanged (see constrained.py).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
from collections.abc import Callable

import jax
import numpy as np

from hkserve.engine.admission import Admission, InFlight, SlotState
from hkserve.engine.constrained import SlotGrammars
from hkserve.engine.outputs import ScoredToken, Token
from hkserve.engine.preemption import Preemption
from hkserve.engine.prefill_job import PrefillJob
from hkserve.engine.prefix_cache import PrefixCache
from hkserve.engine.protocols import RunnerStats, ServingEngine
from hkserve.engine.requests import Event, Overloaded, Request, RequestStream
from hkserve.engine.scheduler import Scheduler, StepBudget, default_step_budget
from hkserve.engine.spec_policy import SpecCounts
from hkserve.engine.state import check_max_tokens

log = logging.getLogger("hkserve.runner")


class InferenceRunner(Admission, Preemption):
    """The API's ServingRunner (protocols.py) over any ServingEngine."""

    def __init__(self, engine: ServingEngine, max_queue: int = 64, max_step_tokens: int | None = None):
        """`max_step_tokens`: the tokens one pass carries, its decode rows' and its prompt chunks' (padded)
        together (admission.py); None: the backend's default (scheduler.py: on the CPU a chunk that grows
        with the rows, at least 32 tokens; else slots + 512)."""
        self.engine = engine
        self.max_queue = max_queue
        self.vocab_size = engine.vocab_size
        if max_step_tokens is not None and max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be at least 1, got {max_step_tokens}")
        self.step_budget = (
            StepBudget(max_step_tokens) if max_step_tokens else default_step_budget(engine.slots, jax.default_backend())
        )
        # the chunk sizes its budget may cut prompts into: warm-up compiles their programs
        engine.chunk_sizes = Scheduler.chunk_sizes(engine.prefill_buckets, self.step_budget, engine.slots)
        # Shared with the other threads, under _lock:
        self._waiting: collections.deque[RequestStream] = collections.deque()  # bounded by max_queue
        self._open: set[RequestStream] = set()  # submitted and not yet ended
        self._cancelled: set[str] = set()
        self._abort_error: str | None = None  # set once by abort: every request ends with it
        self._arrivals = itertools.count()  # each submitted request's arrival order (RequestStream.order)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # signalled on submit / cancel / stop / abort
        # The loop's own (see the module docstring):
        self._slots: list[SlotState | None] = [None] * engine.slots
        self._prefills: dict[int, PrefillJob] = {}  # slots whose prompt is still prefilling, pass by pass
        self._in_flight: list[InFlight] = []  # the last pass's dispatched device work, read next pass
        self._prompt_only: list[RequestStream] = []  # prefilled for their prompt's scores, in no slot
        self.preemptions = 0  # requests preempted so far (paged layout: preemption.py)
        self.grammars = SlotGrammars(engine.slots, engine.vocab_size)  # constrained slots
        # What each slot's memory holds, and where prompts go (mode "off": the first free slot).
        self.prefix = PrefixCache(engine.slots, engine.prefix_cache, granule=engine.prefill_chunk or 1)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.ready = threading.Event()
        self.abort_grace_s = 1.0  # how long abort waits for the loop before ending requests itself
        self._stats: RunnerStats  # replaced (never mutated) by the loop
        self._publish_stats()

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
        with self._wake:
            self._stop.set()
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def abort(self, error: str) -> None:
        """The engine can no longer run (a lost host): stop taking requests and have the loop end every
        queued and running one with `error`. Waits for the loop thread up to abort_grace_s; if it is
        stuck in a device call, ends the open requests itself (see the module docstring)."""
        self.ready.clear()
        with self._wake:
            if self._abort_error is None:
                self._abort_error = error
            self._stop.set()
            self._wake.notify()
        loop = self._thread
        if loop is None or loop is threading.current_thread():
            return  # not started: whoever drives iterate() ends them
        loop.join(self.abort_grace_s)
        if loop.is_alive():
            log.error("the runner loop is stuck in a device call: ending its requests from the caller")
            with self._lock:
                stuck = list(self._open)
            for stream in stuck:
                self._close(stream, "error", self._abort_error)

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        """Queue a request. Raises ContextLengthError / ValueError for bad requests, Overloaded when full."""
        check_max_tokens(request.max_tokens, scoring=request.prompt_logprobs is not None)
        self.engine.check_fits(len(request.prompt_ids), request.max_tokens)
        vocab = self.engine.vocab_size
        bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        request.sampling.check_vocab(vocab)
        if request.grammar is not None and not self.engine.supports_grammars:
            raise ValueError("structured outputs and tool calls are not supported with --speculative ngram")
        wanted = max(request.logprobs, request.prompt_logprobs or 0)
        if wanted > self.engine.n_top:
            raise ValueError(f"at most {self.engine.n_top} top logprobs are available, {wanted} requested")
        stream = RequestStream(request, loop)
        with self._wake:
            if self._stop.is_set():
                raise Overloaded("the runner is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"the admission queue is full ({self.max_queue} waiting)")
            stream.order = next(self._arrivals)
            self._waiting.append(stream)
            self._open.add(stream)
            self._wake.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        """End a request: a waiting one leaves the queue now (its place is free for the next submit), a
        running one frees its slot at the next step. A no-op for finished requests."""
        with self._wake:
            waiting = next((s for s in self._waiting if s.request.id == request_id), None)
            if waiting is not None:
                self._waiting.remove(waiting)
                self._open.discard(waiting)
                waiting.done = True
            else:
                self._cancelled.add(request_id)
                self._wake.notify()
        if waiting is not None:
            waiting.push(Event(request_id, None, "cancelled"))

    def stats(self) -> RunnerStats:
        """The loop's snapshot as of its last iteration (a request queued since is not counted yet)."""
        return self._stats

    def spec_counts(self) -> SpecCounts | None:
        return self.engine.spec_counts()

    def observe_masks(self, observe: Callable[[float, int], None]) -> None:
        self.grammars.observe = observe

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
    def iterate(self) -> bool:
        """One pass of the loop: end cancelled requests, admit queued ones (prefill), dispatch one step
        for the running slots, deliver the previous pass's tokens, publish stats → whether device work
        is still in flight or a prompt is part way through its chunks (either way the loop must pass
        again at once). Only the loop thread calls it, or a test driving a runner it never started
        (that test's thread is then the loop)."""
        if self._stop.is_set():  # stopped or aborted: end everything
            self._fail_all(self._abort_error)
            self._in_flight = []
            return False
        self._sweep_cancelled()
        self._fit_step()  # paged: the running rows' next blocks, preempting the newest when they run out
        decoding = [i for i, s in enumerate(self._slots) if s is not None and i not in self._prefills]
        admitted = self._admit(self.step_budget.prompt_tokens(len(decoding), self.engine.prefill_buckets))
        dispatched = list(admitted)
        # A slot whose memory is full cannot step: it ends ("length") once its last token is read.
        stepping = [i for i, s in enumerate(self._slots) if s is not None and i not in self._prefills]
        full = [i for i in stepping if self._slots[i].length >= self.engine.max_len]
        active = np.asarray([i in stepping and i not in full for i in range(self.engine.slots)])
        forward = None
        if active.any():
            owners = [(int(i), self._slots[i].stream) for i in np.flatnonzero(active)]
            if self.grammars.constrained(active):
                forward = self.engine.step_forward(active)
            else:
                dispatched.append(InFlight(owners, self.engine.step(active), True))
            for i, _ in owners:
                self._slots[i] = self._slots[i]._replace(length=self._slots[i].length + 1)
        for flight in self._in_flight:  # the previous iteration's results
            self._deliver(flight)
        if forward is not None:  # the masks need every token so far, this pass's first tokens too
            for flight in admitted:
                self._deliver(flight)
                dispatched.remove(flight)
            masks = self.grammars.masks(self._remaining())
            dispatched.append(InFlight(owners, self.engine.step_sample(forward, masks), True))
        just_admitted = {slot for flight in admitted for slot, _ in flight.owners}
        for i in full:
            s = self._slots[i]
            if s is not None and i not in just_admitted:
                log.warning("request %s filled its slot's context (%d tokens)", s.stream.request.id, s.length)
                self._finish(i, s.stream, "length")
        self._in_flight = dispatched
        self._publish_stats()
        return bool(self._in_flight or self._prefills)  # a prompt part way through its chunks needs more passes

    def _remaining(self) -> np.ndarray:
        """[B] tokens each slot may still emit, the one this step samples included: its max_tokens, and
        its context (a slot's `length` already counts this step's input token)."""
        left = np.zeros(self.engine.slots, np.int64)
        for i, s in enumerate(self._slots):
            if s is not None:
                left[i] = min(s.stream.request.max_tokens - s.produced, self.engine.max_len - s.length + 1)
        return left

    def _deliver(self, flight: InFlight) -> None:
        tokens = flight.pending.read()
        for slot, stream in flight.owners:
            if flight.scores is not None:
                self._emit_prompt(stream, flight.scores.read())
            row = tokens[slot] if flight.by_slot else tokens[0]
            for token in row if isinstance(row, list) else [row]:  # a speculative step's row: a run
                self._emit(slot, stream, token)

    def _publish_stats(self) -> None:
        with self._lock:
            waiting = len(self._waiting)
        pool = self.engine.kv_pool
        blocks = (pool.total, pool.used, pool.block_size) if pool is not None else (0, 0, 0)
        running = sum(s is not None for s in self._slots)
        cached = pool.cached if pool is not None else 0
        self._stats = RunnerStats(self.engine.slots, running, waiting, *blocks, self.preemptions, cached)

    def _finish(self, slot: int | None, stream: RequestStream, reason: str, error: str | None = None) -> None:
        self._close(stream, reason, error)
        if slot is not None:
            if self._prefills.pop(slot, None) is not None:  # mid-prefill: its memory holds part of a prompt
                self._evict(slot)
            elif self._slots[slot] is not None:
                self.prefix.finished(slot, self._slots[slot].length)
                # paged: the reply's blocks join the pool cache for the next turn, unless the request
                # failed (its memory is not trusted; a failed loop resets the engine anyway)
                written = self.prefix.written(slot) if error is None and self.prefix.mode != "off" else ()
                self.engine.release(slot, keep=self.prefix.mode != "off", written=written)
            self._slots[slot] = None
            self.grammars.release(slot)

    def _close(self, stream: RequestStream, reason: str, error: str | None) -> None:
        """Push the request's final event, unless it has one (any thread: see abort)."""
        with self._lock:
            if stream.done:
                return
            stream.done = True
            self._open.discard(stream)
        public = error is not None and error == self._abort_error  # internal failures stay in the log
        stream.push(Event(stream.request.id, None, reason, error, error_public=public))

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

    def _emit_prompt(self, stream: RequestStream, scored: list[ScoredToken]) -> None:
        """Deliver the request's scored prompt; a request for no tokens ends with it."""
        request = stream.request
        if not stream.done:
            top = request.prompt_logprobs
            stream.push(Event(request.id, None, prompt=[t._replace(top=t.top[:top]) for t in scored]))
        if request.max_tokens == 0:
            self._prompt_only.remove(stream)
            self._finish(None, stream, "length")

    def _emit(self, slot: int, stream: RequestStream, token: Token) -> None:
        """Deliver one token of the request in `slot`; finish it on a stop id or max_tokens."""
        if stream.done or self._slots[slot] is None or self._slots[slot].stream is not stream:
            return  # finished (or cancelled) while this token was in flight: discard
        request = stream.request
        produced = self._slots[slot].produced + 1
        self.prefix.delivered(slot, token.id)
        stream.generated.append(token.id)
        self._slots[slot] = self._slots[slot]._replace(produced=produced)
        top = token.top[: request.logprobs]
        stream.push(Event(request.id, Token(token.id, token.logprob, top)))
        step = self.grammars.advance(slot, token.id) if token.id not in request.stop_ids else None
        if step is not None and not step.ok:  # the mask allowed it: a library fault, not the client's
            log.error("request %s: the grammar refused its own token %d: %s", request.id, token.id, step.error)
            self._finish(slot, stream, "error", "the grammar refused a token it allowed")
        elif token.id in request.stop_ids or (step is not None and step.ended):
            self._finish(slot, stream, "length" if step is not None and step.cut else "stop")
        elif produced >= request.max_tokens:
            self._finish(slot, stream, "length")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.iterate():
                    with self._wake:  # idle: sleep until a submit, cancel, stop or abort
                        if not self._waiting and not self._cancelled and not self._stop.is_set():
                            self._wake.wait(timeout=1.0)
            except Exception as e:  # a device failure: fail everything, go on from a clean state
                log.exception("runner loop failed")
                self._fail_all(self._abort_error or f"internal error: {type(e).__name__}: {e}")
                self._in_flight = []
                if not self._stop.is_set():
                    self.engine.reset()
                    self.prefix.clear()
        self.iterate()  # stopped: ends what is left (cancelled, or failed with the abort's error)

    def _fail_all(self, error: str | None) -> None:
        reason = "error" if error else "cancelled"
        # The queue is taken before any request hears its end: a client that submits again on seeing
        # its request fail must find the new one admitted after the reset, not failed with the rest.
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for i, s in enumerate(self._slots):
            if s is not None:
                self._finish(i, s.stream, reason, error)
        prompt_only, self._prompt_only = self._prompt_only, []
        for stream in waiting + prompt_only:
            self._finish(None, stream, reason, error)
        self._publish_stats()
