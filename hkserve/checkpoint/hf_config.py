"""A Hugging Face config.json → ModelConfig, for the families of families.py.

Every key is either read, known not to change the forward pass (NEUTRAL), or refused: a checkpoint
whose config asks for something the decoder does not implement is an error, never served as if the
key were absent.
"""

from __future__ import annotations

from hkserve.checkpoint.families import hf_family
from hkserve.checkpoint.family import HF_ACTIVATIONS, Family
from hkserve.checkpoint.mxfp4 import check_quantization_config
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.rope_scaling import RopeScaling, rope_scaling
from hkserve.checkpoint.rope_windows import sliding_by_pattern
from hkserve.model.config import ModelConfig

# Keys with no effect on the logits of a forward pass (training, generation defaults, bookkeeping).
NEUTRAL = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "auto_map",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "cache_implementation", "initializer_range",
    "attention_dropout", "embd_pdrop", "resid_pdrop", "pretraining_tp", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "max_window_layers", "original_max_position_embeddings",
}  # fmt: skip
# Keys every family reads.
COMMON = {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "hidden_act",
    "rope_theta", "rope_parameters", "rope_scaling", "attention_bias", "mlp_bias", "sliding_window", "layer_types",
}  # fmt: skip
# The keys beyond COMMON this module reads when a family's record lists them (Family.hf_keys).
FAMILY_KEYS = {
    "num_local_experts", "num_experts_per_tok", "use_sliding_window", "partial_rotary_factor",
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "sliding_window_size", "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern",
    "use_bidirectional_attention", "embedding_multiplier", "attention_multiplier", "residual_multiplier",
    "logits_scaling", "no_rope_layers", "no_rope_layer_interval", "num_experts", "moe_intermediate_size",
    "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "qkv_bias",
    "swiglu_alpha", "swiglu_limit",
}  # fmt: skip
ROPE_KEYS = {
    "rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings", "partial_rotary_factor", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "attention_factor", "truncate", "short_factor", "long_factor",
}  # fmt: skip


def _refuse(family: str, what: str) -> ImportFormatError:
    return ImportFormatError(f"{family}: {what} is not supported (refusing to import rather than ignore it)")


def _rope(family: str, rope: dict, theta: float, cfg: dict, head_dim: int) -> tuple[float, RopeScaling]:
    """One RoPE parameter dict → (theta, its scaling)."""
    unknown = set(rope) - ROPE_KEYS
    if unknown:
        raise _refuse(family, f"RoPE parameter(s) {sorted(unknown)}")
    theta = float(rope.get("rope_theta", theta))
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(family, f"partial_rotary_factor {rope['partial_rotary_factor']}")
    if "original_max_position_embeddings" in cfg:  # Phi-3 keeps it beside rope_scaling
        rope = {"original_max_position_embeddings": cfg["original_max_position_embeddings"], **rope}
    kind = rope.get("rope_type", rope.get("type", "default"))
    max_positions = int(cfg.get("max_position_embeddings", 2048))
    try:
        return theta, rope_scaling(kind, rope, head_dim, theta, max_positions)
    except KeyError as exc:
        raise ImportFormatError(f"{family}: rope_type {kind!r} lacks its parameter {exc}") from None


def _rope_options(family: Family, cfg: dict, head_dim: int) -> dict:
    """rope_theta, rope_freq_factors, rope_attn_factor, rope_local_theta (and a context cap where the
    frequencies would change past it) from either config form: transformers 5's `rope_parameters`
    (per layer type for Gemma 3) or the older top-level rope_theta / rope_scaling / rope_local_base_freq."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(cfg.get("rope_theta", family.default_rope_theta))
    local = float(cfg.get(family.hf_local_theta_key, 10000.0)) if family.hf_local_theta_key else 0.0
    if "full_attention" in params or "sliding_attention" in params:
        theta, scaling = _rope(family.name, params.get("full_attention", {}), theta, cfg, head_dim)
        local, local_scaling = _rope(family.name, params.get("sliding_attention", {}), local or theta, cfg, head_dim)
        if scaling != local_scaling:  # the decoder applies one scaling to every layer
            raise _refuse(family.name, "RoPE scaling that differs between full and sliding layers")
    else:
        theta, scaling = _rope(family.name, params, theta, cfg, head_dim)
    options = {"rope_theta": theta, "rope_local_theta": local}
    options.update(rope_freq_factors=scaling.freq_factors, rope_attn_factor=scaling.attn_factor)
    context = int(cfg.get("max_position_embeddings", 2048))
    options["context_length"] = min(context, scaling.max_positions) if scaling.max_positions else context
    return options


def _sliding_options(family: Family, cfg: dict, n_layers: int) -> dict:
    """sliding_window and sliding_layers: from `layer_types` when given, else the family's pattern
    (Gemma), or every layer (Mistral, Phi-3; Qwen only with use_sliding_window, from max_window_layers)."""
    window = int(cfg.get("sliding_window") or cfg.get("sliding_window_size") or 0)
    if family.sliding_opt_in and not cfg.get("use_sliding_window", False):
        window = 0  # transformers ignores the window then
    types = cfg.get("layer_types")
    if types is not None:
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown or len(types) != n_layers:
            raise _refuse(family.name, f"layer_types {types}")
        sliding = tuple(t == "sliding_attention" for t in types)
    elif family.sliding_pattern:
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        sliding = sliding_by_pattern(n_layers, int(pattern or family.sliding_pattern))
    elif family.sliding_opt_in:
        sliding = tuple(i >= int(cfg.get("max_window_layers", 0)) for i in range(n_layers))
    else:
        sliding = (True,) * n_layers
    if not window or not any(sliding):
        return {"sliding_window": 0, "sliding_layers": ()}
    return {"sliding_window": window, "sliding_layers": sliding}


def _soft_cap_options(family: Family, cfg: dict) -> dict:
    """Gemma's attention scale, embedding scale and logit soft caps."""
    if cfg.get("use_bidirectional_attention"):
        raise _refuse(family.name, "use_bidirectional_attention")
    return {
        "attn_multiplier": float(cfg["query_pre_attn_scalar"]) ** -0.5,
        "embedding_multiplier": float(cfg["hidden_size"]) ** 0.5,
        "attn_logit_cap": float(cfg.get("attn_logit_softcapping") or 0.0),
        "final_logit_cap": float(cfg.get("final_logit_softcapping") or 0.0),
    }


