"""What an Engine compiles before it serves (so no request waits on a compile that would stall every
slot): each prefill bucket, the continuation chunks of long prompts, the prefix cache's suffix and copy
programs, the batched-prefill rows programs and each decode window.

A mixin of Engine (engine.py); Engine provides the programs and the host state they use.
"""

from __future__ import annotations

import numpy as np

from hkserve.model.sampling import SamplingParams, make_settings


class Warmup:
    """The compiled programs' inventory and their warm-up (see the module docstring)."""

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

    def warmup(self) -> None:
        """Compile now, not on a request (when a compile would stall every slot): each prefill bucket,
        each continuation window of long prompts, each decode window: len(buckets) + 2 × len(windows)
        programs, whatever the number of slots (the step is one program for all of them), plus the
        batched-prefill rows programs, the prefix cache's suffix and copy programs and the split step
        of constrained batches where those are on."""
        for bucket in (self.prefill_chunk,) if self.prefill_chunk else self.prefill_buckets:
            self.prefill(0, [0] * bucket)
        row = make_settings([SamplingParams()], self.model.config.vocab_size)
        for bucket, window in self.continuation_programs():  # one token each: compiles, writes little
            self._prefill_chunk(0, [0], window, bucket, row)
        self.row_prefill.warmup()
        if self.prefix_cache != "off":
            for window in self.windows:
                self._copy_prefix(0, 0, [0] * window)
            self.positions[0] = 0
        only_first = np.eye(self.slots, dtype=bool)[0]
        for w in self.windows:
            self.positions[0] = w - 1
            self.step(only_first).read()
            if self.structured:  # the split step of grammar-constrained batches
                self.positions[0] = w - 1
                self.step_sample(self.step_forward(only_first), self._all_allowed_rows).read()
        self.positions[:] = 0
        if self.kv_pool is not None:  # a fresh pool: warmup's blocks free and none of them cached
            self._new_pool()
            self.sync_table()
