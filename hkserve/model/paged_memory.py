"""Paged KV memory: keys and values in fixed-size blocks of one pool per layer, and a block table
per slot saying which blocks hold its positions (vLLM's PagedAttention layout).

Position p of slot b lives at block table[b, p // bs], offset p % bs. A table entry of a block the
slot does not hold is NB (one past the pool): writes there are dropped, and reads clip it to a real
block whose contents are masked out (only positions < step are ever seen). The host owns the table
(engine/block_pool.py) and the device holds a copy in the memory, so a compiled step reads it in
place; the model never allocates.

Reading a row's past gathers its first ceil(W / bs) blocks into [W, Hkv, Dh], position = index as
in the static layout, so attention computes the same numbers on either layout. A decode step may
instead read the blocks in place: the C++ kernel on a CPU (kernels/attention.cc), the Pallas kernel
(model/paged_pallas.py) on a GPU, by `decode_kernel`.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkserve.model import paged_pallas
from hkserve.model.config import ModelConfig
from hkserve.model.memory import cache_dtype

log = logging.getLogger("hkserve.model")
KERNEL_ENV = "HKSERVE_PAGED_ATTENTION"
KERNEL_CHOICES = ("auto", "pallas", "xla", "interpret")


class PagedKVMemory(NamedTuple):
    k: jax.Array  # [L, NB, bs, Hkv, Dh] the pool's keys, already rotated (RoPE applied)
    v: jax.Array  # [L, NB, bs, Hkv, Dh]
    step: jax.Array  # [B] int32: tokens written per slot = position of the next token
    table: jax.Array  # [B, MB] int32: block of each slot's j-th bs positions; NB where none is held

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * self.block_size


def init_paged_memory(config: ModelConfig, batch: int, blocks: int, block_size: int, max_len: int) -> PagedKVMemory:
    """An empty pool of `blocks` blocks of `block_size` positions, and a table for `batch` slots of
    up to `max_len` positions each (rounded up to whole blocks), holding no block."""
    shape = (config.n_layers, blocks, block_size, config.n_kv_heads, config.head_dim)
    dtype = cache_dtype(config)
    max_blocks = -(-max_len // block_size)
    return PagedKVMemory(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        step=jnp.zeros((batch,), jnp.int32),
        table=jnp.full((batch, max_blocks), blocks, jnp.int32),
    )


def read_past(cache: jax.Array, table: jax.Array, attend_len: int) -> jax.Array:
    """One layer's pool cache [NB, bs, Hkv, Dh] and rows' tables [b, MB] → their first attend_len
    positions [b, W, Hkv, Dh] (blocks not held read as some pool block: callers mask them)."""
    bs = cache.shape[1]
    n = -(-attend_len // bs)
    blocks = jnp.take(cache, table[:, :n], axis=0, mode="clip")  # [b, n, bs, Hkv, Dh]
    return blocks.reshape(blocks.shape[0], n * bs, *cache.shape[2:])[:, :attend_len]


def write_new(
    memory: PagedKVMemory, rows: jax.Array, positions: jax.Array, real: jax.Array, k_new: jax.Array, v_new: jax.Array
) -> PagedKVMemory:
    """Write k_new/v_new [L, b, T, Hkv, Dh] of rows [b] at positions [b, T] where real [b, T]; the
    rest (padding, and blocks a row does not hold) is dropped."""
    bs, nb = memory.block_size, memory.k.shape[1]
    column = jnp.clip(positions // bs, 0, memory.table.shape[1] - 1)
    block = jnp.take_along_axis(memory.table[jnp.clip(rows, 0, memory.step.shape[0] - 1)], column, axis=1)  # [b, T]
    block = jnp.where(real & (positions < memory.max_len), block, nb)
    offset = positions % bs
    return memory._replace(
        k=memory.k.at[:, block, offset].set(k_new.astype(memory.k.dtype), mode="drop"),
        v=memory.v.at[:, block, offset].set(v_new.astype(memory.v.dtype), mode="drop"),
    )


def decode_kernel(config: ModelConfig, memory: PagedKVMemory) -> str | None:
    """How a paged decode step (one token per row) reads its past when the CPU kernels do not:
    "pallas" (paged_pallas.py under Triton), "interpret" (the same kernel in Pallas's interpreter: the
    tests' way on a CPU) or None, XLA's gather (read_past). HKSERVE_PAGED_ATTENTION=auto|pallas|xla|
    interpret chooses, read when the step is traced. auto is the kernel on a GPU (on an H200 it compiled
    under Triton, gave the gather's logits and greedy tokens, and took 4-7% off SmolLM2's paged step at
    16 and 64 rows: docs/benchmarks.md) and the gather elsewhere. A pool the kernel cannot read, or more
    than one GPU (the kernel has no sharding rule), falls back to the gather with a log line."""
    choice = os.environ.get(KERNEL_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNEL_ENV} must be one of {', '.join(KERNEL_CHOICES)}, got {choice!r}")
    backend = jax.default_backend()
    if choice == "auto":
        choice = "pallas" if backend == "gpu" else "xla"
    if choice == "xla":
        return None
    if choice == "pallas" and backend != "gpu":
        raise ValueError(f"{KERNEL_ENV}=pallas needs a GPU backend, this is {backend} (interpret runs it here)")
    reason = paged_pallas.unsupported(memory.block_size, config.head_dim, memory.k.dtype)
    if reason is None and choice == "pallas" and jax.device_count() > 1:
        reason = f"a mesh of {jax.device_count()} devices (it runs on one)"
    if reason is not None:
        log.warning("paged decode attention: XLA's gather, not the Pallas kernel: %s", reason)
        return None
    return choice
