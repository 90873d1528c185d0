"""KV memory: the attention cache of every layer, batched over serving slots (grok-1's KVMemory).

The layers are stacked on a leading axis because the decoder scans over them; `step` is shared by
all layers since every layer sees the same tokens.

`init_memory`, `insert_slot` and `reset_slot` also serve Transformer-VQ's VQMemory (model/vq_memory.py):
init by config.memory, the others by the memory's type, so a caller handles either kind alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hkserve.model import vq_memory
from hkserve.model.config import ModelConfig
from hkserve.model.vq_memory import VQMemory


class KVMemory(NamedTuple):
    k: jax.Array  # [L, B, S, Hkv, Dh] keys, already rotated (RoPE applied)
    v: jax.Array  # [L, B, S, Hkv, Dh]
    step: jax.Array  # [B] int32: tokens written per slot = position of the next token

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def cache_dtype(config: ModelConfig):
    """The KV memory's dtype: config.kv_dtype (--kv-dtype), or under "auto" float32 for float32 weights and
    bfloat16 for every narrower kind (bfloat16, int8, int4: half the bytes, as llama.cpp's f16 default;
    quantized weights' perplexity moves by 0.04-0.21% on 2.6k tokens, docs/benchmarks.md, KV dtype). A
    bfloat16 memory holds each key and value rounded once, as written; attention reads it widened to
    float32 (model/attention.py, the CPU kernel's bf16 variant in kernels/attention.cc)."""
    if config.kv_dtype != "auto":
        return jnp.dtype(config.kv_dtype)
    return jnp.dtype(jnp.float32 if config.dtype == "float32" else jnp.bfloat16)


def init_memory(config: ModelConfig, batch: int, max_len: int) -> KVMemory | VQMemory:
    """Empty memory for `batch` slots of `max_len` positions (a VQMemory, which has no length axis,
    for memory="vq").

    K and V are separate zero arrays (not one array twice) so both can be donated to a step.
    """
    if config.memory == "vq":
        return vq_memory.init_memory(config, batch)
    shape = (config.n_layers, batch, max_len, config.n_kv_heads, config.head_dim)
    dtype = cache_dtype(config)
    return KVMemory(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), step=jnp.zeros((batch,), jnp.int32))


def insert_slot(memory: KVMemory, slot_memory: KVMemory, slot: jax.Array | int) -> KVMemory:
    """Copy a one-slot memory (from a prefill) into slot `slot` of the batched memory.

    The slot memory may be shorter than the batched one: positions past it are zeroed in the slot.
    """
    if isinstance(memory, VQMemory):
        return vq_memory.insert_slot(memory, slot_memory, slot)
    if slot_memory.batch != 1:
        raise ValueError(f"insert_slot takes a one-slot memory, got batch {slot_memory.batch}")
    pad = memory.max_len - slot_memory.max_len
    if pad < 0:
        raise ValueError(f"slot memory of {slot_memory.max_len} positions exceeds {memory.max_len}")
    widths = [(0, 0), (0, 0), (0, pad), (0, 0), (0, 0)]
    k = jnp.pad(slot_memory.k.astype(memory.k.dtype), widths)
    v = jnp.pad(slot_memory.v.astype(memory.v.dtype), widths)
    slot = jnp.asarray(slot, jnp.int32)
    zero = jnp.int32(0)
    start = (zero, slot, zero, zero, zero)
    return KVMemory(
        k=jax.lax.dynamic_update_slice(memory.k, k, start),
        v=jax.lax.dynamic_update_slice(memory.v, v, start),
        step=jax.lax.dynamic_update_slice(memory.step, slot_memory.step, (slot,)),
    )


def reset_slot(memory: KVMemory | VQMemory, slot: jax.Array | int) -> KVMemory | VQMemory:
    """Slot `slot` empty again. KV: step 0 is enough (positions past step are never read)."""
    if isinstance(memory, VQMemory):
        return vq_memory.reset_slot(memory, slot)
    return memory._replace(step=memory.step.at[slot].set(0))
