"""The paged layout's scheduling policy: which running rows keep their blocks through the next step,
which idle slots' cached blocks go, and which requests are preempted (issue 34, step 3).

Pure and lock-free: it reads the block pool and the rows it is shown and returns a decision; the
runner's loop (runner.py, admission.py) applies it — frees blocks, requeues the preempted — and keeps
the threads, queues and the device pipeline (vLLM's Scheduler / EngineCore split).

Admission promises a request only the blocks it needs now (its prompt and the first step's token),
so the running rows' growth can outrun the pool. Before each step `plan_step` makes every shard's
next step fit: it first drops the least recently used idle slots' cached blocks, then preempts the
NEWEST running requests (by arrival order) of that shard. The oldest running request of a shard is
never preempted for a newer one: a request alone always fits its shard (submit refuses one whose
prompt + max_tokens exceed --max-len, and the pool holds at least --max-len per shard), so the
oldest always advances and no request waits forever.

Token-budget steps (`--max-step-tokens`, step 4): a pass carries the running rows' decode tokens and
a budget of prompt prefill tokens (`StepBudget`), counted as the chunks' padded buckets (what the device
computes). A pass's chunks are of `chunk_size`: the largest prefill bucket that fits that budget (at
least the smallest bucket), so a small budget cuts a long prompt into small chunks and a running
stream's gap grows by a small chunk's cost, not a 512-token one's. `plan_prefill` hands the budget to
the prefilling requests oldest first, whole chunks at a time; a pass whose budget takes no chunk still
runs the oldest request's next one, so a prompt always progresses (only a budget below the smallest
bucket, or the exact prefix cache's fixed chunk above it, needs that). A pass with no decode row takes
at least the largest bucket (nobody to stall).

The budget: `--max-step-tokens N` gives a pass N - rows prompt tokens. Without it (`default_step_budget`),
elsewhere than on the CPU a pass gets slots + 512 - rows (a chunk of the largest bucket beside any
rows); on the CPU it gets max(32, rows) (`StepBudget.floor`) rounded up to whole chunks of the largest
bucket within it, less than twice that (with the default buckets, the smallest bucket holding it): one
chunk of 32 beside up to 32 rows, of 64 beside 33..64, and so on. Why: on the CPU a decode step's cost
grows with its rows and a chunk's with its tokens, so a chunk that grows with the rows keeps a pass with
a chunk within about 2x the step alone (measured, float32: 32 tokens beside 16 rows, 64 beside 32 and 64
rows; docs/benchmarks.md, "At 16, 32 and 64 rows") while a crowded server prefills at least one prompt
token per decode row: admission keeps a fixed share of the pass. Twice the rows' tokens would put 64
beside 17..32 rows (~3x). A fixed slots + 32 (the earlier default) left 64 busy rows one 32-token chunk
a pass, and chat prompts queued for minutes.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

from hkserve.engine.block_pool import BlockPool
from hkserve.engine.options import DEFAULT_PREFILL_BUCKETS

# The CPU default's least prompt tokens a pass (beside at most 32 rows): a chunk of 32 keeps a pass within
# ~2x a 16-row decode step's time (docs/benchmarks.md, "Prefill chunks beside decode steps").
CPU_STEP_FLOOR = 32


class StepBudget(NamedTuple):
    """A loop pass's prompt tokens beside its decode rows (see the module docstring)."""

    total: int | None  # --max-step-tokens: decode rows + prompt tokens a pass; None: by the rows
    floor: int = CPU_STEP_FLOOR  # total None: max(floor, rows) prompt tokens, in whole chunks

    def prompt_tokens(self, rows: int, buckets: Sequence[int]) -> int:
        """A pass's prompt tokens beside `rows` decode rows; in a pass that decodes nothing (no stream to
        stall), at least the largest bucket, so a prompt arriving at an idle server is prefilled in the
        fewest passes (each pass reads every weight once)."""
        if self.total is not None:
            budget = self.total - rows
        else:  # max(floor, rows) rounded up to whole chunks of the largest bucket within it: under 2x it
            need = max(self.floor, rows)
            chunk = Scheduler.chunk_size(buckets, need)
            budget = -(-need // chunk) * chunk
        return budget if rows else max(budget, buckets[-1])


def default_step_budget(slots: int, backend: str) -> StepBudget:
    """The budget without `--max-step-tokens`: by the rows on the CPU; elsewhere the decode rows and one
    chunk of the largest default bucket (slots + 512)."""
    if backend == "cpu":
        return StepBudget(None)
    return StepBudget(slots + DEFAULT_PREFILL_BUCKETS[-1])


class Row(NamedTuple):
    slot: int
    order: int  # arrival order: a smaller one is older and is never preempted for a larger one
    tokens: int  # positions the row's memory holds once this pass's step is written


class StepPlan(NamedTuple):
    evict: list[int]  # idle slots whose cached blocks are dropped, least recently used first
    preempt: list[int]  # running slots freed and requeued, newest first


class Prefilling(NamedTuple):
    slot: int
    order: int  # arrival order: the oldest prefilling request gets the budget first
    chunks: list[int]  # padded tokens of each chunk still to prefill, in order


class Scheduler:
    """The policy over one BlockPool (see the module docstring)."""

    def __init__(self, pool: BlockPool):
        self.pool = pool

    def plan_step(self, rows: list[Row], idle_by_age: list[int]) -> StepPlan:
        """What must go so that every kept row holds `tokens` positions after this pass's step.
        `idle_by_age`: the slots with no running request, least recently used first (their held
        blocks are the prefix cache's, evictable). A block that several rows share (block_pool.py)
        is counted once per row: the plan errs toward evicting and preempting, never toward a step
        whose `grow` finds its shard empty."""
        pool, evict, preempt = self.pool, [], []
        for shard in range(pool.shards):
            mine = sorted((r for r in rows if pool.shard(r.slot) == shard), key=lambda r: r.order)
            need = sum(pool.blocks_for(r.tokens) for r in mine)
            idle = [s for s in idle_by_age if pool.shard(s) == shard and pool.held[s]]
            cached = sum(len(pool.held[s]) for s in idle)
            for slot in idle:
                if need + cached <= pool.per_shard:
                    break
                evict.append(slot)
                cached -= len(pool.held[slot])
            while need > pool.per_shard:
                if len(mine) == 1:  # cannot happen: submit refuses a request its shard cannot hold alone
                    raise AssertionError(
                        f"slot {mine[0].slot} alone needs more than its shard's {pool.per_shard} blocks"
                    )
                newest = mine.pop()
                preempt.append(newest.slot)
                need -= pool.blocks_for(newest.tokens)
        return StepPlan(evict, preempt)

    def roomy(self, free: list[int], tokens: int) -> list[int]:
        """The free slots whose shard can take a request needing `tokens` positions now, beside every
        running row's promise (`BlockPool.reserve`), once idle slots' cached blocks are evicted."""
        return [s for s in free if self.pool.fits_evicting_idle(s, tokens)]

    @staticmethod
    def chunk_size(buckets: Sequence[int], budget: int) -> int:
        """The chunk a pass with `budget` prompt tokens cuts prompts into: the largest of the (ascending)
        `buckets` that fits it, else the smallest."""
        return buckets[max(bisect.bisect_right(buckets, budget) - 1, 0)]

    @staticmethod
    def chunk_sizes(buckets: Sequence[int], budget: StepBudget, slots: int) -> tuple[int, ...]:
        """Every chunk size a runner of `budget` over `slots` can pick: a pass with a prompt still
        prefilling decodes 0 .. slots - 1 rows (the prompt's own slot is not one of them)."""
        tokens = (budget.prompt_tokens(rows, buckets) for rows in range(slots))
        return tuple(sorted({Scheduler.chunk_size(buckets, t) for t in tokens}))

    @staticmethod
    def plan_prefill(prefilling: list[Prefilling], budget: int, force: bool = True) -> list[tuple[int, int]]:
        """(slot, chunks) to prefill this pass, oldest first, within `budget` padded tokens (see the
        module docstring). A request gets chunks only once every older one has all of its own. With
        `force` (nothing else ran this pass), the oldest gets its next chunk even when it does not fit."""
        plan, left = [], budget
        for job in sorted(prefilling, key=lambda p: p.order):
            taken = 0
            while taken < len(job.chunks) and job.chunks[taken] <= left:
                left -= job.chunks[taken]
                taken += 1
            if force and not plan and not taken and job.chunks:  # nothing fits: the oldest's next chunk alone
                taken = 1
            if taken:
                plan.append((job.slot, taken))
            if taken < len(job.chunks):
                break
        return plan

    @staticmethod
    def admits(pending: int, budget: int) -> bool:
        """Whether a pass whose prefills already hold `pending` prompt tokens takes another request: while
        the budget is not spent, and always when nothing is pending (a prompt is always admitted)."""
        return pending == 0 or pending < budget
