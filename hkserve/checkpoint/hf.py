"""Import a Hugging Face checkpoint directory (config.json + *.safetensors): Llama and Mixtral."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.model.config import ModelConfig

SUPPORTED = {"LlamaForCausalLM", "MixtralForCausalLM", "MistralForCausalLM"}


def config_from_hf(cfg: dict, dtype: str = "float32") -> ModelConfig:
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
    if arch not in SUPPORTED:
        raise ImportFormatError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(SUPPORTED))})")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ImportFormatError(f"unsupported rope_type {rope_type!r} (only default RoPE)")
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ImportFormatError("attention/mlp biases are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ImportFormatError(f"unsupported hidden_act {cfg['hidden_act']!r} (SwiGLU needs silu)")
    heads = cfg["num_attention_heads"]
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_dim=cfg["intermediate_size"],
        rope_theta=float(theta),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        context_length=int(cfg.get("max_position_embeddings", 2048)),
        n_experts=int(cfg.get("num_local_experts", 0) or 0),
        n_experts_per_token=int(cfg.get("num_experts_per_tok", 2) or 2),
        dtype=dtype,
    )


def _read_safetensors(directory: Path) -> dict[str, np.ndarray]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ImportFormatError(f"no *.safetensors in {directory}")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="numpy") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is no dict)
                tensors[key] = sf.get_tensor(key)
    return tensors


def _layer(t: dict, i: int, config: ModelConfig) -> dict:
    p = f"model.layers.{i}."

    def take(name: str) -> np.ndarray:
        try:
            return t[p + name]
        except KeyError:
            raise ImportFormatError(f"missing tensor {p + name}") from None

    layer = {
        "attn_norm": take("input_layernorm.weight"),
        "q_proj": take("self_attn.q_proj.weight").T,
        "k_proj": take("self_attn.k_proj.weight").T,
        "v_proj": take("self_attn.v_proj.weight").T,
        "o_proj": take("self_attn.o_proj.weight").T,
        "mlp_norm": take("post_attention_layernorm.weight"),
    }
    if config.n_experts:
        experts = range(config.n_experts)
        layer["router"] = take("block_sparse_moe.gate.weight").T
        layer["expert_gate"] = np.stack([take(f"block_sparse_moe.experts.{e}.w1.weight").T for e in experts])
        layer["expert_up"] = np.stack([take(f"block_sparse_moe.experts.{e}.w3.weight").T for e in experts])
        layer["expert_down"] = np.stack([take(f"block_sparse_moe.experts.{e}.w2.weight").T for e in experts])
    else:
        layer["gate_proj"] = take("mlp.gate_proj.weight").T
        layer["up_proj"] = take("mlp.up_proj.weight").T
        layer["down_proj"] = take("mlp.down_proj.weight").T
    return layer


def load_hf(directory: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Read config and weights of an HF directory → (ModelConfig, Haiku params as numpy)."""
    directory = Path(directory)
    cfg_path = directory / "config.json"
    if not cfg_path.is_file():
        raise ImportFormatError(f"{directory} has no config.json")
    config = config_from_hf(json.loads(cfg_path.read_text()), dtype)
    t = _read_safetensors(directory)
    tensors = {
        "embed": t["model.embed_tokens.weight"],
        "final_norm": t["model.norm.weight"],
        "layers": [_layer(t, i, config) for i in range(config.n_layers)],
    }
    if not config.tie_embeddings:
        if "lm_head.weight" not in t:
            raise ImportFormatError("config has untied embeddings but no lm_head.weight")
        tensors["lm_head"] = t["lm_head.weight"].T
    return config, assemble_params(config, tensors)
