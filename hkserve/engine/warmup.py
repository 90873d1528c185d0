"""What an Engine compiles before it serves (so no request waits on a compile that would stall every
slot): each prefill bucket, the continuation chunks of long prompts, the prefix cache's copy programs,
the batched-prefill rows programs, the paged block table's update, the decode step at each of its
windows (one where the attention reads each row's own length: engine.py `step_windows`) and the split
step of grammar-constrained batches; and what few requests need: the scoring prefill's programs.

The inventory is a list of program calls, each with the longest context it serves. `warmup(upto)`
compiles the common ones up to a context ahead of time (programs.py: nothing runs), those that the
first ordinary chats need; the rest ("rare": long prompts' buckets and chunks, long windows, and
scoring at any context) are compiled after the server is ready by background_compile.py, or when
first needed. A wrapping engine (speculative.py) adds its own calls to the same inventory.

A mixin of Engine (engine.py); Engine provides the programs and the host state they use.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import numpy as np

from hkserve.model.sampling import SamplingParams, make_settings

# The cut: programs serving contexts up to this many tokens compile before ready. A chat's prompt and
# reply up to 512 tokens (the largest default prefill bucket: one-chunk prompts, their rows programs,
# the 128..512 decode windows) meet no compile; longer ones may wait for theirs once.
COMMON_CONTEXT = 512


class ProgramCall(NamedTuple):
    context: int  # the longest context (tokens) the program serves: what the common/rare cut measures
    program: Any  # programs.Program
    host: tuple  # example host arguments (those after the params and the state)
    common: bool = True  # False: after ready whatever its context (few requests need it: scoring)

    def compile(self) -> None:
        """Its executable, compiled ahead of time (nothing runs) unless it is already."""
        self.program.compile(*self.program.full_args(self.host))

    def compiled(self) -> bool:
        return self.program.table.has(self.program.key(self.program.full_args(self.host)))


def before_ready(calls: list[ProgramCall], upto: int | None) -> list[ProgramCall]:
    """The calls `warmup(upto)` compiles: the common ones serving up to `upto` tokens (None: any)."""
    return [c for c in calls if c.common and (upto is None or c.context <= upto)]


def after_ready(calls: list[ProgramCall], upto: int | None) -> list[ProgramCall]:
    """The calls `warmup(upto)` leaves out and not compiled since, in their order (smallest context first)."""
    ahead = {id(c) for c in before_ready(calls, upto)}
    return [c for c in calls if id(c) not in ahead and not c.compiled()]


class Warmup:
    """The compiled programs' inventory and their compiles (see the module docstring)."""

    def continuation_windows(self, chunk: int | None = None) -> tuple[int, ...]:
        """Windows that the later chunks (of `chunk` tokens; None: the largest bucket) of a prompt attend over."""
        chunk = chunk or self.prefill_buckets[-1]
        return tuple(sorted({self._window(start) for start in range(chunk, self.max_len, chunk)}))

    def continuation_programs(self) -> list[tuple[int, int]]:
        """(bucket, window) of every chunk that does not start a slot: a long prompt's later chunks, and
        with prefix caching a suffix's chunks (any bucket, any window; exact: its one chunk shape)."""
        if self.prefill_chunk:
            chunk = self.prefill_chunk
            return [(chunk, w) for w in sorted({self._window(s) for s in range(chunk, self.max_len, chunk)})]
        if self.prefix_cache == "on":
            return [(b, w) for w in self.windows for b in self.prefill_buckets]
        # the largest bucket (a one-shot prefill's) and the chunk sizes a runner's budget picks (prompt_prefill.py)
        sizes = sorted({*self.chunk_sizes, self.prefill_buckets[-1]})
        return [(c, w) for c in sizes for w in self.continuation_windows(c)]

    def scoring_chunks(self) -> list[tuple[int, int]]:
        """(bucket, window) of a scoring prefill's chunks. It reuses no prefix (admission.py) and runs
        whole, so the one-shot plan's: its first chunk at any bucket (window 0: the slot starts afresh),
        the later ones at the largest (the exact mode's: every chunk its fixed one)."""
        chunk = self.prefill_chunk or self.prefill_buckets[-1]
        firsts = (self.prefill_chunk,) if self.prefill_chunk else self.prefill_buckets
        return [(b, 0) for b in firsts] + [(chunk, w) for w in self.continuation_windows(chunk)]

    def program_calls(self) -> list[ProgramCall]:
        """Every program serving may need (len(buckets) + len(windows) + len(step_windows), whatever the
        number of slots, plus the rows, copy, table and constrained-step programs where those are on, and
        the scoring prefill's), smallest context first."""
        row = make_settings([SamplingParams()], self.model.config.vocab_size)
        calls = []
        if self.kv_pool is not None:  # the paged layout's block table into the state
            calls.append(ProgramCall(0, self._compiled_fn("table", 0), (np.zeros_like(self.kv_pool.table),)))
        for bucket, window in self.scoring_chunks():
            targets = np.zeros((1, bucket), np.int32)
            host = (*self._chunk_args(0, [0], bucket, row), targets)
            calls.append(ProgramCall(window or bucket, self._compiled_fn("score", window), host, common=False))
        for bucket in (self.prefill_chunk,) if self.prefill_chunk else self.prefill_buckets:
            calls.append(ProgramCall(bucket, self._compiled_fn("prefill", 0), self._chunk_args(0, [0], bucket, row)))
        for bucket, window in self.continuation_programs():
            calls.append(
                ProgramCall(window, self._compiled_fn("prefill", window), self._chunk_args(0, [0], bucket, row))
            )
        rows = self.row_prefill
        for bucket, p in rows.rows.items():
            calls.append(ProgramCall(bucket, rows._fn(), rows.args(bucket, p, [0], [[0]], [None])))
        if self.prefix_cache != "off":
            for w in self.windows:
                calls.append(ProgramCall(w, self._compiled_fn("copy", w), self._copy_args(0, 0, [0], w, None)))
        active = np.zeros(self.slots, bool)
        for w in self.step_windows:
            # A single step window serves the shortest contexts too: cut as the smallest window would be.
            context = self.windows[0] if len(self.step_windows) == 1 else w
            calls.append(ProgramCall(context, self._compiled_fn("step", w), (active,)))
            if self.structured:
                calls += self._constrained_calls(w, context, active)
        return sorted(calls, key=lambda c: c.context)

    def _constrained_calls(self, window: int, context: int, active: np.ndarray) -> list[ProgramCall]:
        """The split step of grammar-constrained batches at this window: one program, or its two halves."""
        if not self.split_masks:
            return [ProgramCall(context, self._compiled_fn("masked", window), (active, self._all_allowed_rows))]
        forward = functools.partial(self._forward_impl, window)
        logits = jax.eval_shape(forward, *self._specs, active)[1]  # [B, V]
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=self._sharding("data", None))
        sample = (self._compiled_fn("sample", 0), (logits, active, self._all_allowed_rows))
        return [ProgramCall(context, self._compiled_fn("forward", window), (active,)), ProgramCall(context, *sample)]

    def warmup(self, upto: int | None = None) -> None:
        """Compile now, not on a request (when a compile would stall every slot), every common program
        serving contexts up to `upto` tokens (None: any), ahead of time; then run what a compile cannot prove:
        one prefill and one decode step (the host side, and the few small programs around them)."""
        for call in before_ready(self.program_calls(), upto):
            call.compile()
        self.prefill(0, [0]).read()
        only_first = np.eye(self.slots, dtype=bool)[0]
        self.step(only_first).read()
        self.positions[:] = 0
        if self.kv_pool is not None:  # a fresh pool: warmup's blocks free and none of them cached
            self._new_pool()
            self.sync_table()

    def rare_calls(self, upto: int | None) -> list[ProgramCall]:
        """The programs `warmup(upto)` leaves out and not compiled since, smallest context first."""
        return after_ready(self.program_calls(), upto)
