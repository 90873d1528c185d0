"""A checkpoint's tensors → the neutral layout of params.py, by a family's `TensorNames`: one mapping
for every file format (HF safetensors, GGUF, grok-1's arrays), which only supply `get(name)`.

The layout quirks are the names' flags: fused q|k|v and gate|up rows split, gpt-oss's interleaved
expert gate|up columns split, llama.cpp's q/k row permutation undone, a norm offset stored in the
weights taken off, [out, in] weights transposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np

from hkserve.checkpoint.family import TensorNames
from hkserve.model.config import ModelConfig

Neutral = Iterator[tuple[str, int | None, np.ndarray]]  # (key, layer or None, array), as params.py takes


class TensorSource(Protocol):
    def get(self, name: str) -> np.ndarray:
        """The tensor `name` as float32 ([out, in] for linear weights in HF and GGUF); an
        ImportFormatError when the file lacks it."""
        ...


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of attn_q/attn_k rows ([out, in]).

    llama.cpp interleaves each head's two rotary halves (pairs (0, Dh/2), (1, Dh/2+1), ...) so it can
    rotate adjacent pairs; we rotate halves (Hugging Face layout), so put the rows back.
    """
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class _Layer:
    """One layer's reads: names completed with the layer prefix, weights put in the neutral layout."""

    def __init__(self, source: TensorSource, names: TensorNames, config: ModelConfig, i: int):
        self.source, self.names, self.config = source, names, config
        self.prefix = names.layer_prefix.format(i=i)

    def raw(self, name: str) -> np.ndarray:
        return self.source.get(self.prefix + name)

    def linear(self, name: str) -> np.ndarray:  # [in, out]
        w = self.raw(name)
        return w.T if self.names.out_in else w

    def norm(self, name: str) -> np.ndarray:
        return _norm(self.raw(name), self.names, self.config)

    def experts(self, name: str) -> np.ndarray:  # [E, in, out]
        if "{e}" in name:
            w = np.stack([self.raw(name.format(e=e)) for e in range(self.config.n_experts)])
        else:
            w = self.raw(name)
        return w.swapaxes(1, 2) if self.names.out_in and not self.names.experts_in_out else w


def _norm(w: np.ndarray, names: TensorNames, config: ModelConfig) -> np.ndarray:
    """A norm weight as the decoder keeps it (without the offset the decoder adds)."""
    return w - np.float32(config.norm_offset) if names.norms_hold_offset else w


def _attention(layer: _Layer) -> dict:
    names, config = layer.names, layer.config
    if names.qkv_proj:  # rows: [q | k | v]
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        q, k, v = np.split(layer.raw(names.qkv_proj), [q_rows, q_rows + kv_rows])
    else:
        q, k, v = layer.raw(names.q_proj), layer.raw(names.k_proj), layer.raw(names.v_proj)
    if names.permuted_qk:
        q, k = unpermute_rope_rows(q, config.n_heads), unpermute_rope_rows(k, config.n_kv_heads)
    if names.out_in:
        q, k, v = q.T, k.T, v.T
    out = {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": layer.linear(names.o_proj)}
    if config.qkv_bias:
        out.update(q_bias=layer.raw(names.q_bias), k_bias=layer.raw(names.k_bias), v_bias=layer.raw(names.v_bias))
    if config.o_bias:
        out["o_bias"] = layer.raw(names.o_bias)
    if config.attn_sinks:
        out["sinks"] = layer.raw(names.sinks)
    if config.qk_norm:
        out.update(q_norm=layer.norm(names.q_norm), k_norm=layer.norm(names.k_norm))
    return out


def _norms(layer: _Layer) -> dict:
    names = layer.names
    out = {}
    if layer.config.pre_norms:
        out.update(attn_norm=layer.norm(names.attn_norm), mlp_norm=layer.norm(names.mlp_norm))
    if layer.config.sandwich_norms:
        out.update(post_attn_norm=layer.norm(names.post_attn_norm), post_mlp_norm=layer.norm(names.post_mlp_norm))
    return out


def _ffn(layer: _Layer) -> dict:
    names = layer.names
    if layer.config.n_experts:
        out = {"router": layer.linear(names.router), "expert_down": layer.experts(names.expert_down)}
        if names.expert_gate_up:  # columns: gate, up, gate, up, ... (gpt-oss)
            gate_up = layer.experts(names.expert_gate_up)  # [E, D, 2F]
            out.update(expert_gate=gate_up[..., ::2], expert_up=gate_up[..., 1::2])
        else:
            out.update(expert_gate=layer.experts(names.expert_gate), expert_up=layer.experts(names.expert_up))
        if layer.config.moe_biases:
            gate_up_bias = layer.raw(names.expert_gate_up_bias)  # [E, 2F], interleaved as the weight
            out.update(router_bias=layer.raw(names.router_bias), expert_down_bias=layer.raw(names.expert_down_bias))
            out.update(expert_gate_bias=gate_up_bias[:, ::2], expert_up_bias=gate_up_bias[:, 1::2])
        if layer.config.shared_expert_dim:
            shared = ("shared_gate_proj", "shared_up_proj", "shared_down_proj", "shared_expert_gate")
            out.update({key: layer.linear(getattr(names, key)) for key in shared})
        return out
    if names.gate_up_proj:  # rows: [gate | up]
        gate, up = (w.T for w in np.split(layer.raw(names.gate_up_proj), 2))
    else:
        gate, up = layer.linear(names.gate_proj), layer.linear(names.up_proj)
    return {"gate_proj": gate, "up_proj": up, "down_proj": layer.linear(names.down_proj)}


def layer_tensors(source: TensorSource, names: TensorNames, config: ModelConfig, i: int) -> dict:
    """Layer `i`'s tensors, {neutral key: array}."""
    layer = _Layer(source, names, config, i)
    return {**_norms(layer), **_attention(layer), **_ffn(layer)}


def neutral_tensors(source: TensorSource, names: TensorNames, config: ModelConfig, layers: Iterable[int]) -> Neutral:
    """The whole checkpoint in the neutral layout, read one layer at a time (`layers`: range(n_layers),
    perhaps wrapped in a progress bar)."""
    yield "embed", None, source.get(names.embed)
    for i in layers:
        for key, value in layer_tensors(source, names, config, i).items():
            yield key, i, value
    yield "final_norm", None, _norm(source.get(names.final_norm), names, config)
    if not config.tie_embeddings:
        lm_head = source.get(names.lm_head)
        yield "lm_head", None, lm_head.T if names.out_in else lm_head
