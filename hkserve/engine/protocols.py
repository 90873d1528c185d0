"""The two interfaces of serving, written down: what the runner needs from an engine (`ServingEngine`:
Engine, SpeculativeEngine, multihost's LeaderEngine, tests' FakeEngine) and what the HTTP API needs
from a runner (`ServingRunner`: InferenceRunner, tests' FakeRunner).

What an implementation can or cannot do is a declared attribute (`supports_grammars`,
`prefix_cache`, `spec_counts`), never probed with getattr/hasattr: a missing member is a type error
here and a failing test (tests/test_protocols.py), not a silently different path.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from hkserve.engine.block_pool import BlockPool
from hkserve.engine.prefill_job import PrefillJob
from hkserve.engine.prefix_cache import Reuse
from hkserve.engine.requests import Request, RequestStream
from hkserve.engine.spec_policy import SpecCounts


class RunnerStats(NamedTuple):
    slots: int
    running: int
    waiting: int
    kv_blocks_total: int = 0  # paged KV layout: the pool's blocks (0: static layout)
    kv_blocks_used: int = 0  # of those, named by slots (running, or idle ones kept for the prefix cache)
    kv_block_size: int = 0  # tokens per block (0: static layout)
    preemptions: int = 0  # requests preempted so far to free blocks (paged layout)
    kv_blocks_cached: int = 0  # cached blocks no slot names (block_cache.py): evictable, not in kv_blocks_used


class Pending(Protocol):
    """Device results whose host copy has started: `read()` waits for them."""

    def read(self) -> Any: ...


class ServingEngine(Protocol):
    """The device side as the runner drives it, from its one loop thread."""

    slots: int  # decode rows
    max_len: int  # tokens one slot's memory holds
    n_top: int  # top logprobs each sampled token carries
    vocab_size: int  # the model's vocabulary: the width of logits and of grammar masks ([B, ceil(V/32)])
    prefix_cache: str  # prefix_cache.MODES: how the runner places prompts into slots
    prefill_chunk: int | None  # the fixed prefill chunk of prefix_cache "exact" (the reuse granule), else None
    prefill_buckets: tuple[int, ...]  # the prompt lengths prefill programs take, ascending
    chunk_sizes: tuple[int, ...]  # the buckets a prompt's later chunks may take (set by the runner before warmup)
    step_tokens: int  # positions one step may write per row: 1, or k+1 for a speculating engine
    supports_grammars: bool  # whether step_forward / step_sample and a first-token bitmask are honoured
    positions: np.ndarray  # [B] host mirror of each slot's position
    kv_layout: str  # "static" | "paged" (kv_layout.py)
    kv_pool: BlockPool | None  # paged: the host's block pool, which admission promises blocks from; else None

    def check_fits(self, prompt_len: int, max_tokens: int = 0) -> None: ...

    def prefill(
        self,
        slot: int,
        prompt_ids: Sequence[int],
        settings=None,
        reuse: Reuse | None = None,
        bitmask=None,
        generated: int = 0,
    ) -> Pending:
        """`generated`: the last so many of prompt_ids are the request's own tokens (a preempted one resuming)."""
        ...

    def start_prefill(self, slot, prompt_ids, settings=None, reuse=None, bitmask=None, generated=0) -> PrefillJob:
        """`prefill` (the same arguments) spread over loop passes (prefill_job.py): its admission's part
        now, its chunks by `continue_prefill`."""
        ...

    def rechunk(self, job: PrefillJob, size: int) -> PrefillJob:
        """The job with its chunks still to run planned at `size` tokens (one of `chunk_sizes`)."""
        ...

    def continue_prefill(self, job: PrefillJob, chunks: int) -> PrefillJob:
        """The job's next `chunks` chunks dispatched; `result` set with its last."""
        ...

    def score_prefill(
        self, slot: int, prompt_ids: Sequence[int], settings=None, bitmask=None
    ) -> tuple[Pending, Pending]: ...

    def rows_program(self, prompt_len: int) -> tuple[int, int] | None: ...

    def prefill_many(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], settings) -> Pending: ...

    def step(self, active: np.ndarray) -> Pending: ...

    def step_forward(self, active: np.ndarray) -> Any: ...

    def step_sample(self, forward: Any, bitmask: np.ndarray) -> Pending: ...

    def release(self, slot: int, keep: bool = False, written: Sequence[int] = ()) -> None:
        """The request in `slot` ended: its paged blocks go back to the pool unless `keep` (prefix cache);
        `written`: the tokens whose KV the slot holds (prompt, reply), registered in the pool cache."""
        ...

    def reset(self) -> None: ...

    def warmup(self, upto: int | None = None) -> None:
        """Compile the programs serving contexts up to `upto` tokens (None: all) before serving."""
        ...

    def spec_counts(self) -> SpecCounts | None:
        """Speculative decoding's totals so far; None for an engine that does not speculate."""
        ...


class ServingRunner(Protocol):
    """A runner as the HTTP API uses it, from any thread."""

    max_queue: int  # requests queued at once: a request needing more choices can never be admitted
    ready: threading.Event  # set once warm-up compiled the programs
    # The model's vocabulary (grammar masks are this wide); None: the tokenizer's (a runner with no model).
    vocab_size: int | None

    def submit(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> RunnerStats: ...

    def spec_counts(self) -> SpecCounts | None:
        """Speculative decoding's totals so far; None when the engine does not speculate."""
        ...

    def observe_masks(self, observe: Callable[[float, int], None]) -> None:
        """Have `observe(seconds, rows)` called for each grammar mask fill (a runner without grammars: never)."""
        ...
