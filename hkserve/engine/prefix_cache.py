"""Prefix caching's host side: which tokens each slot's KV memory holds, and where a prompt should go.

The slots are the cache (llama.cpp server's design): a finished request's slot keeps its KV until it is
reused. A new prompt goes to the slot holding its longest common prefix when that slot is free, else to
the least recently used free slot, with the prefix copied there on the device from the slot that holds
it (running or not: a running slot never rewrites positions before its current length). Under the
paged layout the block pool is a cache beyond the slots (block_cache.py): admission then asks it for
cached full blocks holding more of the prompt (block_pool.cached_reuse).

Modes (docs/prefix-caching.md says what each guarantees):
  * "on": reuse any KV the memory holds, prompt and generated tokens alike, at any length.
  * "exact": every prompt is prefilled in fixed chunks of `granule` tokens at multiples of it, and only
    whole chunks of prefill-computed KV are reused, so a cached prefill computes bit for bit what an
    uncached one does.
  * "off": none of it.

Only the runner's loop thread calls a PrefixCache (on multi-host servers: host 0's; its decisions reach
the other hosts as arguments of the broadcast prefill call).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

MODES = ("on", "exact", "off")
DEFAULT_MODE = "on"  # docs/benchmarks.md: what "exact" costs in TTFT
DEFAULT_MIN_REUSE = 16  # shorter common prefixes are not worth a copy: the suffix prefill costs the same


class Reuse(NamedTuple):
    """Prefill with the first `length` prompt tokens taken from slot `source`'s memory, or (paged, with
    `blocks`) from the pool's cached blocks holding them (block_cache.py; `source` is then the slot
    itself)."""

    source: int
    length: int
    blocks: tuple[int, ...] = ()  # [length / block_size] cached blocks; () for a slot's memory

    def __repr__(self) -> str:  # the slots' reuse as before the blocks were added (error messages)
        blocks = f", blocks={self.blocks}" if self.blocks else ""
        return f"Reuse(source={self.source}, length={self.length}{blocks})"


class Placement(NamedTuple):
    slot: int  # where the prompt goes
    reuse: Reuse | None  # None: prefill it all


@dataclass
class _Record:
    tokens: list[int] = field(default_factory=list)  # the prompt, then the tokens delivered so far
    valid: int = 0  # leading tokens whose KV the memory holds
    exact: int = 0  # leading tokens whose KV a fixed-chunk prefill computed (the "exact" mode's reusable part)
    used: int = 0  # LRU clock of the last admission or finish


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """The host record of every slot's memory contents and the slot choice that uses it."""

    def __init__(self, slots: int, mode: str = "on", granule: int = 1, min_reuse: int = DEFAULT_MIN_REUSE):
        if mode not in MODES:
            raise ValueError(f"prefix cache mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.granule, self.min_reuse = mode, max(1, granule), max(1, min_reuse)
        self._records = [_Record() for _ in range(slots)]
        self._clock = itertools.count(1)
        self.looked_up = 0  # prompt tokens looked up, over all admissions
        self.hit = 0  # of those, served from memory

    def usable(self, slot: int, prompt: list[int]) -> int:
        """How many of the prompt's leading tokens slot `slot` can give it. At least one prompt token is
        always prefilled, so the first sampled token comes from a fresh forward."""
        record = self._records[slot]
        bound = record.exact if self.mode == "exact" else record.valid
        n = min(common_prefix(prompt, record.tokens[:bound]), len(prompt) - 1)
        n -= n % self.granule
        return n if n >= self.min_reuse else 0

    def place(self, prompt: list[int], free: list[int], lookup: bool = True) -> Placement:
        """Choose a free slot for `prompt` (`free` non-empty) and the prefix it reuses, if any (none
        without `lookup`). Mode "off" takes the first free slot."""
        if self.mode == "off":
            return Placement(free[0], None)
        lru = min(free, key=lambda s: self._records[s].used)
        if not lookup:
            return Placement(lru, None)
        self.looked_up += len(prompt)
        # Longest usable prefix; on a tie a free slot (no copy), then the most recently used.
        best, length = max(
            ((s, self.usable(s, prompt)) for s in range(len(self._records))),
            key=lambda sl: (sl[1], sl[0] in free, self._records[sl[0]].used),
        )
        if length == 0:
            return Placement(lru, None)
        self.hit += length
        return Placement(best if best in free else lru, Reuse(best, length))

    def by_age(self, slots: list[int]) -> list[int]:
        """`slots`, least recently used first (the order a paged pool evicts idle slots' blocks in)."""
        return sorted(slots, key=lambda s: self._records[s].used)

    def admitted(self, slot: int, prompt: list[int], exact: bool = True) -> None:
        """The prompt was prefilled into `slot` (every prefill starts a slot afresh); not `exact` when
        another program than the plain prefill computed its KV (a scoring prefill)."""
        self._records[slot] = _Record(list(prompt), len(prompt), len(prompt) if exact else 0, next(self._clock))

    def delivered(self, slot: int, token: int) -> None:
        """A token generated in `slot`; its KV is written by the step that takes it as input."""
        self._records[slot].tokens.append(token)

    def finished(self, slot: int, written: int) -> None:
        """The request in `slot` ended with `written` tokens in the slot's memory."""
        record = self._records[slot]
        record.valid = min(len(record.tokens), written)
        record.used = next(self._clock)

    def written(self, slot: int) -> list[int]:
        """The tokens whose KV `slot`'s memory holds (as of `finished`): its prompt, then its reply."""
        record = self._records[slot]
        return record.tokens[: record.valid]

    def forget(self, slot: int) -> None:
        """The slot's memory holds nothing reusable (a failed or partial prefill)."""
        self._records[slot] = _Record(used=self._records[slot].used)

    def clear(self) -> None:
        """The engine's memory was reset."""
        for slot in range(len(self._records)):
            self.forget(slot)