def _multiplier_options(cfg: dict) -> dict:
    """Granite's scalars: on the embeddings, the attention scores (in place of 1/sqrt(head_dim)), each
    sub-block's output before the residual add, and the logits (divided by logits_scaling)."""
    return {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "attn_multiplier": float(cfg.get("attention_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "output_multiplier": 1.0 / float(cfg.get("logits_scaling", 1.0)),
    }


def _nope_options(family: Family, cfg: dict, n_layers: int) -> dict:
    """SmolLM3's layers without RoPE: no_rope_layers (1 = RoPE), else every no_rope_layer_interval-th."""
    interval = int(cfg.get("no_rope_layer_interval", 4))
    flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
    if len(flags) != n_layers or set(flags) - {0, 1}:
        raise _refuse(family.name, f"no_rope_layers {flags}")
    return {"rope_layers": () if all(flags) else tuple(bool(f) for f in flags)}


def _qwen_moe_options(family: Family, cfg: dict, n_layers: int) -> dict:
    """Qwen-MoE's experts (moe_intermediate_size wide), its shared expert (Qwen2-MoE) and its routing:
    norm_topk_prob renormalises the top-k of the softmax over all experts ("mixtral": a softmax over the
    top-k logits is the same), else they stay as they are ("grok"). A layer decoder_sparse_step or
    mlp_only_layers make dense is refused: the decoder's layers are all MoE or all dense."""
    n_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    step, dense_only = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in dense_only or not n_experts or (i + 1) % step]
    if dense:
        raise _refuse(family.name, f"dense MLP layers {dense} between MoE ones (decoder_sparse_step / mlp_only_layers)")
    if bool(cfg.get("qkv_bias", family.options.get("qkv_bias", False))) != family.options.get("qkv_bias", False):
        raise _refuse(family.name, f"qkv_bias {cfg['qkv_bias']}")
    return {
        "n_experts": n_experts,
        "n_experts_per_token": int(cfg["num_experts_per_tok"]),
        "ffn_dim": int(cfg["moe_intermediate_size"]),
        "shared_expert_dim": int(cfg.get("shared_expert_intermediate_size") or 0),
        "moe_routing": "mixtral" if cfg.get("norm_topk_prob", False) else "grok",
    }


def _gpt_oss_options(cfg: dict) -> dict:
    """gpt-oss: attention_bias puts biases on q, k, v and o; its experts' clamped SwiGLU constants."""
    bias = bool(cfg.get("attention_bias", False))
    return {
        "qkv_bias": bias,
        "o_bias": bias,
        "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
    }


def family_of(cfg: dict) -> Family:
    """The family record of an HF config, by its architecture name."""
    family = hf_family((cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0])
    if family.hf_keys - FAMILY_KEYS:
        raise _refuse(family.name, f"config key(s) {sorted(family.hf_keys - FAMILY_KEYS)} of its record")
    return family


def _checked_activation(family: Family, cfg: dict) -> str:
    """The config's activation, which the family must list (Gemma's MLP is gelu_pytorch_tanh only)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if act not in family.hf_activations:
        raise _refuse(family.name, f"activation {act!r} (supported: {', '.join(family.hf_activations)})")
    return act


def config_from_hf(cfg: dict, dtype: str = "float32") -> ModelConfig:
    family = family_of(cfg)
    check_quantization_config(family.name, cfg.get("quantization_config"), family.gpt_oss)
    unknown = set(cfg) - NEUTRAL - COMMON - family.hf_keys - {"quantization_config"}
    if unknown:
        raise _refuse(family.name, f"config field(s) {sorted(unknown)}")
    if (cfg.get("attention_bias") and not family.gpt_oss) or cfg.get("mlp_bias"):
        raise _refuse(family.name, "attention_bias/mlp_bias (biases on the output or MLP projections)")
    act = _checked_activation(family, cfg)
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise _refuse(family.name, f"partial_rotary_factor {cfg['partial_rotary_factor']}")
    heads, n_layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    options = {
        **family.options,
        **_rope_options(family, cfg, head_dim),
        **_sliding_options(family, cfg, n_layers),
        **(_soft_cap_options(family, cfg) if family.soft_caps else {}),
        **(_multiplier_options(cfg) if family.multipliers else {}),
        **(_nope_options(family, cfg, n_layers) if family.nope_layers else {}),
        **(_gpt_oss_options(cfg) if family.gpt_oss else {}),
    }
    if family.activation_option:
        options[family.activation_option] = HF_ACTIVATIONS[act]
    sizes = {
        "ffn_dim": cfg["intermediate_size"],
        "n_experts": int(cfg.get("num_local_experts", 0) or 0),
        "n_experts_per_token": int(cfg.get("num_experts_per_tok", 2) or 2),
        **(_qwen_moe_options(family, cfg, n_layers) if family.qwen_moe else {}),
    }
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        dim=cfg["hidden_size"],
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", family.tied_by_default)),
        dtype=dtype,
        **sizes,
        **options,
    )
