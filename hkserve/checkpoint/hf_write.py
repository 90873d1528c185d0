"""Our params as an HF checkpoint's config and tensors (families.HF_NAMES): the inverse of hf.py.

Used to load our weights into a peer implementation (transformers) for benchmarks and comparisons.
"""

from __future__ import annotations

import numpy as np

from hkserve.checkpoint.families import HF_NAMES, LLAMA, MIXTRAL
from hkserve.model.config import ModelConfig

# The family options hf_checkpoint_tensors cannot express, at their plain-Llama values.
_LLAMA_DEFAULTS = {
    "mlp_activation": "silu",
    "qkv_bias": False,
    "qk_norm": False,
    "norm_offset": 0.0,
    "final_logit_cap": 0.0,
    "rope_freq_factors": (),
    "rope_attn_factor": 1.0,
    "residual_multiplier": 1.0,
    "qk_norm_full": False,
    "pre_norms": True,
    "rope_layers": (),
    "sliding_window": 0,
    "sliding_layers": (),
    "rope_local_theta": 0.0,
    "shared_expert_dim": 0,
    "o_bias": False,
    "attn_sinks": False,
    "moe_biases": False,
}


def hf_writable(config: ModelConfig) -> bool:
    """Whether the config is Llama/Mixtral-style, the layouts hf_checkpoint_tensors can write."""
    if config.moe_activation == "clamped_swiglu":  # gpt-oss's experts, which Mixtral's tensors do not express
        return False
    return config == config.replace(**_LLAMA_DEFAULTS)


def hf_checkpoint_tensors(config, params) -> dict[str, np.ndarray]:
    """Our float param tree → an HF checkpoint's tensors (the inverse of checkpoint/hf.py): linear weights
    [in, out] → [out, in], stacked layers → one name per layer, MoE experts → w1/w3/w2. In the stored
    dtype (float32 | bfloat16), on the host. Llama and Mixtral layouts only: a config with another
    family's options is refused."""
    if not hf_writable(config):
        raise ValueError("only Llama/Mixtral-style configs can be written as an HF checkpoint")
    if config.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"HF tensors are made from float weights, not {config.dtype}")

    def get(module: str, name: str) -> np.ndarray:
        return np.asarray(params[module][name])

    names = HF_NAMES
    out = {names.embed: get("decoder/embed", "embeddings"), names.final_norm: get("decoder/final_norm", "scale")}
    if not config.tie_embeddings:
        out[names.lm_head] = get("decoder/lm_head", "w").T
    stacked = {
        names.attn_norm: get("decoder/layers/attn_norm", "scale"),
        names.mlp_norm: get("decoder/layers/mlp_norm", "scale"),
    }
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        stacked[getattr(names, proj)] = get(f"decoder/layers/attention/{proj}", "w").swapaxes(1, 2)
    if config.n_experts:
        stacked[names.router] = get("decoder/layers/moe/router", "w").swapaxes(1, 2)
        for ours in ("gate_proj", "up_proj", "down_proj"):
            experts = get("decoder/layers/moe", ours).swapaxes(2, 3)  # [L, E, out, in]
            theirs = getattr(names, "expert_" + ours.removesuffix("_proj"))
            stacked |= {theirs.format(e=e): experts[:, e] for e in range(config.n_experts)}
    else:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            stacked[getattr(names, proj)] = get(f"decoder/layers/mlp/{proj}", "w").swapaxes(1, 2)
    for name, value in stacked.items():
        for i in range(config.n_layers):
            out[names.layer_prefix.format(i=i) + name] = value[i]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def hf_config_dict(config: ModelConfig) -> dict:
    """Our ModelConfig → an HF config.json (LlamaForCausalLM, or MixtralForCausalLM for MoE)."""
    out = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.context_length,
        tie_word_embeddings=config.tie_embeddings,
        hidden_act="silu",
        torch_dtype="bfloat16" if config.dtype == "bfloat16" else "float32",
    )
    family = MIXTRAL if config.n_experts else LLAMA
    out |= {"architectures": list(family.hf_architectures), "model_type": family.name}
    if config.n_experts:
        out |= {"num_local_experts": config.n_experts, "num_experts_per_tok": config.n_experts_per_token}
    return out
