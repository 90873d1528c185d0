"""The host side of a paged KV memory: which pool blocks each slot holds, the free lists, and the
block table the device reads (model/paged_memory.py).

Owned by the one thread that owns the Engine, like the rest of its host state. A slot is given
blocks as its length grows (`grow`, before the device call that writes there) and lets go of them
when its memory is dropped (`drop`, `truncate`).

Blocks are shared by reference (issue 34, step 2): a slot whose prompt starts with a prefix another
slot holds names that slot's full blocks in its own table row (`share`) instead of a copy. `refs`
counts the table rows naming each block; a block is free exactly when no row names it. A slot only
ever writes positions past the full blocks it shares (copy-on-write: the partial last block of a
reused prefix is the slot's own, `unshare_tail`), so a shared block is never written. `used` counts
each block once: those held by running slots and those idle slots keep for the prefix cache.

Each data shard of the mesh has its own part of the pool: the slots of shard d (slots d*B/D ..
(d+1)*B/D - 1) take only blocks d*NB/D .. (d+1)*NB/D - 1,
which lie on that shard's devices.

Each running request is promised (`reserve`) the blocks of its next step only: before each step the
runner's Scheduler (engine/scheduler.py) preempts the newest requests of a shard whose promises would
not fit, and admission (engine/admission.py) admits only while the promises, a new request's prompt
and first token, and the blocks that slots name (each once, idle slots' prefix-cache blocks too) fit
the shard (`fits`): so a step's `grow` never finds its shard empty.
"""

from __future__ import annotations

import numpy as np


