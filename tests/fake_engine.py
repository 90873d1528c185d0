"""FakeEngine: the Engine interface InferenceRunner uses, with arithmetic for a model (after JetStream's
mock engine), so runner tests know every token by hand and run in microseconds.

The "model": a slot's next token is (its last token + 1) % vocab_size, starting from the prompt's
last token (under a grammar's bitmask: the first allowed token from there on); every token has
logprob 0 and itself as the only alternative, and a scored prompt token has logprob 0 and rank 1.
Like the real Engine it keeps a host mirror of each slot's length and raises ContextLengthError when
stepping a full slot. It is a ServingEngine (hkserve/engine/protocols.py; tests/test_protocols.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hkserve.engine.block_pool import BlockPool
from hkserve.engine.outputs import ScoredToken, Token
from hkserve.engine.prefill_job import OneShotPrefill, PrefillJob
from hkserve.engine.prefix_copy import plan_chunks, rechunk
from hkserve.engine.requests import Event, RequestStream
from hkserve.engine.state import ContextLengthError


@dataclass(frozen=True)
class FakeConfig:
    vocab_size: int


@dataclass(frozen=True)
class FakeModel:
    config: FakeConfig


class FakePending:
    """Tokens "on the device": `read()` returns them (one row per slot for a step, one for a prefill)."""

    def __init__(self, tokens: list[Token]):
        self.tokens = tokens

    def read(self) -> list[Token]:
        return self.tokens


def token(token_id: int) -> Token:
    return Token(token_id, 0.0, [(token_id, 0.0)])


@dataclass
class FakeEngine:
    """`strict_fits=False` admits requests whose prompt + max_tokens exceed max_len (only the prompt
    is checked): the way to make a running slot reach the context length. With a `gate`, `step` sets
    `stepping` and then blocks until the gate is set: a device call that does not return."""

    slots: int = 4
    max_len: int = 64
    vocab_size: int = 100
    n_top: int = 5
    strict_fits: bool = True
    gate: threading.Event | None = None
    prefill_rows: int = 0  # > 0: prompts of at most 8 tokens are prefilled this many per prefill_many call
    prefix_cache: str = "off"
    prefill_chunk: int | None = None
    supports_grammars: bool = True
    chunk: int = 0  # > 0: start_prefill / continue_prefill go this many prompt tokens per chunk; 0: one-shot
    prefill_buckets: tuple[int, ...] = ()  # the chunks a runner's budget picks from (); (chunk,)
    chunk_sizes: tuple[int, ...] = ()  # set by the runner (protocols.py)
    step_tokens: int = 1  # positions a step writes per row, as Engine's
    kv_blocks: int = 0  # > 0: a paged layout of this many blocks (one data shard), held as the real Engine's
    block_size: int = 4
    stepping: threading.Event = field(default_factory=threading.Event)
    calls: list[tuple] = field(default_factory=list)  # ("prefill", slot, prompt) / ("step", active slots) / ...
    padded: list[int] = field(default_factory=list)  # the bucket of each chunk continue_prefill ran, in order
    last: list[int] = field(init=False)  # each slot's last token: the next step's input
    positions: np.ndarray = field(init=False)  # tokens in each slot's memory
    kv_layout: str = field(init=False)
    kv_pool: BlockPool | None = field(init=False)

    def __post_init__(self):
        self.model = FakeModel(FakeConfig(self.vocab_size))
        self.last = [0] * self.slots
        self.positions = np.zeros(self.slots, np.int64)
        self.kv_layout = "paged" if self.kv_blocks else "static"
        self.prefill_buckets = self.prefill_buckets or (self.chunk or self.max_len,)
        self._new_pool()

    def _new_pool(self) -> None:
        self.kv_pool = None
        if self.kv_blocks:
            max_blocks = -(-self.max_len // self.block_size)
            self.kv_pool = BlockPool(self.kv_blocks, self.block_size, self.slots, max_blocks)

    def _assign(self, slot: int, tokens: int) -> None:
        """Paged: the slot starts afresh holding blocks for `tokens` positions (PoolExhausted if it cannot)."""
        if self.kv_pool is not None:
            self.kv_pool.truncate(slot, 0)
            self.kv_pool.grow(slot, tokens)

    def check_fits(self, prompt_len: int, max_tokens: int = 0) -> None:
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        needed = prompt_len + (max_tokens if self.strict_fits else 0)
        if needed > self.max_len:
            raise ContextLengthError(f"the context is {self.max_len} tokens; the request needs {needed}")

    def prefill(
        self,
        slot: int,
        prompt_ids: Sequence[int],
        settings: dict | None = None,
        reuse=None,
        bitmask=None,
        generated: int = 0,
    ) -> FakePending:
        self.check_fits(len(prompt_ids))
        self._assign(slot, len(prompt_ids))
        resumed = (("generated", generated),) if generated else ()  # a preempted request resuming
        self.calls.append(("prefill", slot, list(prompt_ids)) + ((reuse,) if reuse else ()) + resumed)
        self.last[slot] = self._allowed((prompt_ids[-1] + 1) % self.vocab_size, bitmask, 0)
        self.positions[slot] = len(prompt_ids)
        return FakePending([token(self.last[slot])])

    def start_prefill(
        self, slot: int, prompt_ids: Sequence[int], settings=None, reuse=None, bitmask=None, generated: int = 0
    ) -> PrefillJob:
        """One-shot (`chunk` 0: `prefill` now) or chunks of `chunk` tokens (the blocks taken now, as Engine's)."""
        if not self.chunk:
            return OneShotPrefill.start_prefill(self, slot, prompt_ids, settings, reuse, bitmask, generated)
        self.check_fits(len(prompt_ids))
        self._assign(slot, len(prompt_ids))
        chunks = plan_chunks(len(prompt_ids), 0, self.prefill_buckets, lambda s: s, size=self.chunk)
        return PrefillJob(slot, list(prompt_ids), settings, bitmask, generated, chunks)

    def rechunk(self, job: PrefillJob, size: int) -> PrefillJob:
        """As Engine's: the chunks still to run cut at `size` tokens (attend_len: the chunk's start)."""
        return rechunk(job, self.prefill_buckets, lambda s: s, size) if self.chunk else job

    def continue_prefill(self, job: PrefillJob, chunks: int) -> PrefillJob:
        for c in job.chunks[job.done : job.done + chunks]:
            self.calls.append(("prefill_chunk", job.slot, c.start, c.end))
            self.padded.append(c.bucket)
            self.positions[job.slot] = c.end
        done = min(job.done + chunks, len(job.chunks))
        if done < len(job.chunks) or job.result is not None:
            return job._replace(done=done)
        first = self._allowed((job.prompt_ids[-1] + 1) % self.vocab_size, job.bitmask, 0)
        self.last[job.slot] = first
        return job._replace(done=done, result=FakePending([token(first)]))

    def score_prefill(
        self, slot: int, prompt_ids: Sequence[int], settings: dict | None = None, bitmask=None
    ) -> tuple[FakePending, FakePending]:
        pending = self.prefill(slot, prompt_ids, settings, bitmask=bitmask)
        return pending, FakePending([ScoredToken(t, 0.0, [(t, 0.0)], 1) for t in prompt_ids])

    def _allowed(self, wanted: int, bitmask, row: int) -> int:
        """`wanted`, or the first token after it that row `row` of the bitmask [B, W] allows."""
        if bitmask is None:
            return wanted
        bits = np.unpackbits(np.asarray(bitmask, np.int32)[row].view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self.vocab_size])
        later = allowed[allowed >= wanted]
        return int(later[0] if later.size else allowed[0])

    def rows_program(self, prompt_len: int) -> tuple[int, int] | None:
        return (8, self.prefill_rows) if self.prefill_rows and prompt_len <= 8 else None

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], settings) -> FakePending:
        assert 1 <= len(prompts) <= self.prefill_rows and all(len(p) <= 8 for p in prompts)
        self.calls.append(("prefill_many", list(slots), [list(p) for p in prompts]))
        for slot, prompt in zip(slots, prompts):
            self._assign(slot, len(prompt))
            self.last[slot] = (prompt[-1] + 1) % self.vocab_size
            self.positions[slot] = len(prompt)
        return FakePending([token(self.last[slot]) for slot in slots])

    def step(self, active: np.ndarray) -> FakePending:
        active = np.asarray(active, bool)
        if (self.positions[active] >= self.max_len).any():
            raise ContextLengthError(f"a slot reached the context length {self.max_len}")
        for i in np.flatnonzero(active) if self.kv_pool is not None else ():
            self.kv_pool.grow(int(i), int(self.positions[i]) + 1)
        self.calls.append(("step", [int(i) for i in np.flatnonzero(active)]))
        self.stepping.set()
        if self.gate is not None:
            self.gate.wait()
        for i in np.flatnonzero(active):
            self.last[i] = (self.last[i] + 1) % self.vocab_size
        self.positions += active
        return FakePending([token(t) for t in self.last])  # idle rows repeat their last token: junk

    def step_forward(self, active: np.ndarray) -> np.ndarray:
        """The model half of a constrained step: nothing to compute here, the active rows are its "logits"."""
        return np.asarray(active, bool)

    def step_sample(self, forward: np.ndarray, bitmask: np.ndarray) -> FakePending:
        self.step(forward)
        for i in np.flatnonzero(forward):
            self.last[i] = self._allowed(self.last[i], bitmask, i)
        return FakePending([token(t) for t in self.last])

    def spec_counts(self) -> None:
        return None

    def release(self, slot: int, keep: bool = False, written=()) -> None:
        """A request left the slot: its paged blocks go back to the pool unless `keep` (as Engine.release;
        `written` is not registered: the FakeEngine keeps no pool cache)."""
        if self.kv_pool is not None:
            self.kv_pool.reserve(slot, 0)
            if not keep:
                self.kv_pool.drop(slot)

    def reset(self) -> None:
        self.calls.append(("reset",))
        self.last = [0] * self.slots
        self.positions[:] = 0
        self._new_pool()

    def warmup(self, upto: int | None = None) -> None:
        self.calls.append(("warmup",))


def events(stream: RequestStream) -> list[Event]:
    """The events pushed to a (blocking-mode) stream so far, without waiting for more."""
    out = []
    while True:
        try:
            out.append(stream._sync.get_nowait())
        except queue.Empty:
            return out


def final_event(stream: RequestStream, timeout: float = 10.0) -> Event:
    """Wait (bounded) for a stream's final event; tokens before it are skipped."""
    while True:
        try:
            event = stream._sync.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"request {stream.request.id} did not end within {timeout} s") from None
        if event.finish_reason is not None:
            return event


def token_ids(evs: list[Event]) -> list[int]:
    return [e.token.id for e in evs if e.token is not None]
