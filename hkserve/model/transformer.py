"""The decoder: embeddings, a scanned stack of pre-norm blocks, final norm, output head.

`forward(params, tokens, memory, lengths)` is the one entry point for both prefill and decode:
row b holds `lengths[b]` real tokens (right-padded to T) placed at positions `memory.step[b] + t`.
A prefill is T = bucket on an empty slot; a decode step is T = 1 on every slot at its own position,
with `lengths = 0` for idle slots (nothing written, step unchanged).
"""

from __future__ import annotations

import functools

import haiku as hk
import jax
import jax.numpy as jnp

from hkserve.kernels import dispatch
from hkserve.kernels.dispatch import KernelSpec
from hkserve.model import layer_loop, layer_weights
from hkserve.model.attention import Attention, HeldKV, reads_own_length
from hkserve.model.config import ModelConfig
from hkserve.model.layers import F32, MLP, Embed, Linear, MoE, RMSNorm, norm_dtype, param_dtype
from hkserve.model.memory import KVMemory, init_memory
from hkserve.model.model import Model
from hkserve.model.packing import pack_params
from hkserve.model.paged_memory import PagedKVMemory, decode_kernel, read_past, write_new


def _decoder(
    config: ModelConfig,
    layers: str,
    tokens,
    memory: KVMemory | PagedKVMemory,
    lengths,
    slots,
    attend_len: int,
    last_only: bool,
):
    c = config
    dtype, ndtype = param_dtype(c), norm_dtype(c)
    b, t = tokens.shape
    # Row i of `tokens` belongs to memory slot rows[i]: all slots (decode) or a few (prefill).
    rows = jnp.arange(b) if slots is None else slots  # [b]
    past_len = memory.step if slots is None else memory.step[rows]  # [b]
    positions = past_len[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [b, T]
    embed = Embed(c.vocab_size, c.dim, dtype)
    x = embed(tokens) * c.embedding_multiplier  # [b, T, D]

    def norm(name: str):
        return RMSNorm(c.norm_eps, ndtype, name, c.norm_offset)

    def pre_norm(name: str):  # OLMo 2 has none: only the norms after each sub-block
        return norm(name) if c.pre_norms else (lambda x: x)

    def block(x, per_layer):
        layer, window, theta, rope_on = per_layer
        with layer_weights.at_layer(layer):
            return _block(x, layer, window, (theta, rope_on))

    paged = isinstance(memory, PagedKVMemory)
    # Past positions each row reads. Paged: none for a row writing nothing (an idle slot may have
    # given its blocks back while its step still counts them).
    seen = jnp.where(lengths > 0, past_len, 0) if paged else past_len  # [b]
    # A decode step with the CPU kernels reads each layer's memory in place (kernels/attention.cc), each
    # row up to its own length: attend_len is not read then (attention.py `reads_own_length`).
    in_place = slots is None and t == 1 and reads_own_length(c, dispatch.active(), memory.k.dtype)
    # Otherwise a paged decode step may read its blocks through the Pallas kernel (a GPU's default).
    pallas = decode_kernel(c, memory) if paged and slots is None and t == 1 and not in_place else None

    def _block(x, layer, window, rope_spec):
        if in_place or pallas:
            k_past = v_past = None
            held = HeldKV(memory.k, memory.v, layer, memory.table if paged else None, pallas or "cpu")
        elif paged:  # gather the rows' blocks up to the window (paged_memory.py)
            table = memory.table[rows]  # [b, MB]
            k_past, v_past = (
                read_past(jax.lax.dynamic_index_in_dim(cache, layer, 0, keepdims=False), table, attend_len)
                for cache in (memory.k, memory.v)
            )  # [b, W, Hkv, Dh]
            held = None
        else:  # read this layer's past straight from the memory (no stacked copy of the window is made)
            k_past = jax.lax.dynamic_index_in_dim(memory.k, layer, 0, keepdims=False)  # [B, S, Hkv, Dh]
            v_past = jax.lax.dynamic_index_in_dim(memory.v, layer, 0, keepdims=False)
            if slots is None:
                k_past, v_past = k_past[:, :attend_len], v_past[:, :attend_len]  # [B, W, Hkv, Dh]
            else:
                k_past, v_past = k_past[rows, :attend_len], v_past[rows, :attend_len]  # [b, W, Hkv, Dh]
            held = None
        h, k_new, v_new = Attention(c)(
            pre_norm("attn_norm")(x), positions, k_past, v_past, seen, window, rope_spec, held
        )
        if c.sandwich_norms:
            h = norm("post_attn_norm")(h)
        x = x + h * c.residual_multiplier
        ffn = MoE(c) if c.n_experts else MLP(c)
        h = ffn(pre_norm("mlp_norm")(x))
        if c.sandwich_norms:
            h = norm("post_mlp_norm")(h)
        return x + h * c.residual_multiplier, (k_new, v_new)

    per_layer = (
        jnp.arange(c.n_layers),
        jnp.asarray(c.layer_windows(), jnp.int32),
        jnp.asarray(c.layer_rope_thetas(), F32),
        jnp.asarray(c.layer_rope_on(), F32),
    )
    if layers == "loop":  # per-layer weights, no slices of a stack (layer_loop.py)
        new = []
        for i in range(c.n_layers):
            with hk.experimental.name_scope(layer_loop.layer_scope(i)):
                x, kv = block(x, (i, *(p[i] for p in per_layer[1:])))
            new.append(kv)
        k_new, v_new = (jnp.stack(parts) for parts in zip(*new, strict=True))
    else:
        stack = hk.layer_stack(c.n_layers, with_per_layer_inputs=True, name="layers")
        x, (k_new, v_new) = stack(block)(x, per_layer)  # k_new: [L, b, T, Hkv, Dh]

    # Write the new keys once, outside the scan, so the donated memory is updated in place.
    # Padding (t >= lengths[b]) goes to index S, which mode="drop" discards.
    t_idx = jnp.arange(t, dtype=jnp.int32)[None, :]
    real = t_idx < lengths[:, None]  # [B, T]
    if paged:
        memory = write_new(memory, rows, positions, real, k_new, v_new)
    else:
        write_pos = jnp.where(real, positions, memory.max_len)  # [B, T]
        memory = memory._replace(
            k=memory.k.at[:, rows[:, None], write_pos].set(k_new.astype(memory.k.dtype), mode="drop"),
            v=memory.v.at[:, rows[:, None], write_pos].set(v_new.astype(memory.v.dtype), mode="drop"),
        )
    memory = memory._replace(step=memory.step.at[rows].add(lengths.astype(jnp.int32)))

    if last_only:  # prefill samples from the last real token only: skip the [T, V] head matmul
        last = jnp.maximum(lengths - 1, 0)
        x = x[jnp.arange(b), last][:, None, :]  # [B, 1, D]
    x = norm("final_norm")(x)
    if c.tie_embeddings:
        logits = embed.unembed(x)
    else:
        logits = Linear(c.vocab_size, param_dtype(c, "lm_head"), "lm_head")(x)
    if last_only:
        logits = logits[:, 0]  # [B, V]
    logits = logits * c.output_multiplier
    if c.final_logit_cap:
        logits = c.final_logit_cap * jnp.tanh(logits / c.final_logit_cap)
    return logits, memory


def _transform(config: ModelConfig, kernels: KernelSpec | None, layers: str = "scan"):
    def fn(tokens, memory, lengths, slots, attend_len, last_only):
        with dispatch.using(kernels), hk.experimental.name_scope("decoder"):
            return _decoder(config, layers, tokens, memory, lengths, slots, attend_len, last_only)

    return hk.without_apply_rng(hk.transform(fn))


def build_kv_model(config: ModelConfig, kernels: KernelSpec | None = None, layers: str | None = None) -> Model:
    """The KV-memory decoder of `config` (Llama-family, MoE, grok-1, Qwen, Gemma and Phi-3 options).

    With `kernels` (CPU) a decode step's attention reads the KV memory in place (kernels/attention.cc);
    a quantized model's spec also runs its int8/int4 products through the C++ kernels, on params that
    `prepare` packed once from the stored ones; `init` stays plain. A float model's (attention-only)
    spec changes nothing else: its params and products stay XLA's.
    `layers` "loop" (the default on GPUs, layer_loop.py) runs the blocks as a Python loop over the
    per-layer weights that `prepare` unstacks once; forward takes stacked params too (slicing them)."""
    layers = layer_loop.default_mode() if layers is None else layers
    if layers not in layer_loop.MODES:
        raise ValueError(f"layers must be one of {', '.join(layer_loop.MODES)}, got {layers!r}")
    quantized = kernels is not None and not kernels.attention_only  # packed products, held out of the scan
    if layers == "loop" and quantized:
        raise ValueError("the CPU kernels read the stacked layer weights: use layers='scan' with them")
    plain = _transform(config, None)
    transformed = plain if kernels is None and layers == "scan" else _transform(config, kernels, layers)

    def init_args():
        return jnp.zeros((1, 1), jnp.int32), init_memory(config, 1, 1), jnp.ones((1,), jnp.int32), None, 1, False

    def init(rng) -> hk.Params:
        return plain.init(rng, *init_args())

    def forward(
        params,
        tokens,
        memory: KVMemory | PagedKVMemory,
        lengths,
        slots=None,
        attend_len: int | None = None,
        last_only: bool = False,
    ):
        """tokens: [b, T] int32; lengths: [b]; slots: [b] memory slots of the rows (default: row i is
        slot i, b = B). Returns (logits [b,T,V], or [b,V] if last_only, and the updated memory).

        `attend_len` (static) bounds how much of the past is read: it must be >= the rows' steps;
        serving picks it from a few buckets so decode cost follows the context actually in use.
        """
        attend_len = memory.max_len if attend_len is None else attend_len
        if layers == "loop" and not layer_loop.is_unstacked(params):
            params = layer_loop.unstack(params, config.n_layers)
        if not quantized:
            return transformed.apply(params, tokens, memory, lengths, slots, attend_len, last_only)
        params, held = layer_weights.split(params)  # the kernels read these in place (layer_weights.py)
        with layer_weights.holding(held):
            return transformed.apply(params, tokens, memory, lengths, slots, attend_len, last_only)

    if layers == "loop":
        unstack = functools.partial(layer_loop.unstack, n_layers=config.n_layers)
        return Model(config=config, init=init, forward=forward, prepare=unstack, kernels=kernels)
    if not quantized:
        return Model(config=config, init=init, forward=forward, kernels=kernels)
    served = jax.eval_shape(lambda: transformed.init(jax.random.PRNGKey(0), *init_args()))
    prepare = functools.partial(pack_params, served=served)
    return Model(config=config, init=init, forward=forward, prepare=prepare, kernels=kernels)
