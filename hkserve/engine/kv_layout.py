"""The engine's KV layout: "static" (every slot reserves --max-len positions, model/memory.py) or
"paged" (blocks of one pool, model/paged_memory.py, sized by --kv-cache-mb), and the pool's size.

A Transformer-VQ model keeps its fixed-size VQ memory under either layout: its state per slot does
not grow with the context, so there is nothing to page; it shares the server as before, one fixed
state per slot, and reports no pool.
"""

from __future__ import annotations

import logging

import jax
import numpy as np

from hkserve.model.config import ModelConfig
from hkserve.model.memory import cache_dtype

log = logging.getLogger("hkserve.engine")
LAYOUTS = ("static", "paged")
DEFAULT_LAYOUT = "paged"  # issue 34: the engine's memory model; "static" stays selectable
DEFAULT_BLOCK_SIZE = 32  # tokens per block (docs/benchmarks.md, "Paged KV": 16/32/64 measured)
GPU_SHARE = 0.85  # of a device's free memory after the weights, left to the pool (activations take the rest)


def check_layout(config: ModelConfig, layout: str, block_size: int, kv_cache_mb: float | None) -> str:
    """The layout this engine runs ("static" for a VQ model), refusing what it cannot."""
    if layout not in LAYOUTS:
        raise ValueError(f"kv layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if block_size < 1:
        raise ValueError(f"the KV block size must be a positive number of tokens, got {block_size}")
    if kv_cache_mb is not None and kv_cache_mb <= 0:
        raise ValueError(f"--kv-cache-mb must be positive, got {kv_cache_mb}")
    if layout == "paged" and config.memory == "vq":
        log.info("kv layout: a Transformer-VQ model keeps its fixed-size memory (nothing to page)")
        return "static"
    if layout == "static" and kv_cache_mb is not None:
        raise ValueError("--kv-cache-mb sizes the paged pool: use it with --kv-layout paged")
    return layout


def block_bytes(config: ModelConfig, block_size: int) -> int:
    """Bytes of one block: K and V of every layer for block_size positions."""
    item = np.dtype(cache_dtype(config)).itemsize
    return 2 * config.n_layers * block_size * config.n_kv_heads * config.head_dim * item


def pool_blocks(
    config: ModelConfig,
    kv_cache_mb: float | None,
    slots: int,
    max_len: int,
    block_size: int,
    data: int,
    head_shards: int,
) -> int:
    """Blocks of the pool, a multiple of the data shards. kv_cache_mb None: on an accelerator, what
    its free memory holds after the weights (GPU_SHARE of it, each device holding 1/data of the
    blocks and 1/head_shards of their heads); on the CPU, what the static layout would take
    (slots x max_len positions), so paged never holds less than static by default."""
    size = block_bytes(config, block_size)
    if kv_cache_mb is not None:
        blocks = int(kv_cache_mb * 2**20) // size
    else:
        stats = jax.devices()[0].memory_stats() if jax.default_backend() != "cpu" else None
        if stats and "bytes_limit" in stats:
            free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
            blocks = int(free * GPU_SHARE) * data * head_shards // size
        else:
            blocks = slots * -(-max_len // block_size)
    blocks -= blocks % data
    per_shard = blocks // data
    if per_shard * block_size < max_len:
        raise ValueError(
            f"a KV pool of {blocks} blocks of {block_size} tokens holds {per_shard * block_size} tokens per data "
            f"shard, less than one request of --max-len {max_len}: raise --kv-cache-mb or lower --max-len"
        )
    log.warning(
        "kv pool: %d blocks of %d tokens (%.1f MiB, %d tokens%s)",
        blocks,
        block_size,
        blocks * size / 2**20,
        blocks * block_size,
        f", {per_shard * block_size} per data shard" if data > 1 else "",
    )
    return blocks
