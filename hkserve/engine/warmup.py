"""What an Engine compiles before it serves (so no request waits on a compile that would stall every
slot): each prefill bucket, the continuation chunks of long prompts, the prefix cache's copy programs,
the batched-prefill rows programs, each decode window and the split step of grammar-constrained batches.

The inventory is a list of program calls, each with the longest context it serves. `warmup(upto)`
compiles those up to a context ahead of time (programs.py: nothing runs), the "common" programs
that the first ordinary chats need; the rest ("rare": long prompts' buckets and chunks, long windows)
are compiled after the server is ready by background_compile.py, or when first needed.

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

    def program_calls(self) -> list[ProgramCall]:
        """Every program serving may need (len(buckets) + 2 × len(windows), whatever the number of slots,
        plus the rows, copy and constrained-step programs where those are on), smallest context first."""
        row = make_settings([SamplingParams()], self.model.config.vocab_size)
        calls = []
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
        for w in self.windows:
            calls.append(ProgramCall(w, self._compiled_fn("step", w), (active,)))
            if self.structured:
                calls += self._constrained_calls(w, active)
        return sorted(calls, key=lambda c: c.context)

    def _constrained_calls(self, window: int, active: np.ndarray) -> list[ProgramCall]:
        """The split step of grammar-constrained batches at this window: one program, or its two halves."""
        if not self.split_masks:
            return [ProgramCall(window, self._compiled_fn("masked", window), (active, self._all_allowed_rows))]
        forward = functools.partial(self._forward_impl, window)
        logits = jax.eval_shape(forward, *self._specs, active)[1]  # [B, V]
        logits = jax.ShapeDtypeStruct(logits.shape, logits.dtype, sharding=self._sharding("data", None))
        sample = (self._compiled_fn("sample", 0), (logits, active, self._all_allowed_rows))
        return [ProgramCall(window, self._compiled_fn("forward", window), (active,)), ProgramCall(window, *sample)]

    def warmup(self, upto: int | None = None) -> None:
        """Compile now, not on a request (when a compile would stall every slot), every program serving
        contexts up to `upto` tokens (None: all), ahead of time; then run what a compile cannot prove:
        one prefill and one decode step (the host side, and the few small programs around them)."""
        for call in self.program_calls():
            if upto is None or call.context <= upto:
                call.program.compile(*call.program.full_args(call.host))
        self.prefill(0, [0]).read()
        only_first = np.eye(self.slots, dtype=bool)[0]
        self.step(only_first).read()
        self.positions[:] = 0
        if self.kv_pool is not None:  # a fresh pool: warmup's blocks free and none of them cached
            self._new_pool()
            self.sync_table()

    def rare_calls(self, upto: int) -> list[ProgramCall]:
        """The programs `warmup(upto)` leaves out and not compiled since, smallest context first."""
        calls = self.program_calls()
        return [
            c for c in calls if c.context > upto and not self.programs.has(c.program.key(c.program.full_args(c.host)))
        ]
