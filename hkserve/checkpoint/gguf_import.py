"""Import a GGUF file (llama.cpp's tensor names and layouts) onto the decoder.

Per architecture, as llama.cpp's convert_hf_to_gguf.py writes them: llama's attn_q/attn_k rows are
permuted for llama.cpp's interleaved RoPE (undone here; qwen2, qwen3, gemma2, gemma3 and phi3 use the
NeoX rotate-half layout and are stored as in HF); Gemma's norm weights are stored with its +1 added
(taken off here: the decoder adds it, config.norm_offset); phi3 keeps q|k|v fused in attn_qkv and
gate|up in ffn_up. Tensors are dequantized one at a time; one the mapping does not use is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_reader import dequantize, field, open_gguf
from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.model.config import ModelConfig


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of attn_q/attn_k rows ([out, in]).

    llama.cpp interleaves each head's two rotary halves (pairs (0, Dh/2), (1, Dh/2+1), ...) so it can
    rotate adjacent pairs; we rotate halves (Hugging Face layout), so put the rows back.
    """
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


class _Tensors:
    """Reader tensors by name, dequantized on demand; remembers which were never asked for."""

    def __init__(self, reader: gguf.GGUFReader, norm_offset: float, decode=dequantize):
        self._by_name = {t.name: t for t in reader.tensors}
        self.decode = decode  # reader tensor → array (gguf_int4.py: linear weights as int4 groups)
        self.unread = set(self._by_name) - {"rope_freqs.weight"}  # that one is read into the config
        self.norm_offset = norm_offset

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def get(self, name: str) -> np.ndarray:
        if name not in self._by_name:
            raise ImportFormatError(f"GGUF lacks tensor {name}")
        self.unread.discard(name)
        return self.decode(self._by_name[name])

    def norm(self, name: str) -> np.ndarray:
        """A norm weight as the decoder stores it (Gemma: without the +1 llama.cpp added)."""
        return self.get(name) - np.float32(self.norm_offset)


def _attention(t: _Tensors, p: str, arch: str, config: ModelConfig) -> dict:
    if arch == "phi3":
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        q, k, v = np.split(t.get(p + "attn_qkv.weight"), [q_rows, q_rows + kv_rows])
    else:
        q, k, v = (t.get(p + f"attn_{x}.weight") for x in "qkv")
    if arch == "llama":
        q, k = unpermute_rope_rows(q, config.n_heads), unpermute_rope_rows(k, config.n_kv_heads)
    layer = {"q_proj": q.T, "k_proj": k.T, "v_proj": v.T, "o_proj": t.get(p + "attn_output.weight").T}
    if config.qkv_bias:
        layer.update({f"{x}_bias": t.get(p + f"attn_{x}.bias") for x in "qkv"})
    if config.qk_norm:
        layer.update({f"{x}_norm": t.norm(p + f"attn_{x}_norm.weight") for x in "qk"})
    return layer


def _norms(t: _Tensors, p: str, config: ModelConfig) -> dict:
    norms = {"attn_norm": t.norm(p + "attn_norm.weight"), "mlp_norm": t.norm(p + "ffn_norm.weight")}
    if config.sandwich_norms:
        norms["post_attn_norm"] = t.norm(p + "post_attention_norm.weight")
        norms["post_mlp_norm"] = t.norm(p + "post_ffw_norm.weight")
    return norms


def _ffn(t: _Tensors, p: str, arch: str, config: ModelConfig) -> dict:
    if config.n_experts:  # stacked experts: [E, out, in]
        return {
            "router": t.get(p + "ffn_gate_inp.weight").T,
            "expert_gate": t.get(p + "ffn_gate_exps.weight").swapaxes(1, 2),
            "expert_up": t.get(p + "ffn_up_exps.weight").swapaxes(1, 2),
            "expert_down": t.get(p + "ffn_down_exps.weight").swapaxes(1, 2),
        }
    if arch == "phi3":  # ffn_up rows: [gate | up]
        gate, up = np.split(t.get(p + "ffn_up.weight"), 2)
    else:
        gate, up = t.get(p + "ffn_gate.weight"), t.get(p + "ffn_up.weight")
    return {"gate_proj": gate.T, "up_proj": up.T, "down_proj": t.get(p + "ffn_down.weight").T}


def _layer(t: _Tensors, i: int, arch: str, config: ModelConfig) -> dict:
    p = f"blk.{i}."
    return {**_norms(t, p, config), **_attention(t, p, arch, config), **_ffn(t, p, arch, config)}


def _tensors(
    t: _Tensors, arch: str, config: ModelConfig, progress: bool
) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """The file in the neutral layout of params.py, dequantized one layer at a time."""
    yield "embed", None, t.get("token_embd.weight")
    for i in tqdm(range(config.n_layers), desc="dequantize", unit="layer", disable=not progress):
        for key, value in _layer(t, i, arch, config).items():
            yield key, i, value
    yield "final_norm", None, t.norm("output_norm.weight")
    if not config.tie_embeddings:
        yield "lm_head", None, t.get("output.weight").T


def load_gguf(
    path: str | Path, dtype: str = "float32", progress: bool = False
) -> tuple[ModelConfig, dict, gguf.GGUFReader]:
    """→ (ModelConfig, Haiku params as numpy, the open reader for the tokenizer)."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype)
    arch = field(reader, "general.architecture")
    t = _Tensors(reader, config.norm_offset)
    params = assemble_params(config, _tensors(t, arch, config, progress))
    if t.unread:
        raise ImportFormatError(f"{arch}: tensors this importer does not use: {', '.join(sorted(t.unread)[:5])}")
    return config, params, reader
