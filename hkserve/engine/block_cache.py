"""The paged pool as the prefix cache: full KV blocks findable by the tokens of the prefix they end
(vLLM's hash-keyed block cache; issue 34).

A full block whose KV a prefill computed is registered under the chain hash of its prefix: block i's
key is `chain_hash(key of block i-1, tokens of block i)`. So, in prefix-cache mode "on", is a finished
request's block over its prompt and reply (paged_slots.py `_cache_reply`): the chain goes on past the
prompt, and a chat's next turn finds the reply's blocks as it finds a prompt's. A block stays
findable while it is named by any slot and, once no slot names it (`BlockPool.drop`, `truncate`),
while the pool has room: such a block is parked in its shard's LRU instead of the free list, and the
pool takes the least recently parked one (`evict`) only when the free list is empty. A new prompt
walks its full blocks from the first and takes, by reference, every block the cache holds for its
prefix, whatever slot it lands in.

A hash alone could collide: each entry also keeps its block's tokens and a serial naming the entry of
the block before it (serials are never reused, even when a block id is), and a lookup accepts a block
only when both match what it walked so far. By induction the whole prefix is equal, not just a hash.

Pure host bookkeeping, owned by the BlockPool (block_pool.py), which keeps `refs`; the pool calls
`park` / `unpark` as a cached block's refcount leaves or reaches zero.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from typing import NamedTuple


class Link(NamedTuple):
    """The end of a walked prefix: its last entry's serial and key."""

    serial: int
    key: int


ROOT = Link(0, 0)  # the prefix "before" a prompt's first block


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """A block's key: its prefix's key before it and its own tokens."""
    return hash((parent, tokens))


class Entry(NamedTuple):
    key: int  # chain_hash of the prefix this block ends
    serial: int  # this entry's identity (never reused)
    parent: int  # serial of the entry of the block before it (ROOT.serial: the first block)
    tokens: tuple[int, ...]  # the block's tokens [block_size]


class BlockCache:
    """Key → block per data shard, and the LRU of cached blocks no slot names (module docstring)."""

    def __init__(self, shards: int, block_size: int):
        self.block_size = block_size
        self._by_key: list[dict[int, int]] = [{} for _ in range(shards)]  # per shard: key → block
        self.entries: dict[int, Entry] = {}  # block → its entry, for every cached block
        self._idle: list[collections.OrderedDict[int, None]] = [collections.OrderedDict() for _ in range(shards)]
        self._serials = itertools.count(ROOT.serial + 1)

    def idle(self, shard: int) -> int:
        """Cached blocks of `shard` no slot names: evictable, so available to the pool."""
        return len(self._idle[shard])

    def parked(self) -> list[int]:
        """Every unreferenced cached block, each shard's least recently parked first."""
        return [block for lru in self._idle for block in lru]

    def register(self, shard: int, block: int, parent: Link, tokens: Sequence[int]) -> Link | None:
        """Block `block` (named by a slot, full) holds the KV of `tokens` after the prefix `parent`.
        Returns the link of the entry now holding that prefix: this block's, or the one cached before
        it for the same prefix (the block then stays uncached); None on a hash collision with another
        prefix (the rest of the prompt stays uncached)."""
        tokens = tuple(tokens)
        known = self.entries.get(block)
        if known is not None:  # a block taken from the cache, or registered by its own earlier prefill
            return Link(known.serial, known.key)
        key = chain_hash(parent.key, tokens)
        other = self._by_key[shard].get(key)
        if other is not None:
            held = self.entries[other]
            return Link(held.serial, key) if (held.parent, held.tokens) == (parent.serial, tokens) else None
        entry = Entry(key, next(self._serials), parent.serial, tokens)
        self._by_key[shard][key], self.entries[block] = block, entry
        return Link(entry.serial, key)

    def match(self, shard: int, prompt: Sequence[int], limit: int) -> list[int]:
        """The cached blocks holding `prompt`'s leading full blocks, at most `limit` of them, walked from
        the first while each block's tokens and predecessor match."""
        blocks, key, serial, bs = [], ROOT.key, ROOT.serial, self.block_size
        for j in range(min(limit, len(prompt) // bs)):
            tokens = tuple(prompt[j * bs : (j + 1) * bs])
            key = chain_hash(key, tokens)
            block = self._by_key[shard].get(key)
            if block is None or (self.entries[block].parent, self.entries[block].tokens) != (serial, tokens):
                break
            blocks.append(block)
            serial = self.entries[block].serial
        return blocks

    def park(self, shard: int, block: int) -> None:
        """No slot names cached block `block` any more: it becomes the most recently used evictable one."""
        self._idle[shard][block] = None

    def unpark(self, shard: int, block: int) -> None:
        """A slot names cached block `block` again: it is not evictable while it does."""
        del self._idle[shard][block]

    def evict(self, shard: int) -> int | None:
        """Forget the least recently parked block of `shard` and return it for reuse (None: none parked)."""
        if not self._idle[shard]:
            return None
        block, _ = self._idle[shard].popitem(last=False)
        entry = self.entries.pop(block)
        del self._by_key[shard][entry.key]
        return block

    def check(self) -> None:
        """Every key names a cached block whose entry has that key, and every parked block is cached (tests)."""
        for shard, by_key in enumerate(self._by_key):
            for key, block in by_key.items():
                if self.entries.get(block, Entry(None, 0, 0, ())).key != key:
                    raise AssertionError(f"key {key} of shard {shard} names block {block}, not cached under it")
            if any(block not in self.entries for block in self._idle[shard]):
                raise AssertionError(f"a parked block of shard {shard} is not cached")
        if sum(len(by_key) for by_key in self._by_key) != len(self.entries):
            raise AssertionError("a cached block is findable by no key")
