"""Import a Hugging Face checkpoint directory (config.json + safetensors, one file or sharded):
Llama, Mistral, Mixtral, Qwen2, Qwen3, Gemma 2, Gemma 3 and Phi-3 (hf_config.py reads the config).

Tensors are read layer by layer from their byte ranges (safetensors_dir.py); a tensor the checkpoint
holds but no mapping below uses is an error, so an unsupported weight (an o_proj bias, say) is never
silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from hkserve.checkpoint.hf_config import config_from_hf, family_of
from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.checkpoint.safetensors_dir import SafetensorsDir
from hkserve.model.config import ModelConfig

# Buffers some checkpoints carry that are recomputed, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _attention(t: SafetensorsDir, p: str, family: str, config: ModelConfig) -> dict:
    """q/k/v/o [in, out] (Phi-3's fused qkv_proj split by rows), biases and q/k norms."""
    if family == "phi3":
        q_rows, kv_rows = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
        q, k, v = np.split(t.get(p + "self_attn.qkv_proj.weight"), [q_rows, q_rows + kv_rows])
    else:
        q, k, v = (t.get(p + f"self_attn.{x}_proj.weight") for x in "qkv")
    layer = {"q_proj": q.T, "k_proj": k.T, "v_proj": v.T, "o_proj": t.get(p + "self_attn.o_proj.weight").T}
    if config.qkv_bias:
        layer.update({f"{x}_bias": t.get(p + f"self_attn.{x}_proj.bias") for x in "qkv"})
    if config.qk_norm:
        layer.update({f"{x}_norm": t.get(p + f"self_attn.{x}_norm.weight") for x in "qk"})
    return layer


def _norms(t: SafetensorsDir, p: str, family: str) -> dict:
    """Llama's post_attention_layernorm is the MLP's input norm; Gemma's is the attention output's."""
    if family in ("gemma2", "gemma3"):
        return {
            "attn_norm": t.get(p + "input_layernorm.weight"),
            "post_attn_norm": t.get(p + "post_attention_layernorm.weight"),
            "mlp_norm": t.get(p + "pre_feedforward_layernorm.weight"),
            "post_mlp_norm": t.get(p + "post_feedforward_layernorm.weight"),
        }
    return {"attn_norm": t.get(p + "input_layernorm.weight"), "mlp_norm": t.get(p + "post_attention_layernorm.weight")}


def _ffn(t: SafetensorsDir, p: str, family: str, config: ModelConfig) -> dict:
    if config.n_experts:
        experts = range(config.n_experts)
        moe = p + "block_sparse_moe."
        return {
            "router": t.get(moe + "gate.weight").T,
            "expert_gate": np.stack([t.get(moe + f"experts.{e}.w1.weight").T for e in experts]),
            "expert_up": np.stack([t.get(moe + f"experts.{e}.w3.weight").T for e in experts]),
            "expert_down": np.stack([t.get(moe + f"experts.{e}.w2.weight").T for e in experts]),
        }
    if family == "phi3":  # gate_up_proj rows: [gate | up]
        gate, up = np.split(t.get(p + "mlp.gate_up_proj.weight"), 2)
    else:
        gate, up = t.get(p + "mlp.gate_proj.weight"), t.get(p + "mlp.up_proj.weight")
    return {"gate_proj": gate.T, "up_proj": up.T, "down_proj": t.get(p + "mlp.down_proj.weight").T}


def _layer(t: SafetensorsDir, i: int, family: str, config: ModelConfig) -> dict:
    p = f"model.layers.{i}."
    return {**_norms(t, p, family), **_attention(t, p, family, config), **_ffn(t, p, family, config)}


def _tensors(t: SafetensorsDir, family: str, config: ModelConfig) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """The checkpoint in the neutral layout of params.py, read one layer at a time."""
    yield "embed", None, t.get("model.embed_tokens.weight")
    for i in range(config.n_layers):
        for key, value in _layer(t, i, family, config).items():
            yield key, i, value
    yield "final_norm", None, t.get("model.norm.weight")
    if not config.tie_embeddings:
        yield "lm_head", None, t.get("lm_head.weight").T


def load_hf(directory: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Read config and weights of an HF directory → (ModelConfig, Haiku params as numpy)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ImportFormatError(f"{directory} has no config.json")
    raw = json.loads(cfg_path.read_text())
    config = config_from_hf(raw, dtype)
    family = family_of(raw)
    t = SafetensorsDir(directory)
    params = assemble_params(config, _tensors(t, family, config))
    if config.tie_embeddings:
        t.unread.discard("lm_head.weight")  # a tied model's saved copy of the embeddings: transformers ties it too
    left = sorted(n for n in t.unread if not n.endswith(_IGNORED_SUFFIXES))
    if left:
        raise ImportFormatError(f"{family}: tensors this importer does not use: {', '.join(left[:5])}")
    return config, params
