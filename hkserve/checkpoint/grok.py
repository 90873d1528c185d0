"""Import grok-1-style Haiku parameters (xai-org/grok-1's module names, families.GROK_NAMES) onto our
decoder: rms_norm / rms_norm_1 / rms_norm_2 / rms_norm_3 are the pre-attention, post-attention,
pre-MoE and post-MoE norms; query/key/value/linear the attention projections; moe/linear (gelu
branch), moe/linear_v (linear branch), moe/linear_1 (down) the experts. Weights are already [in, out]
with head-major columns, as ours are.
"""

from __future__ import annotations

import numpy as np

from hkserve.checkpoint.families import GROK
from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.checkpoint.tensor_map import neutral_tensors
from hkserve.model.config import ModelConfig


def config_from_grok(cfg: dict, **changes) -> ModelConfig:
    """grok-1's LanguageModelConfig / TransformerConfig fields → ModelConfig (float32)."""
    ffn = int(cfg["emb_size"] * cfg.get("widening_factor", 1.0)) * 2 // 3
    ffn += (8 - ffn % 8) % 8
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["emb_size"],
        n_layers=cfg["num_layers"],
        n_heads=cfg["num_q_heads"],
        n_kv_heads=cfg["num_kv_heads"],
        head_dim=cfg["key_size"],
        ffn_dim=cfg.get("ffn_size", ffn),
        n_experts=cfg["num_experts"],
        n_experts_per_token=cfg["num_selected_experts"],
        attn_multiplier=cfg.get("attn_output_multiplier", cfg["key_size"] ** -0.5),
        embedding_multiplier=cfg.get("embedding_multiplier_scale", 1.0),
        output_multiplier=cfg.get("output_multiplier_scale", 1.0),
        attn_logit_cap=cfg.get("attn_logit_cap", 30.0),
        rope_theta=cfg.get("rope_base", 10000.0),
        norm_eps=cfg.get("rms_norm_eps", cfg.get("norm_eps", 1e-5)),
        context_length=cfg.get("sequence_len", 8192),
        **{**GROK.options, **changes},
    )


class _Arrays:
    def __init__(self, tensors: dict):
        self.tensors = tensors

    def get(self, name: str) -> np.ndarray:
        try:
            return np.asarray(self.tensors[name])
        except KeyError:
            raise ImportFormatError(f"grok checkpoint lacks {name}") from None


def load_grok(tensors: dict, config: ModelConfig) -> dict:
    """{grok haiku name: array} (e.g. an .npz) → our Haiku params for `config`."""
    return assemble_params(config, neutral_tensors(_Arrays(tensors), GROK.release, config, range(config.n_layers)))
