"""The Engine's paged-layout half: its pool's size, the host block pool (block_pool.py) that follows
the slots' lengths, and the device's copy of the block table.

A mixin of Engine (engine.py), called by the thread that owns the engine. Every method that writes a
slot's memory first gives the slot its blocks on the host (raising PoolExhausted before any device
work) and then `sync_table` brings the device's table up to date, in one small donated call only
when the host's changed. Under the static layout `kv_pool` is None and all of this does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hkserve.engine.block_pool import BlockPool
from hkserve.engine.kv_layout import check_layout, pool_blocks
from hkserve.engine.prefix_cache import Reuse
from hkserve.model.config import ModelConfig
from hkserve.model.memory import init_memory
from hkserve.model.paged_memory import init_paged_memory


class PagedSlots:
    """Engine's paged-layout state (see the module docstring); Engine provides mesh, slots, max_len,
    positions, state and _compiled_fn."""

    kv_pool: BlockPool | None

    def _size_pool(self, config: ModelConfig, layout: str, kv_cache_mb: float | None, block_size: int) -> None:
        self.kv_layout = check_layout(config, layout, block_size, kv_cache_mb)
        self.block_size, self.kv_blocks = block_size, 0
        if self.kv_layout == "paged":
            model = self.mesh.shape["model"]
            heads = model if config.n_kv_heads % model == 0 else 1
            self.kv_blocks = pool_blocks(
                config, kv_cache_mb, self.slots, self.max_len, block_size, self.mesh.shape["data"], heads
            )

    def _empty_memory(self, config: ModelConfig):
        """A fresh memory of the engine's layout (traced inside the jitted reset), for a fresh pool."""
        if self.kv_layout != "paged":
            return init_memory(config, self.slots, self.max_len)
        return init_paged_memory(config, self.slots, self.kv_blocks, self.block_size, self.max_len)

    def _new_pool(self) -> None:
        """Every block free (with a fresh memory); None under the static layout."""
        self.kv_pool = None
        if self.kv_layout == "paged":
            max_blocks = -(-self.max_len // self.block_size)
            self.kv_pool = BlockPool(self.kv_blocks, self.block_size, self.slots, max_blocks, self.mesh.shape["data"])

    def sync_table(self) -> None:
        """The device's block table made the host's, where it changed."""
        if self.kv_pool is not None and self.kv_pool.dirty:
            # A copy: on the CPU the call may read the host array in place while it runs asynchronously,
            # and the pool edits its table for the next request meanwhile.
            self.state = self._compiled_fn("table", 0)(self.state, self.kv_pool.table.copy())
            self.kv_pool.dirty = False

    def _assign(self, slot: int, tokens: int, reuse: Reuse | None = None) -> np.ndarray | None:
        """Slot `slot` starts afresh with `tokens` positions, the first reuse.length its source's: in
        place (kept), another slot's full blocks shared by reference, or the pool's cached blocks
        (`reuse.blocks`). The partial last block of the prefix is the slot's own (copy-on-write).
        Returns the source's table row [MB] before the change, for the device copy of that block
        (`copy_prefix`; cached blocks: the slot's row after, so nothing is copied); None without a
        reuse or under the static layout."""
        pool = self.kv_pool
        if pool is None:
            return None
        source_row = pool.table[reuse.source].copy() if reuse else None
        if reuse and reuse.blocks:  # the pool's cached blocks: named, never copied (`copy_prefix`)
            if len(reuse.blocks) * pool.block_size != reuse.length:
                raise ValueError(f"{len(reuse.blocks)} cached blocks do not hold {reuse.length} tokens")
            pool.drop(slot)
            pool.adopt(slot, reuse.blocks)
            source_row = pool.table[slot].copy()
        elif reuse and reuse.source == slot:
            pool.truncate(slot, reuse.length)
            pool.unshare_tail(slot, reuse.length)
        else:
            pool.drop(slot)
            if reuse:
                pool.share(slot, reuse.source, reuse.length)
        pool.grow(slot, tokens)
        return source_row

    def _cache_prompt(self, slot: int, prompt_ids, exact: bool) -> None:
        """The prompt's KV was just prefilled into `slot`: its full blocks become findable by their
        prefix. In mode "exact" only whole fixed chunks a plain prefill computed (`exact`) are."""
        if self.kv_pool is None or self.prefix_cache == "off" or (self.prefix_cache == "exact" and not exact):
            return
        granule = self.prefill_chunk or 1
        self.kv_pool.register(slot, prompt_ids, len(prompt_ids) - len(prompt_ids) % granule)

    def _cache_reply(self, slot: int, written: Sequence[int]) -> None:
        """A finished request's full blocks over its prompt and reply become findable by their prefix,
        the chain continuing past the prompt, so a chat's next turn (prompt + reply + more) reuses
        them whatever slot it lands in. Mode "on" only: a decode step's KV is not bit for bit what a
        prefill computes, so in mode "exact" decode-written blocks are never registered (nor need a
        mark: the prompt's own blocks were registered by its prefill, and a later exact prefill of the
        same tokens registers its own blocks under the keys these would have taken)."""
        if self.prefix_cache == "on" and written:
            self.kv_pool.register(slot, written, len(written))

    def _grow(self, active: np.ndarray) -> None:
        """Each active slot holds a block for the position its step writes."""
        if self.kv_pool is not None:
            for slot in np.flatnonzero(active):
                self.kv_pool.grow(int(slot), int(self.positions[slot]) + 1)
            self.sync_table()

    def release(self, slot: int, keep: bool = False, written: Sequence[int] = ()) -> None:
        """The request in `slot` ended: its blocks go back to the pool, unless `keep` (the prefix cache
        may reuse them; admission counts them until the slot is taken again). `written`: the tokens
        whose KV the slot holds, prompt then reply (`_cache_reply`)."""
        if self.kv_pool is not None:
            self._cache_reply(slot, written)
            self.kv_pool.reserve(slot, 0)
            if not keep:
                self.kv_pool.drop(slot)
