"""A prompt's prefill spread over several loop passes (`--max-step-tokens`, issue 34 step 4).

`start_prefill` does what must happen when the request is admitted — checks, the slot's blocks for
the whole prompt (paged: reserved up front, not chunk by chunk), the reused prefix's copy — and
returns a PrefillJob planned as a one-shot `prefill` runs it (prefix_copy.plan_chunks, chunks of the
largest bucket); before each pass the runner has the chunks still to run replanned at the bucket its
token budget fits (`rechunk`, Scheduler.chunk_size), and `continue_prefill` then dispatches the next
ones, giving the first token's pending output with the last one.

Engines that prefill in one go (SpeculativeEngine, multihost's LeaderEngine) take OneShotPrefill:
their job is dispatched whole by `start_prefill` and has no chunks left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class PrefillJob(NamedTuple):
    slot: int
    prompt_ids: list[int]  # the prompt (and a resumed request's generated tokens)
    row: Any  # the engine's form of the request's sampling settings
    bitmask: Any  # [1, W] int32: the first token's grammar mask (None: all allowed)
    generated: int  # the last so many of prompt_ids were generated (a preempted request resuming)
    chunks: list  # [prefix_copy.Chunk]: every chunk of the prefill, in order (not imported: protocols.py needs this)
    done: int = 0  # chunks dispatched so far
    result: Any = None  # the first token's pending output, once the last chunk is dispatched

    def left(self) -> list[int]:
        """The padded tokens of each chunk still to dispatch."""
        return [c.bucket for c in self.chunks[self.done :]]


class OneShotPrefill:
    """start_prefill / continue_prefill over an engine's own `prefill`: the whole prompt at admission."""

    chunk_sizes: tuple[int, ...] = ()  # nothing to compile for a budget: no chunks

    def start_prefill(
        self, slot: int, prompt_ids: Sequence[int], settings=None, reuse=None, bitmask=None, generated: int = 0
    ) -> PrefillJob:
        keywords = {k: v for k, v in (("reuse", reuse), ("bitmask", bitmask)) if v is not None}
        if generated:
            keywords["generated"] = generated
        pending = self.prefill(slot, prompt_ids, settings, **keywords)
        return PrefillJob(slot, list(prompt_ids), settings, bitmask, generated, [], 0, pending)

    def rechunk(self, job: PrefillJob, size: int) -> PrefillJob:
        return job

    def continue_prefill(self, job: PrefillJob, chunks: int) -> PrefillJob:
        return job