class PoolExhausted(RuntimeError):
    """A slot needed a block and its shard had none free."""


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int, slots: int, max_blocks: int, shards: int = 1):
        if n_blocks % shards or slots % shards or n_blocks < shards:
            raise ValueError(f"{n_blocks} blocks and {slots} slots do not divide over {shards} data shards")
        self.total, self.block_size, self.shards = n_blocks, block_size, shards
        self.per_shard, self.slots_per_shard = n_blocks // shards, slots // shards
        # Free lists as stacks (the last freed block is taken first), lowest blocks on top at the start.
        self._free = [list(range((d + 1) * self.per_shard - 1, d * self.per_shard - 1, -1)) for d in range(shards)]
        self.held: list[list[int]] = [[] for _ in range(slots)]  # each slot's blocks, in position order
        self.reserved = [0] * slots  # blocks promised to each slot's running request (0: none running)
        self.table = np.full((slots, max_blocks), n_blocks, np.int32)  # [B, MB]: NB where no block is held
        self.refs = np.zeros(n_blocks, np.int32)  # [NB]: table rows naming each block (0: free)
        self.dirty = True  # the device's copy of the table is stale

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def shard(self, slot: int) -> int:
        return slot // self.slots_per_shard

    @property
    def used(self) -> int:
        """Distinct blocks named by some table row (running or idle slots'), each counted once."""
        return self.total - sum(len(free) for free in self._free)

    def free_blocks(self, shard: int = 0) -> int:
        return len(self._free[shard])

    def grow(self, slot: int, tokens: int) -> None:
        """Slot `slot` holds blocks for its first `tokens` positions. Raises PoolExhausted (taking
        nothing) when its shard lacks the blocks."""
        held, free = self.held[slot], self._free[self.shard(slot)]
        need = self.blocks_for(tokens) - len(held)
        if need <= 0:
            return
        if need > len(free):
            raise PoolExhausted(
                f"the KV pool has {len(free)} free blocks of {self.block_size} tokens for slot {slot}, "
                f"which needs {need} more"
            )
        for _ in range(need):
            self._name(slot, free.pop())

    def truncate(self, slot: int, tokens: int) -> None:
        """Slot `slot` keeps only the blocks of its first `tokens` positions; the rest it lets go of
        (free once no other row names them)."""
        held, free = self.held[slot], self._free[self.shard(slot)]
        keep = self.blocks_for(tokens)
        while len(held) > keep:
            self.table[slot, len(held) - 1] = self.total
            block = held.pop()
            self.refs[block] -= 1
            if self.refs[block] == 0:
                free.append(block)
            self.dirty = True

    def _name(self, slot: int, block: int) -> None:
        """Slot `slot`'s next position block is `block` (fresh, or shared: one more row names it)."""
        held = self.held[slot]
        self.table[slot, len(held)] = block
        held.append(block)
        self.refs[block] += 1
        self.dirty = True

    def shareable(self, dest: int, source: int, tokens: int) -> int:
        """How many of slot source's blocks slot dest can share for a prefix of `tokens` positions:
        the full ones, and none across data shards (a shard reads only its own blocks)."""
        if self.shard(dest) != self.shard(source) or dest == source:
            return 0
        return min(tokens // self.block_size, len(self.held[source]))

    def share(self, dest: int, source: int, tokens: int) -> None:
        """Slot dest (holding nothing) names slot source's full blocks of the first `tokens` positions."""
        if self.held[dest]:
            raise ValueError(f"slot {dest} shares a prefix only when it holds nothing")
        for block in self.held[source][: self.shareable(dest, source, tokens)]:
            self._name(dest, block)

    def unshare_tail(self, slot: int, tokens: int) -> int | None:
        """Copy-on-write: when the block holding position `tokens` (the next the slot writes) is
        shared, the slot takes a fresh block in its place. Returns the shared block, whose content
        the device must copy into the fresh one (None: nothing to copy)."""
        held, free = self.held[slot], self._free[self.shard(slot)]
        j = tokens // self.block_size
        if j >= len(held) or self.refs[held[j]] == 1:
            return None
        if not free:
            raise PoolExhausted(f"the KV pool has no free block for slot {slot}'s copy of a shared block")
        old, held[j] = held[j], free.pop()
        self.refs[old] -= 1
        self.refs[held[j]] = 1
        self.table[slot, j] = held[j]
        self.dirty = True
        return old

    def drop(self, slot: int) -> None:
        """The slot's memory is gone: all its blocks are free."""
        self.truncate(slot, 0)

    def reserve(self, slot: int, tokens: int) -> None:
        """The request admitted to `slot` may grow to `tokens` positions (0: none runs there)."""
        self.reserved[slot] = self.blocks_for(tokens)

    def _promised(self, slots: list[int]) -> int:
        """Blocks `slots` name (a shared block once) plus those their running requests may still take."""
        named = {block for s in slots for block in self.held[s]}
        return len(named) + sum(max(0, self.reserved[s] - len(self.held[s])) for s in slots)

    def committed(self, shard: int, leaving: int | None = None) -> int:
        """Blocks of `shard` named or promised, slot `leaving`'s aside: every block some slot names
        (idle slots' prefix-cache blocks too), once, and what running requests may still grow into."""
        lo = shard * self.slots_per_shard
        return self._promised([s for s in range(lo, lo + self.slots_per_shard) if s != leaving])

    def fits(self, slot: int, tokens: int, shared: int = 0) -> bool:
        """Can slot `slot` (whatever it holds now is dropped or reused) take a request growing to
        `tokens` positions, `shared` of its blocks another slot's (`shareable`), while every promise
        of its shard is kept?"""
        return self.committed(self.shard(slot), slot) + self.blocks_for(tokens) - shared <= self.per_shard

    def fits_evicting_idle(self, slot: int, tokens: int) -> bool:
        """`fits`, once every idle slot's cached blocks were dropped: only the running requests'
        blocks and promises (a running slot never holds more than it was promised) stay."""
        lo = self.shard(slot) * self.slots_per_shard
        running = [s for s in range(lo, lo + self.slots_per_shard) if s != slot and self.reserved[s]]
        return self._promised(running) + self.blocks_for(tokens) <= self.per_shard

    def check(self) -> None:
        """Every block either free or named by rows of its shard as many times as `refs` says, the
        table saying what each slot holds, and no free block named (tests)."""
        names = np.zeros(self.total, np.int32)  # [NB]
        for slot, held in enumerate(self.held):
            for j, block in enumerate(held):
                if block // self.per_shard != self.shard(slot) or block in held[:j]:
                    raise AssertionError(f"block {block} of slot {slot} is another shard's or held twice by it")
                if self.table[slot, j] != block:
                    raise AssertionError(f"table row {slot} says {self.table[slot, j]} at {j}, not {block}")
                names[block] += 1
            if (self.table[slot, len(held) :] != self.total).any():
                raise AssertionError(f"table row {slot} names blocks past the {len(held)} it holds")
        if (names != self.refs).any():
            wrong = np.flatnonzero(names != self.refs)
            raise AssertionError(f"blocks {wrong} have refcounts {self.refs[wrong]}, named by {names[wrong]} rows")
        free = [block for blocks in self._free for block in blocks]
        if len(set(free)) != len(free) or names[free].any() or len(free) + np.count_nonzero(names) != self.total:
            raise AssertionError("a block is free twice, free and named, or lost")
