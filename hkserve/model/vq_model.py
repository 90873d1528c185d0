"""The Transformer-VQ decoder: embeddings, a scanned stack of 2 * n_layers GAUs (pre-norm residual
x + gau(x); two GAUs make a layer, there is no MLP), optional final RMSNorm, output head + bias.

Serving: `build_vq_model(config)` gives the same `Model` as the KV decoder (build_model dispatches to
it), with `forward(params, tokens, memory, lengths, slots, attend_len, last_only)` of the same meaning.
The whole input is one block (window M + T keys), so a prefill takes any bucket T and a decode step
T = 1. Its `params` is the *serving tree*: the Haiku params with the codebook state merged in, under
module paths ending in "/codebook" ({".../gau/codebook": {"c_sum", "c_count"}}), so checkpointing,
sharding and conversion see one tree; `split_serving_params` takes it apart again.

Serving precomputes what depends on the params alone: `prepare` adds every GAU's position keys R
(under "decoder/layers/gau/position_keys"), which `forward` then reads instead of projecting the
sinusoids again in every decode step. Unprepared params work too (R computed per call).

Training: `init_train`, `train_forward` (blocks of vq_block_len in a scan, straight-through keys),
`ema_update` (the codebook's only update) and `serving_params` to hand the result to serving.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from hkserve.model.config import ModelConfig
from hkserve.model.layers import Embed, Linear, RMSNorm, norm_dtype, param_dtype
from hkserve.model.model import Model
from hkserve.model.vq_attention import GAU, position_keys
from hkserve.model.vq_memory import VQMemory, init_memory, read_rows, write_rows

F32 = jnp.float32
CODEBOOK = "/codebook"  # module path suffix of the codebook state in the serving tree
POSITION_KEYS = "decoder/layers/gau/position_keys"  # added by `prepare`: {"r": [G, H, M+1, dk]}


class TrainAux(NamedTuple):
    commit: jax.Array  # []: mean ||k - sg(codes[z])||^2 over tokens, heads, GAUs and blocks (gradient to k only)
    stats: (
        dict  # like the codebook: {".../codebook": {"c_sum": [G,H,C,dk] sum 1[z=s] k, "c_count": [G,H,C] sum 1[z=s]}}
    )


def _decoder(c: ModelConfig, tokens, memory: VQMemory, lengths, slots, last_only: bool, is_train: bool, r=None):
    b = tokens.shape[0]
    step, states = read_rows(memory, slots)  # row i of `tokens` is memory slot slots[i] (None: slot i)
    embed = Embed(c.vocab_size, c.dim, param_dtype(c))
    x = embed(tokens) * c.embedding_multiplier  # [b, T, D]

    def block(x, per_layer):
        state, r_layer = per_layer if r is not None else (per_layer, None)
        h, state, aux = GAU(c)(x, state, step, lengths, is_train, r_layer)
        return x + h, (state, aux)

    stack = hk.layer_stack(2 * c.n_layers, with_per_layer_inputs=True, name="layers")
    x, (states, aux) = stack(block)(x, states if r is None else (states, r))  # r: [G, H, M+1, dk]
    memory = write_rows(memory, slots, states, lengths)

    if last_only:  # prefill samples from the last real token only: skip the [T, V] head matmul
        x = x[jnp.arange(b), jnp.maximum(lengths - 1, 0)][:, None, :]  # [b, 1, D]
    if c.vq_e_preln:
        x = RMSNorm(c.norm_eps, norm_dtype(c), "final_norm")(x)
    logits = embed.unembed(x) if c.tie_embeddings else Linear(c.vocab_size, param_dtype(c), "lm_head")(x)
    with hk.experimental.name_scope("out_bias"):
        logits = logits + hk.get_parameter("b", [c.vocab_size], norm_dtype(c), init=jnp.zeros).astype(F32)
    if last_only:
        logits = logits[:, 0]  # [b, V]
    return logits * c.output_multiplier, memory, aux


@functools.cache
def _transformed(config: ModelConfig) -> hk.TransformedWithState:
    def fn(tokens, memory, lengths, slots, last_only, is_train, r=None):
        with hk.experimental.name_scope("decoder"):
            return _decoder(config, tokens, memory, lengths, slots, last_only, is_train, r)

    return hk.without_apply_rng(hk.transform_with_state(fn))


def init_train(config: ModelConfig, rng) -> tuple[hk.Params, hk.State]:
    """(Haiku params, codebook state) of a fresh model."""
    return _transformed(config).init(
        rng, jnp.zeros((1, 1), jnp.int32), init_memory(config, 1), jnp.ones((1,), jnp.int32), None, False, False
    )


def serving_params(params: hk.Params, codebook: hk.State) -> dict:
    """The one tree `forward` takes: params and codebook under disjoint module paths."""
    return {**params, **codebook}


def split_serving_params(tree: dict) -> tuple[hk.Params, hk.State]:
    """Inverse of serving_params: (params, codebook); prepared position keys are left out."""
    params = {k: v for k, v in tree.items() if not k.endswith(CODEBOOK) and k != POSITION_KEYS}
    return params, {k: v for k, v in tree.items() if k.endswith(CODEBOOK)}


def train_forward(config: ModelConfig, params, codebook, tokens, carry: VQMemory, is_train: bool = True):
    """Logits [B,T,V] float32, TrainAux and the carried memory after tokens [B,T] (T a multiple of
    vq_block_len), block by block in a scan. The state passes between blocks without gradient (the
    reference's grad_thru_cache=0); within a block keys are straight-through, so gradients reach k.
    With is_train=False the aux is None (plain evaluation)."""
    bsz, t = tokens.shape
    blk = config.vq_block_len
    if t % blk:
        raise ValueError(f"sequence length {t} is not a multiple of vq_block_len={blk}")
    transformed = _transformed(config)
    lengths = jnp.full((bsz,), blk, jnp.int32)

    def one_block(carry, block):  # block: [B, L]
        (logits, carry, aux), _ = transformed.apply(params, codebook, block, carry, lengths, None, False, is_train)
        return jax.lax.stop_gradient(carry), (logits, aux)

    blocks = tokens.reshape(bsz, t // blk, blk).transpose(1, 0, 2)  # [N, B, L]
    carry, (logits, aux) = jax.lax.scan(one_block, carry, blocks)
    logits = logits.transpose(1, 0, 2, 3).reshape(bsz, t, -1)
    if aux is None:
        return logits, None, carry
    commit, count, k_sum = aux  # [N, G], [N, G, H, C], [N, G, H, C, dk]
    (path,) = codebook  # the one stacked codebook module
    stats = {path: {"c_sum": k_sum.sum(axis=0), "c_count": count.sum(axis=0)}}
    return logits, TrainAux(jnp.mean(commit), stats), carry


def ema_update(codebook: hk.State, stats: dict, gamma: float = 0.99) -> hk.State:
    """c_sum <- gamma c_sum + (1 - gamma) sum 1[z=s] k ;  c_count <- gamma c_count + (1 - gamma) sum 1[z=s]."""
    return jax.tree_util.tree_map(lambda c, s: gamma * c + (1 - gamma) * s.astype(c.dtype), codebook, stats)


def build_vq_model(config: ModelConfig) -> Model:
    transformed = _transformed(config)

    def init(rng) -> dict:
        return serving_params(*init_train(config, rng))

    def prepare(params) -> dict:
        """The serving tree plus every GAU's position keys, computed once (jit it with shardings)."""
        w_r = params["decoder/layers/gau/r_proj"]["w"]  # [G, D, H*dk]
        if "scale" in params["decoder/layers/gau/r_proj"]:  # int8 storage
            w_r = w_r.astype(jnp.float32) * params["decoder/layers/gau/r_proj"]["scale"][:, None, :]
        return {**params, POSITION_KEYS: {"r": position_keys(w_r, config)}}

    def forward(
        params, tokens, memory: VQMemory, lengths, slots=None, attend_len: int | None = None, last_only: bool = False
    ):
        """tokens [b, T] int32 placed after memory.step of their rows; lengths [b] real tokens (rows with
        0 are left untouched); slots [b] memory rows (default: row i is slot i). attend_len is ignored:
        the state has no length axis. Returns (logits [b,T,V], or [b,V] if last_only, the memory)."""
        weights, codebook = split_serving_params(params)
        r = params[POSITION_KEYS]["r"] if POSITION_KEYS in params else None
        (logits, memory, _), _ = transformed.apply(
            weights, codebook, tokens, memory, lengths, slots, last_only, False, r
        )
        return logits, memory

    return Model(config=config, init=init, forward=forward, prepare=prepare)
