"""The runner's admission half: take queued requests into free slots and dispatch their prefills.

A mixin of InferenceRunner (runner.py), run by its loop thread only. It uses the runner's slot
table (`_slots`), the prefills in progress (`_prefills`: slot → PrefillJob), queue (`_waiting` under
`_lock`), `engine`, `prefix` cache, `grammars`, `_prompt_only` and `_finish`; it returns the
dispatched prefills as flights that the loop reads one pass later, like its steps.

Token-budget steps (`--max-step-tokens`): a prompt's prefill is spread over loop passes, a few chunks
per pass (Scheduler.plan_prefill), each chunk the largest prefill bucket that fits the pass's budget
(Scheduler.chunk_size), while the running rows get a decode step every pass. A request
whose prompt is still prefilling holds its slot (and, paged, all its prompt's blocks, reserved at
admission) but is not among the step's rows until its last chunk has sampled its first token. The
chunk and the decode step are two device programs dispatched back to back in the same pass, not one
fused program. Scoring prompts (prompt logprobs) and short prompts prefilled in groups stay whole.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

from hkserve.engine.block_pool import cached_reuse
from hkserve.engine.outputs import PendingScores, PendingTokens
from hkserve.engine.prefix_cache import Reuse
from hkserve.engine.requests import RequestStream
from hkserve.engine.row_groups import RowGroups, RowOf
from hkserve.engine.scheduler import Prefilling, Scheduler
from hkserve.engine.state import DecodeStateLost

log = logging.getLogger("hkserve.runner")


class SlotState(NamedTuple):
    stream: RequestStream
    produced: int  # tokens delivered
    length: int  # tokens in the slot's memory once the dispatched device work completes


class InFlight(NamedTuple):
    owners: list[tuple[int, RequestStream]]
    pending: PendingTokens
    by_slot: bool  # rows indexed by slot (a step), or one row (a prefill)
    scores: PendingScores | None = None  # a scoring prefill's prompt scores


class Admission:
    """Admission and prefill (see the module docstring); InferenceRunner provides the state."""

    def _admit(self, budget: int) -> list[InFlight]:
        """This pass's prefills within its prompt-token `budget`: the prefilling requests' next chunks
        first (they are older), then queued requests taken into free slots while the budget lasts
        (Scheduler.admits, counting the chunks still to run), each started (prefill_job.py) and given
        the chunks the budget leaves at once, so a prompt done in its first pass is in the prefix
        cache for the next one admitted → the flights of the prompts done this pass."""
        admitted, left = self._advance_prefills(budget, budget)
        free = [i for i, s in enumerate(self._slots) if s is None]
        spent = budget - left + sum(sum(job.left()) for job in self._prefills.values())
        # Short prompts are prefilled several per call (row_groups.py), except in the prefix cache's
        # exact mode, whose reuse needs every prompt's KV computed by the fixed-chunk prefill.
        groups = RowGroups(self.engine, enabled=self.prefix.mode != "exact")
        try:
            while free and Scheduler.admits(spent, budget):
                with self._lock:
                    if not self._waiting:
                        break
                    stream = self._waiting.popleft()
                request = stream.request
                ids = request.prompt_ids + stream.generated  # a preempted request resumes after its tokens
                # A scoring prefill scores every prompt token (reusing nothing), once: not when resumed.
                scoring = request.prompt_logprobs is not None and not stream.generated
                # its prefill and what its first step writes (k+1 positions on a speculating engine)
                now = min(len(ids) + self.engine.step_tokens, self.engine.max_len)
                roomy = self._roomy(free, now)
                if not roomy:  # the pool cannot give it its blocks yet: it waits, first in line
                    with self._lock:
                        self._waiting.appendleft(stream)
                    break
                # A resuming request reuses prompt KV only (a prefix's copy counts every token as prompt).
                slot, reuse = self.prefix.place(request.prompt_ids, roomy, lookup=not scoring)
                if not scoring:  # paged: the pool's cached blocks, when they hold more of the prompt
                    reuse = cached_reuse(self.engine.kv_pool, self.prefix, slot, request.prompt_ids, reuse)
                reuse = self._make_room(slot, reuse, now, free)
                free.remove(slot)
                tokens = len(ids) - (reuse.length if reuse else 0)
                spent += tokens
                stream.admitted_at = stream.admitted_at or time.monotonic()
                if reuse is None and not stream.generated and groups.takes(request):
                    full = groups.add(slot, stream)
                    admitted += self._prefill_rows(full) if full else []
                    left -= tokens
                    continue
                admitted += self._prefill_one(slot, stream, free, reuse)
                if slot not in self._prefills or not self._prefills[slot].chunks:  # dispatched whole
                    left -= tokens
                flights, left = self._advance_prefills(left, budget)
                admitted += flights
            for group in groups.drain():
                admitted += self._prefill_rows(group)
        except DecodeStateLost:  # the groups popped from the queue and not yet prefilled fail too
            self._prefill_failed([stream for group in groups.drain() for _, stream in group], None)
            raise
        return admitted

    def _roomy(self, free: list[int], now: int) -> list[int]:
        """The free slots whose shard of a paged pool can give a request the `now` positions it needs
        beside the running rows' promises (all of them, static layout)."""
        pool = self.engine.kv_pool
        return free if pool is None else Scheduler(pool).roomy(free, now)

    def _make_room(self, slot: int, reuse: Reuse | None, now: int, free: list[int]) -> Reuse | None:
        """Paged: evict idle slots' cached blocks (least recently used first; the reused prefix's source
        last, dropping the reuse) until slot's shard can promise `now` positions, the prefix's full
        blocks shared with its source counted once, and promise them. Evicting a slot frees only the
        blocks no other slot names. Returns the reuse that still holds."""
        pool = self.engine.kv_pool
        if pool is None:
            return reuse
        source = reuse.source if reuse else slot
        idle = [s for s in free if s not in (slot, source) and pool.shard(s) == pool.shard(slot) and pool.held[s]]
        for victim in [*self.prefix.by_age(idle), source]:
            if pool.fits(slot, now, pool.reused(slot, reuse) if reuse else 0):
                break
            if victim == source and (victim == slot or victim not in free):
                continue
            if victim == source:
                reuse = None
            self._evict(victim)
        pool.reserve(slot, now)
        return reuse

    def _evict(self, slot: int) -> None:
        """An idle slot's memory is dropped: its blocks are free and the prefix cache forgets it."""
        self.engine.release(slot)
        self.prefix.forget(slot)

    def _prefill_one(self, slot: int, stream: RequestStream, free: list[int], reuse: Reuse | None) -> list[InFlight]:
        """One prompt's own prefill, with its prefix's KV reused, a grammar's first mask, or its scores:
        started (its chunks follow, pass by pass), or, scoring the prompt, dispatched whole."""
        request, resumed = stream.request, bool(stream.generated)
        ids = request.prompt_ids + stream.generated
        scores = None
        try:
            mask = self._first_mask(slot, stream, len(ids))
            if request.prompt_logprobs is None or resumed:
                if not resumed:  # a resumed request reports the reuse of its first admission
                    stream.cached_tokens = reuse.length if reuse else 0 if self.prefix.mode != "off" else None
                # its tokens so far are recomputed, and counted as generated (penalties)
                job = self.engine.start_prefill(slot, ids, request.sampling, reuse, mask, len(stream.generated))
                self._slots[slot] = SlotState(stream, len(stream.generated), len(ids))
                self._prefills[slot] = job
                self.prefix.forget(slot)  # nothing reusable until its prefill is done
                return []
            keywords = {k: v for k, v in (("bitmask", mask), ("reuse", reuse)) if v is not None}
            pending, scores = self.engine.score_prefill(slot, request.prompt_ids, request.sampling, **keywords)
        except Exception as e:  # this request only: its slot stays free, the others go on
            self._drop_prefill(slot, stream, e)
            return []
        self.prefix.admitted(slot, ids, exact=False)
        if request.max_tokens:
            self._slots[slot] = SlotState(stream, len(stream.generated), len(ids))
        else:  # only the prompt's scores are wanted: the slot is free again at once
            self._prompt_only.append(stream)
            self.prefix.finished(slot, len(request.prompt_ids))
            self.engine.release(slot, keep=self.prefix.mode != "off")
            free.insert(0, slot)
        return [InFlight([(slot, stream)], pending, False, scores)]

    def _advance_prefills(self, left: int, budget: int) -> tuple[list[InFlight], int]:
        """Dispatch prefill chunks within the `left` of this pass's `budget`, each job's chunks still to run
        cut at the largest bucket the budget fits (Scheduler.chunk_size; Scheduler.plan_prefill: oldest
        first; one over it only when the pass has spent nothing yet) → the flights of the prompts now
        done, whose first token joins this pass's step, and what is left of the budget."""
        size = Scheduler.chunk_size(self.engine.prefill_buckets, budget)  # the pass's chunk: it fits the budget
        self._prefills = {slot: self.engine.rechunk(job, size) for slot, job in self._prefills.items()}
        queue = [Prefilling(i, self._slots[i].stream.order, job.left()) for i, job in self._prefills.items()]
        for slot, chunks in Scheduler.plan_prefill(queue, left, force=left == budget):
            left -= sum(self._prefills[slot].left()[:chunks])
            try:
                self._prefills[slot] = self.engine.continue_prefill(self._prefills[slot], chunks)
            except Exception as e:  # this request only, unless the decode state went with it
                self._drop_prefill(slot, self._slots[slot].stream, e)
        done = [(slot, job) for slot, job in self._prefills.items() if job.result is not None]
        flights = []
        for slot, job in done:
            del self._prefills[slot]
            stream = self._slots[slot].stream
            self.prefix.admitted(slot, job.prompt_ids)
            flights.append(InFlight([(slot, stream)], job.result, False))
        return flights, left

    def _drop_prefill(self, slot: int, stream: RequestStream, e: Exception) -> None:
        """A prefill failed: its request ends with the error, its slot is free and holds nothing."""
        self._slots[slot] = None
        self._prefills.pop(slot, None)
        self.grammars.release(slot)
        self._evict(slot)
        self._prefill_failed([stream], e)

    def _first_mask(self, slot: int, stream: RequestStream, length: int):
        """A constrained request's mask [1, W] for the token its prefill samples: its grammar's first, or,
        resumed after preemption, the one after the tokens it had generated (None: unconstrained)."""
        request, generated = stream.request, stream.generated
        if not (request.grammar and request.max_tokens):
            return None
        if not generated:
            return self.grammars.bind(slot, request.grammar)
        remaining = min(request.max_tokens - len(generated), self.engine.max_len - length + 1)
        return self.grammars.resume(slot, request.grammar, generated, remaining)

    def _prefill_rows(self, group: list[tuple[int, RequestStream]]) -> list[InFlight]:
        """One batched prefill of a group of short prompts (Engine.prefill_many): one flight per row."""
        requests = [stream.request for _, stream in group]
        try:
            pending = self.engine.prefill_many(
                [slot for slot, _ in group], [r.prompt_ids for r in requests], [r.sampling for r in requests]
            )
        except Exception as e:
            if len(group) == 1 or isinstance(e, DecodeStateLost):  # these requests only: their slots stay free
                for slot, _ in group:
                    self._evict(slot)
                self._prefill_failed([stream for _, stream in group], e)
                return []
            # Each alone, in the same program (same bits): only a request that fails alone fails.
            flights = []
            for i, member in enumerate(group):
                try:
                    flights += self._prefill_rows([member])
                except DecodeStateLost:
                    self._prefill_failed([stream for _, stream in group[i + 1 :]], None)
                    raise
            return flights
        for slot, stream in group:
            # Reusable in mode "on"; not in "exact" (another program than the fixed-chunk prefill computed it).
            self.prefix.admitted(slot, stream.request.prompt_ids, exact=False)
            stream.cached_tokens = 0 if self.prefix.mode != "off" else None
            self._slots[slot] = SlotState(stream, 0, len(stream.request.prompt_ids))
        return [InFlight([(slot, stream)], RowOf(pending, row), False) for row, (slot, stream) in enumerate(group)]

    def _prefill_failed(self, streams: list[RequestStream], e: Exception | None) -> None:
        """End requests whose prefill failed (e None: never tried, the decode state was lost before)."""
        if e is not None and not isinstance(e, ValueError):
            log.exception("prefill of request(s) %s failed", ", ".join(s.request.id for s in streams))
        for stream in streams:
            self._finish(None, stream, "error", f"the request could not be started: {e or 'the decode state was lost'}")
        if isinstance(e, DecodeStateLost):
            raise e  # every slot's state went with it: the loop fails the others and resets
