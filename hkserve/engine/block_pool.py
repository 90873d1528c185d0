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

The pool is also the prefix cache (block_cache.py): a full block whose KV a prefill computed, or
(mode "on") a finished request's over its prompt and reply, is registered under its prefix's chain
hash (`register`); when no row names it any more it is parked in
its shard's LRU instead of freed, findable by a later prompt (`adopt`), and evicted only when its
shard's free list is empty and a block is taken. `used` counts the blocks some row names; parked
blocks are `cached`, and admission counts them as available (they are evicted on demand).

Each running request is promised (`reserve`) the blocks of its next step only: before each step the
runner's Scheduler (engine/scheduler.py) preempts the newest requests of a shard whose promises would
not fit, and admission (engine/admission.py) admits only while the promises, a new request's prompt
and first token, and the blocks that slots name (each once, idle slots' prefix-cache blocks too) fit
the shard (`fits`): so a step's `grow` never finds its shard empty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from hkserve.engine.block_cache import ROOT, BlockCache
from hkserve.engine.prefix_cache import PrefixCache, Reuse


class PoolExhausted(RuntimeError):
    """A slot needed a block and its shard had none free."""


def cached_reuse(
    pool: BlockPool | None, prefix: PrefixCache, slot: int, prompt: list[int], reuse: Reuse | None
) -> Reuse | None:
    """Admission's question to the pool: `reuse` (what the slots' memories give, PrefixCache.place),
    or the pool's cached blocks holding a longer prefix of `prompt` for `slot`. The blocks' length is
    whole blocks, whole granules (mode "exact") and leaves a prompt token to prefill."""
    if pool is None or prefix.mode == "off":
        return reuse
    bs, have = pool.block_size, reuse.length if reuse else 0
    unit = math.lcm(bs, prefix.granule)
    blocks = pool.cached_prefix(slot, prompt, (len(prompt) - 1) // unit * unit // bs)
    length = len(blocks) * bs // unit * unit
    if length <= have or length < prefix.min_reuse:
        return reuse
    prefix.hit += length - have
    return Reuse(slot, length, tuple(blocks[: length // bs]))


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
        self.refs = np.zeros(n_blocks, np.int32)  # [NB]: table rows naming each block (0: free or parked)
        self.cache = BlockCache(shards, block_size)  # full blocks findable by their prefix
        self.dirty = True  # the device's copy of the table is stale

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def shard(self, slot: int) -> int:
        return slot // self.slots_per_shard

    @property
    def used(self) -> int:
        """Distinct blocks named by some table row (running or idle slots'), each counted once."""
        return self.total - sum(len(free) for free in self._free) - self.cached

    @property
    def cached(self) -> int:
        """Cached blocks no row names: kept for the prefix cache, evicted when the pool needs them."""
        return sum(self.cache.idle(d) for d in range(self.shards))

    def free_blocks(self, shard: int = 0) -> int:
        """Blocks `shard` can give: the free ones and the evictable cached ones."""
        return len(self._free[shard]) + self.cache.idle(shard)

    def _take(self, shard: int) -> int:
        """A block for a slot: the last freed, else the least recently parked cached one (evicted)."""
        free = self._free[shard]
        block = free.pop() if free else self.cache.evict(shard)
        if block is None:
            raise PoolExhausted(f"the KV pool's shard {shard} has no free or evictable block")
        return block

    def _let_go(self, block: int) -> None:
        """One row fewer names `block`: with none left it is parked when cached, else free."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            shard = block // self.per_shard
            if block in self.cache.entries:
                self.cache.park(shard, block)
            else:
                self._free[shard].append(block)

    def grow(self, slot: int, tokens: int) -> None:
        """Slot `slot` holds blocks for its first `tokens` positions. Raises PoolExhausted (taking
        nothing) when its shard lacks the blocks."""
        held, shard = self.held[slot], self.shard(slot)
        need = self.blocks_for(tokens) - len(held)
        if need <= 0:
            return
        if need > self.free_blocks(shard):
            raise PoolExhausted(
                f"the KV pool has {self.free_blocks(shard)} free blocks of {self.block_size} tokens for "
                f"slot {slot}, which needs {need} more"
            )
        for _ in range(need):
            self._name(slot, self._take(shard))

    def truncate(self, slot: int, tokens: int) -> None:
        """Slot `slot` keeps only the blocks of its first `tokens` positions; the rest it lets go of
        (free once no other row names them)."""
        held = self.held[slot]
        keep = self.blocks_for(tokens)
        while len(held) > keep:
            self.table[slot, len(held) - 1] = self.total
            self._let_go(held.pop())
            self.dirty = True

    def _name(self, slot: int, block: int) -> None:
        """Slot `slot`'s next position block is `block` (fresh, or shared: one more row names it)."""
        held = self.held[slot]
        self.table[slot, len(held)] = block
        held.append(block)
        if self.refs[block] == 0 and block in self.cache.entries:
            self.cache.unpark(self.shard(slot), block)
        self.refs[block] += 1
        self.dirty = True

    def shareable(self, dest: int, source: int, tokens: int) -> int:
        """How many of slot source's blocks slot dest can share for a prefix of `tokens` positions:
        the full ones, and none across data shards (a shard reads only its own blocks)."""
        if self.shard(dest) != self.shard(source) or dest == source:
            return 0
        return min(tokens // self.block_size, len(self.held[source]))

    def reused(self, dest: int, reuse: Reuse) -> int:
        """How many blocks of `reuse` slot dest would name that other rows of its
        shard name already (counted once by `fits`): a source slot's `shareable` ones, or cached blocks."""
        if not reuse.blocks:
            return self.shareable(dest, reuse.source, reuse.length)
        return sum(int(self.refs[b]) - (b in self.held[dest]) > 0 for b in reuse.blocks)

    def share(self, dest: int, source: int, tokens: int) -> None:
        """Slot dest (holding nothing) names slot source's full blocks of the first `tokens` positions."""
        if self.held[dest]:
            raise ValueError(f"slot {dest} shares a prefix only when it holds nothing")
        for block in self.held[source][: self.shareable(dest, source, tokens)]:
            self._name(dest, block)

    def unshare_tail(self, slot: int, tokens: int) -> int | None:
        """Copy-on-write: when the block holding position `tokens` (the next the slot writes) is
        shared or cached (its KV findable by its prefix), the slot takes a fresh block in its place.
        Returns the old block, whose content the device must copy into the fresh one (None: nothing
        to copy)."""
        held = self.held[slot]
        j = tokens // self.block_size
        if j >= len(held) or (self.refs[held[j]] == 1 and held[j] not in self.cache.entries):
            return None
        if not self.free_blocks(self.shard(slot)):
            raise PoolExhausted(f"the KV pool has no free block for slot {slot}'s copy of a shared block")
        old, fresh = held[j], self._take(self.shard(slot))  # old is named: never the block evicted
        held[j], self.table[slot, j] = fresh, fresh
        self.refs[fresh] = 1
        self._let_go(old)
        self.dirty = True
        return old

    def register(self, slot: int, tokens: Sequence[int], upto: int) -> None:
        """Slot `slot`'s memory holds the KV of `tokens` (its first positions): its full blocks within
        the first `upto` positions become findable by their prefix (block_cache.py)."""
        link, bs, shard = ROOT, self.block_size, self.shard(slot)
        for j, block in enumerate(self.held[slot][: min(upto, len(tokens)) // bs]):
            link = self.cache.register(shard, block, link, tokens[j * bs : (j + 1) * bs])
            if link is None:
                return

    def cached_prefix(self, slot: int, prompt: Sequence[int], limit: int) -> list[int]:
        """The cached blocks holding `prompt`'s first full blocks (at most `limit`) in slot's shard."""
        return self.cache.match(self.shard(slot), prompt, limit)

    def adopt(self, slot: int, blocks: Sequence[int]) -> None:
        """Slot dest (holding nothing) names cached `blocks` as its first positions. Raises ValueError
        (taking nothing) when one is not a cached block of its shard."""
        if self.held[slot]:
            raise ValueError(f"slot {slot} adopts cached blocks only when it holds nothing")
        for block in blocks:
            if block not in self.cache.entries or block // self.per_shard != self.shard(slot):
                raise ValueError(f"block {block} is not a cached block of slot {slot}'s shard")
        for block in blocks:
            self._name(slot, block)

    def drop(self, slot: int) -> None:
        """The slot's memory is gone: its blocks no other row names are free (cached ones parked)."""
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
        """Every block either free, parked or named by rows of its shard as many times as `refs` says,
        the table saying what each slot holds, no free block named or cached, and a cached block
        either named or parked, never both (tests)."""
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
        self.cache.check()
        free, parked = [block for blocks in self._free for block in blocks], self.cache.parked()
        if len(set(free)) != len(free) or names[free].any() or any(b in self.cache.entries for b in free):
            raise AssertionError("a block is free twice, or free and named or cached")
        for block in self.cache.entries:
            if (names[block] > 0) == (block in parked):
                raise AssertionError(
                    f"cached block {block} is {'both named and' if names[block] else 'neither named nor'} parked"
                )
        if len(free) + len(parked) + np.count_nonzero(names) != self.total:
            raise AssertionError("a block is lost: neither free, parked nor named")
