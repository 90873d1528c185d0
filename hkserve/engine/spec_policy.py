"""When speculation pays: per slot, from the acceptance its request has shown, and per step, from
how many slots are decoding (a verify step costs every row K+1 positions of compute, which the
spare compute of a small batch absorbs and a large one does not).

A slot drafts until its recent verify steps emit fewer tokens each, on average, than a verify step
costs in plain steps at the batch it ran in (`step_cost`, `min_tokens` at least); then it decodes
plainly for a back-off that doubles each time it fails again (capped), and probes
once more, or sooner when the lookup, run on the host over the tokens it emits meanwhile, would have
proposed the right next token from its longest suffix `wake` times in a row (an edit's output starts copying after its
preamble). A new request in the slot starts afresh.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MODES = ("off", "ngram")


@dataclass(frozen=True)
class SpecConfig:
    """How speculative decoding runs (`--speculative`, `--num-speculative-tokens`)."""

    k: int = 8  # drafts per verify step: 8 gave bench spec's edit 1.52x where 4 gave 1.36x, chat the same
    ngram_sizes: tuple[int, ...] = (1, 2, 3, 4)  # suffix lengths searched, longest match wins
    max_batch: int = 8  # the crossover: above this many decoding slots every step is plain
    min_tokens: float = 1.6  # tokens a verify step must emit per slot, on average, to keep drafting (at least)
    window: int = 4  # verify steps averaged before first judging a slot
    probe: int = 2  # verify steps averaged when a slot comes back from a back-off
    backoff: int = 16  # plain steps before a failing slot probes again (doubling up to max_backoff)
    max_backoff: int = 256
    wake: int = 3  # consecutive right first drafts (host lookup) that end a back-off early
    # A verify step's cost in plain steps grows by this much per drafted position (B rows x K drafts):
    # on the 2-core CPU a [B, K+1] step cost 1.07-1.77x a plain one for 8-16 positions, 2.3x for 32,
    # 3.1x for 64 (docs/benchmarks.md, "Verify-step cost").
    row_cost: float = 0.04

    def __post_init__(self) -> None:
        if not 1 <= self.k <= 16:
            raise ValueError(f"--num-speculative-tokens must be in 1..16, got {self.k}")
        if not self.ngram_sizes or min(self.ngram_sizes) < 1:
            raise ValueError(f"n-gram sizes must be positive, got {self.ngram_sizes}")


@dataclass
class SpecCounts:
    """Totals since start, for /metrics (device-reported: tokens past a request's end count too)."""

    verify_rows: int = 0  # slot-steps verified with at least one draft
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    @property
    def mean_accepted(self) -> float:
        return self.accepted / self.verify_rows if self.verify_rows else 0.0


@dataclass
class _SlotPolicy:
    recent: list[int] = field(default_factory=list)  # tokens emitted by its last verify steps
    judged: bool = False  # failed once: later judgements are quick probes
    hits: int = 0  # consecutive right first drafts while off
    off_for: int = 0  # plain steps left before it drafts again
    backoff: int = 0


class SpecPolicy:
    """The host's view of acceptance. Fed one step late (the runner's pipelining), which only delays
    a decision by a step."""

    def __init__(self, config: SpecConfig, slots: int):
        self.config = config
        self.slots = [_SlotPolicy(backoff=config.backoff) for _ in range(slots)]
        self.counts = SpecCounts()
        # Decoding slots at the last plan. A verify step is judged a step after it ran (the runner reads one
        # step behind), so this is its batch unless a request started or ended in between.
        self._batch = 1

    def step_cost(self, batch: int) -> float:
        """Tokens a slot must emit per verify step, on average, to pay for it in a batch of `batch`."""
        c = self.config
        return max(c.min_tokens, 1.0 + c.row_cost * batch * c.k)

    def restart(self, slot: int) -> None:
        self.slots[slot] = _SlotPolicy(backoff=self.config.backoff)

    def plan(self, active: np.ndarray) -> np.ndarray | None:
        """Rows [B] bool that draft in this step, or None for a plain step (also when none would)."""
        self._batch = max(int(active.sum()), 1)
        if self._batch > self.config.max_batch:
            return None
        rows = np.asarray([bool(a) and s.off_for == 0 for a, s in zip(active, self.slots)])
        for a, s in zip(active, self.slots):
            if a and s.off_for:
                s.off_for -= 1
        return rows if rows.any() else None

    def resting(self, slot: int) -> bool:
        return self.slots[slot].off_for > 0

    def shadow(self, slot: int, hit: bool) -> None:
        """While off: whether the lookup would have proposed the token that came."""
        s = self.slots[slot]
        s.hits = s.hits + 1 if hit else 0
        if s.hits >= self.config.wake:
            s.off_for, s.hits = 0, 0

    def observe(self, slot: int, drafted: int, emitted: int) -> None:
        """One verify step's outcome for a drafting slot."""
        c, s = self.config, self.slots[slot]
        if drafted:
            self.counts.verify_rows += 1
            self.counts.drafted += drafted
            self.counts.accepted += emitted - 1
        window = c.probe if s.judged else c.window
        s.recent = (s.recent + [emitted])[-window:]
        if len(s.recent) < window:
            return
        if sum(s.recent) / len(s.recent) < self.step_cost(self._batch):
            s.off_for, s.backoff, s.recent = s.backoff, min(2 * s.backoff, c.max_backoff), []
            s.judged = True
        else:
            s.backoff = c.backoff
