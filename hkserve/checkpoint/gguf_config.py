"""GGUF metadata → ModelConfig for the families whose record names a llama.cpp architecture (Mistral
and Mixtral come as llama, which llama.cpp writes them as).

What llama.cpp fixes per architecture rather than storing (Gemma's sliding-layer pattern, embedding
scale and attention scale, SmolLM3's layers without RoPE) is filled in from the family's record, as
llama.cpp does; metadata asking for what the decoder does not implement (RoPE scaling types but linear, yarn
and longrope, partial rotary dims, Granite's multipliers in another family) is refused.
"""

from __future__ import annotations

import gguf
import numpy as np

from hkserve.checkpoint.families import gguf_family
from hkserve.checkpoint.family import Family
from hkserve.checkpoint.gguf_reader import dequantize, field
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.rope_scaling import RopeScaling, longrope, rope_scaling
from hkserve.checkpoint.rope_windows import sliding_by_pattern
from hkserve.model.config import ModelConfig


def _sliding(reader: gguf.GGUFReader, family: Family, arch: str, n_layers: int) -> dict:
    window = int(field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if not window:
        return {}
    if not family.gguf_sliding:
        raise ImportFormatError(f"{arch}: a sliding window in GGUF metadata is not supported")
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer
        sliding = tuple(bool(x) for x in pattern)
    elif family.sliding_pattern:
        sliding = sliding_by_pattern(n_layers, int(pattern or family.sliding_pattern))
    else:  # every layer (phi3)
        sliding = (True,) * n_layers
    return {"sliding_window": window, "sliding_layers": sliding}


def _soft_caps(reader: gguf.GGUFReader, family: Family, arch: str, dims: tuple[int, int, int, int]) -> dict:
    """Gemma's attention scale (llama.cpp: dim/heads for the 27B layer count), embedding scale and caps."""
    dim, heads, head_dim, n_layers = dims
    scale_dim = dim // heads if n_layers == family.gguf_dim_scale_layers else head_dim
    return {
        "attn_multiplier": scale_dim**-0.5,
        "embedding_multiplier": dim**0.5,
        "attn_logit_cap": float(field(reader, f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        "final_logit_cap": float(field(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0),
    }


# Granite's multipliers as llama.cpp names them (after "{arch}."): embeddings, attention scores (in place
# of 1/sqrt(head_dim)), each sub-block's output before the residual add, logits (divided by it).
_MULTIPLIER_KEYS = ("embedding_scale", "attention.scale", "residual_scale", "logit_scale")
NO_ROPE_STEP = 4  # llama.cpp's smollm3: every 4th layer without RoPE (fixed there, not in the file)


def _multipliers(reader: gguf.GGUFReader, family: Family, arch: str) -> dict:
    """Granite's four scalars; 0 or absent = none, as llama.cpp reads them. Another family's file
    carrying one is refused (its decoder would ignore it)."""
    values = {key: field(reader, f"{arch}.{key}") for key in _MULTIPLIER_KEYS}
    if not family.multipliers:
        present = [key for key, value in values.items() if value is not None]
        if present:
            raise ImportFormatError(f"{arch}: {', '.join(present)} in GGUF metadata is not supported for this family")
        return {}
    embedding, attention, residual, logit = (float(values[key] or 0.0) for key in _MULTIPLIER_KEYS)
    return {
        "embedding_multiplier": embedding or 1.0,
        "attn_multiplier": attention,  # 0 = 1/sqrt(head_dim)
        "residual_multiplier": residual or 1.0,
        "output_multiplier": 1.0 / logit if logit else 1.0,
    }


def _no_rope_layers(family: Family, n_layers: int) -> dict:
    if not family.nope_layers:
        return {}
    flags = tuple((i + 1) % NO_ROPE_STEP != 0 for i in range(n_layers))
    return {"rope_layers": () if all(flags) else flags}


# llama.cpp's YaRN keys (after "{arch}.rope.scaling.") whose meaning differs from transformers' or is not
# checked against llama.cpp (its attn_factor multiplies the mscale it computes; ext_factor scales the ramp):
# refused unless they say what transformers' defaults do.
_YARN_NEUTRAL = {"yarn_ext_factor": 1.0, "yarn_attn_factor": 1.0, "yarn_log_multiplier": 0.0}


def _yarn(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float) -> RopeScaling:
    """YaRN as transformers computes it from the same numbers (llama.cpp's ramp, corrections from
    beta_fast/beta_slow over the original context, and mscale on cos/sin are the same formulas)."""
    key = f"{arch}.rope.scaling."
    for name, neutral in _YARN_NEUTRAL.items():
        value = field(reader, key + name)
        if value is not None and float(value) != neutral:
            raise ImportFormatError(f"{arch}: RoPE scaling yarn with {name} {value} is not supported")
    rope = {
        "factor": float(field(reader, key + "factor", 1.0)),
        "original_max_position_embeddings": int(field(reader, key + "original_context_length", 0) or 0),
        "beta_fast": field(reader, key + "yarn_beta_fast"),
        "beta_slow": field(reader, key + "yarn_beta_slow"),
    }
    if not rope["original_max_position_embeddings"]:
        raise ImportFormatError(f"GGUF metadata lacks {key}original_context_length (yarn)")
    return rope_scaling("yarn", rope, head_dim, theta, 0)


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # [Dh/2] each, read into the config


def _factor_tensor(reader: gguf.GGUFReader, name: str) -> tuple[float, ...]:
    tensor = next((t for t in reader.tensors if t.name == name), None)
    return () if tensor is None else tuple(float(x) for x in np.ravel(dequantize(tensor)))


def _longrope(reader: gguf.GGUFReader, arch: str, head_dim: int, context: int) -> RopeScaling:
    """LongRoPE as llama.cpp's converter writes it (Phi-3.5, Phi-4-mini): both factor sets as tensors, the
    original context and the cos/sin factor as keys; which set applies follows from the context served."""
    long, short = (_factor_tensor(reader, name) for name in LONGROPE_TENSORS)
    if not long or not short:
        raise ImportFormatError(f"{arch}: RoPE scaling longrope needs both tensors {' and '.join(LONGROPE_TENSORS)}")
    if len(long) != head_dim // 2 or len(short) != head_dim // 2:
        raise ImportFormatError(f"{arch}: longrope factor tensors of {len(long)}/{len(short)}, not head_dim/2 entries")
    key = f"{arch}.rope.scaling."
    original, attn = field(reader, key + "original_context_length"), field(reader, key + "attn_factor")
    for name, value in (("original_context_length", original), ("attn_factor", attn)):
        if value is None:
            raise ImportFormatError(f"GGUF metadata lacks {key}{name} (longrope)")
    return longrope(short, long, float(attn), int(original), context)


def _rope(reader: gguf.GGUFReader, arch: str, head_dim: int, theta: float, context: int) -> dict:
    """Llama 3's frequency factors, which llama.cpp stores as the tensor rope_freqs.weight, linear
    scaling's one factor (llama.cpp divides every frequency by it), YaRN's, or LongRoPE's (its two
    factor tensors; rope.scaling.type is not written for phi3)."""
    factors = _factor_tensor(reader, "rope_freqs.weight")
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    has_longrope = any(t.name in LONGROPE_TENSORS for t in reader.tensors)
    attn = field(reader, f"{arch}.rope.scaling.attn_factor")
    if (has_longrope or scaling == "longrope") and not factors:
        chosen = _longrope(reader, arch, head_dim, context)
        capped = min(context, chosen.max_positions or context)
        return {
            "rope_freq_factors": chosen.freq_factors,
            "rope_attn_factor": chosen.attn_factor,
            "context_length": capped,
        }
    if attn is not None and float(attn) != 1.0:  # llama.cpp multiplies cos/sin by it whatever the type
        raise ImportFormatError(f"{arch}: rope.scaling.attn_factor {attn} outside longrope is not supported")
    if scaling == "linear" and not factors:
        factors = (float(field(reader, f"{arch}.rope.scaling.factor", 1.0)),) * (head_dim // 2)
    elif scaling == "yarn" and not factors:
        yarn = _yarn(reader, arch, head_dim, theta)
        return {"rope_freq_factors": yarn.freq_factors, "rope_attn_factor": yarn.attn_factor, "context_length": context}
    elif scaling not in ("none", None):
        supported = "linear, yarn, longrope"
        raise ImportFormatError(f"{arch}: RoPE scaling {scaling!r} is not supported (supported in GGUF: {supported})")
    return {"rope_freq_factors": factors, "context_length": context}


def config_from_gguf(reader: gguf.GGUFReader, dtype: str = "float32", context_length: int = 0) -> ModelConfig:
    """`context_length`: the context to serve (0 = the file's; never more): LongRoPE's factors depend on it."""
    arch = field(reader, "general.architecture", "unknown")
    family = gguf_family(arch)

    def need(key: str):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ImportFormatError(f"GGUF metadata lacks {arch}.{key}")
        return value

    dim, heads, n_layers = int(need("embedding_length")), int(need("attention.head_count")), int(need("block_count"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", dim // heads))
    if int(field(reader, f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ImportFormatError(f"{arch}: value heads of another size than key heads are not supported")
    if int(field(reader, f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ImportFormatError(f"{arch}: RoPE on part of the head (rope.dimension_count) is not supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    options = {**family.options, **_sliding(reader, family, arch, n_layers), **_multipliers(reader, family, arch)}
    trained = int(field(reader, f"{arch}.context_length", 2048))
    options.update(_rope(reader, arch, head_dim, theta, min(context_length or trained, trained)))
    options.update(_no_rope_layers(family, n_layers))
    if family.soft_caps:
        options.update(_soft_caps(reader, family, arch, (dim, heads, head_dim, n_layers)))
    if family.gguf_moe_routing:
        options["moe_routing"] = family.gguf_moe_routing
    shared = int(field(reader, f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    if shared and not family.gguf.shared_expert_gate:
        raise ImportFormatError(f"{arch}: a shared expert (expert_shared_feed_forward_length) is not supported")
    if family.gguf_local_theta_key:
        options["rope_local_theta"] = float(field(reader, f"{arch}.{family.gguf_local_theta_key}", 10000.0))
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_dim=int(field(reader, f"{arch}.expert_feed_forward_length", None) or need("feed_forward_length")),
        rope_theta=theta,
        norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=family.gguf.lm_head not in names,
        n_experts=int(field(reader, f"{arch}.expert_count", 0) or 0),
        n_experts_per_token=int(field(reader, f"{arch}.expert_used_count", 2) or 2),
        shared_expert_dim=shared,
        dtype=dtype,
        **options,
    )
