"""The runner's preemption half (paged layout): before each step, apply the Scheduler's plan
(scheduler.py) so the step's blocks fit — idle slots' cached blocks dropped, the newest running
requests freed and put back at the front of the queue — and promise every kept row its step's blocks.

A mixin of InferenceRunner (runner.py), run by its loop thread only, before admission: admission then
takes only what the running rows' promises leave. A preempted request keeps its delivered tokens
(`RequestStream.generated`); admission.py readmits it by prefilling its prompt and those tokens, and
it continues where it stopped (the RNG is keyed by seed and position, so a seeded request draws the
same numbers). Its last tokens may still be on the device when the plan is made: a pass that preempts
first reads every flight (a host sync, only in such a pass), which may end requests and free blocks,
and plans again.
"""

from __future__ import annotations

from hkserve.engine.scheduler import Row, Scheduler


class Preemption:
    """Preemption (see the module docstring); InferenceRunner provides the state."""

    def _fit_step(self) -> None:
        pool = self.engine.kv_pool
        if pool is None:
            return
        scheduler = Scheduler(pool)  # the engine's pool of now (a reset makes a new one)
        plan = scheduler.plan_step(self._step_rows(), self._idle_by_age())
        if plan.preempt:
            for flight in self._in_flight:
                self._deliver(flight)
            self._in_flight = []
            plan = scheduler.plan_step(self._step_rows(), self._idle_by_age())
        for slot in plan.evict:
            self._evict(slot)
        for slot in plan.preempt:
            self._preempt(slot)
        for row in self._step_rows():
            pool.reserve(row.slot, row.tokens)

    def _step_rows(self) -> list[Row]:
        """Each running request's row: its memory once this pass's step is written, at most (a full slot
        does not step: it ends). A speculating engine's step may write `step_tokens` positions from its
        host position, an upper bound while a verify step is in flight (the runner's `length` counts one
        token per step)."""
        e = self.engine
        return [
            Row(i, s.stream.order, min(max(s.length, int(e.positions[i])) + e.step_tokens, e.max_len))
            for i, s in enumerate(self._slots)
            if s is not None
        ]

    def _idle_by_age(self) -> list[int]:
        return self.prefix.by_age([i for i, s in enumerate(self._slots) if s is None])

    def _preempt(self, slot: int) -> None:
        """The request in `slot` gives its blocks back and waits at the front of the queue, its tokens kept."""
        stream = self._slots[slot].stream
        self._slots[slot] = None
        self._prefills.pop(slot, None)  # mid-prefill: it starts over when readmitted
        self.grammars.release(slot)
        self._evict(slot)
        self.preemptions += 1
        with self._lock:
            self._waiting.appendleft(stream)
