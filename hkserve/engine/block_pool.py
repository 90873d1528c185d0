"""The host side of a paged KV memory: which pool blocks each slot holds, the free lists, and the
block table the device reads (model/paged_memory.py).

Owned by the one thread that owns the Engine, like the rest of its host state. A slot is given
blocks as its length grows (`grow`, before the device call that writes there) and gives them back
when its memory is dropped (`drop`, `truncate`). Each data shard of the mesh has its own part of the
pool: the slots of shard d (slots d*B/D .. (d+1)*B/D - 1) take only blocks d*NB/D .. (d+1)*NB/D - 1,
which lie on that shard's devices.

Each running request is promised (`reserve`) the blocks of its next step only: before each step the
runner's Scheduler (engine/scheduler.py) preempts the newest requests of a shard whose promises would
not fit, and admission (engine/admission.py) admits only while the promises, a new request's prompt
and first token, and the blocks that idle slots keep for the prefix cache fit the shard (`fits`): so
a step's `grow` never finds its shard empty.
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
        self.dirty = True  # the device's copy of the table is stale

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def shard(self, slot: int) -> int:
        return slot // self.slots_per_shard

    @property
    def used(self) -> int:
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
            self.table[slot, len(held)] = free[-1]
            held.append(free.pop())
        self.dirty = True

    def truncate(self, slot: int, tokens: int) -> None:
        """Slot `slot` keeps only the blocks of its first `tokens` positions; the rest are free."""
        held, free = self.held[slot], self._free[self.shard(slot)]
        keep = self.blocks_for(tokens)
        while len(held) > keep:
            self.table[slot, len(held) - 1] = self.total
            free.append(held.pop())
            self.dirty = True

    def drop(self, slot: int) -> None:
        """The slot's memory is gone: all its blocks are free."""
        self.truncate(slot, 0)

    def reserve(self, slot: int, tokens: int) -> None:
        """The request admitted to `slot` may grow to `tokens` positions (0: none runs there)."""
        self.reserved[slot] = self.blocks_for(tokens)

    def committed(self, shard: int, leaving: int | None = None) -> int:
        """Blocks of `shard` held or promised, slot `leaving`'s aside: each slot's reservation or,
        where larger (an idle slot's prefix-cache blocks), what it holds."""
        lo = shard * self.slots_per_shard
        return sum(
            max(len(self.held[s]), self.reserved[s]) for s in range(lo, lo + self.slots_per_shard) if s != leaving
        )

    def fits(self, slot: int, tokens: int) -> bool:
        """Can slot `slot` (whatever it holds now is dropped or reused) take a request growing to
        `tokens` positions while every promise of its shard is kept?"""
        return self.committed(self.shard(slot), slot) + self.blocks_for(tokens) <= self.per_shard

    def fits_evicting_idle(self, slot: int, tokens: int) -> bool:
        """`fits`, once every idle slot's cached blocks were dropped: only the running requests'
        promises (a running slot never holds more than it was promised) stay."""
        lo = self.shard(slot) * self.slots_per_shard
        promised = sum(self.reserved[s] for s in range(lo, lo + self.slots_per_shard) if s != slot)
        return promised + self.blocks_for(tokens) <= self.per_shard

    def check(self) -> None:
        """Every block either free or held by one slot of its shard, and the table saying so (tests)."""
        owners: dict[int, int] = {}
        for slot, held in enumerate(self.held):
            for j, block in enumerate(held):
                if block in owners or block // self.per_shard != self.shard(slot):
                    raise AssertionError(f"block {block} of slot {slot} is held twice or by another shard")
                if self.table[slot, j] != block:
                    raise AssertionError(f"table row {slot} says {self.table[slot, j]} at {j}, not {block}")
                owners[block] = slot
            if (self.table[slot, len(held) :] != self.total).any():
                raise AssertionError(f"table row {slot} names blocks past the {len(held)} it holds")
        free = [block for blocks in self._free for block in blocks]
        if len(set(free)) != len(free) or set(free) & set(owners) or len(free) + len(owners) != self.total:
            raise AssertionError("a block is free twice, free and held, or lost")
