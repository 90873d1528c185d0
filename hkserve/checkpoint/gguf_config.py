"""GGUF metadata → ModelConfig for llama.cpp's architectures llama (also Mistral and Mixtral, which
llama.cpp writes as llama), qwen2, qwen3, gemma2, gemma3 and phi3.

What llama.cpp fixes per architecture rather than storing (Gemma's sliding-layer pattern, embedding
scale and attention scale) is filled in as llama.cpp does; metadata asking for what the decoder does
not implement (RoPE scaling types, partial rotary dims) is refused.
"""

from __future__ import annotations

import gguf
import numpy as np

from hkserve.checkpoint.families import DEFAULT_SLIDING_PATTERN, FAMILY_OPTIONS, sliding_by_pattern
from hkserve.checkpoint.gguf_reader import dequantize, field
from hkserve.checkpoint.params import ImportFormatError
from hkserve.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# llama.cpp takes dim/heads (not head_dim) as the attention scale for these layer counts: the 27B models.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _sliding(reader: gguf.GGUFReader, arch: str, n_layers: int) -> dict:
    window = int(field(reader, f"{arch}.attention.sliding_window", 0) or 0)
    if not window:
        return {}
    if arch in ("llama", "qwen2", "qwen3"):
        raise ImportFormatError(f"{arch}: a sliding window in GGUF metadata is not supported")
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer
        sliding = tuple(bool(x) for x in pattern)
    elif arch in DEFAULT_SLIDING_PATTERN:
        sliding = sliding_by_pattern(n_layers, int(pattern or DEFAULT_SLIDING_PATTERN[arch]))
    else:  # phi3: every layer
        sliding = (True,) * n_layers
    return {"sliding_window": window, "sliding_layers": sliding}


def _gemma(reader: gguf.GGUFReader, arch: str, dim: int, heads: int, head_dim: int, n_layers: int) -> dict:
    scale_dim = dim // heads if n_layers == _GEMMA_27B_LAYERS[arch] else head_dim
    options = {
        "attn_multiplier": scale_dim**-0.5,
        "embedding_multiplier": dim**0.5,
        "attn_logit_cap": float(field(reader, f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        "final_logit_cap": float(field(reader, f"{arch}.final_logit_softcapping", 0.0) or 0.0),
    }
    if arch == "gemma3":
        options["rope_local_theta"] = float(field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
    return options


def _rope_freq_factors(reader: gguf.GGUFReader) -> tuple[float, ...]:
    """Llama 3's frequency factors, which llama.cpp stores as the tensor rope_freqs.weight."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    return () if tensor is None else tuple(float(x) for x in np.ravel(dequantize(tensor)))


def config_from_gguf(reader: gguf.GGUFReader, dtype: str = "float32") -> ModelConfig:
    arch = field(reader, "general.architecture", "unknown")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ImportFormatError(
            f"unsupported GGUF architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

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
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ImportFormatError(f"{arch}: RoPE scaling {scaling!r} is not supported")
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    options = {**FAMILY_OPTIONS[arch], **_sliding(reader, arch, n_layers)}
    if arch in _GEMMA_27B_LAYERS:
        options.update(_gemma(reader, arch, dim, heads, head_dim, n_layers))
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=n_layers,
        n_heads=heads,
        n_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_dim=int(field(reader, f"{arch}.expert_feed_forward_length", None) or need("feed_forward_length")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_freq_factors=_rope_freq_factors(reader),
        norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        context_length=int(field(reader, f"{arch}.context_length", 2048)),
        n_experts=int(field(reader, f"{arch}.expert_count", 0) or 0),
        n_experts_per_token=int(field(reader, f"{arch}.expert_used_count", 2) or 2),
        dtype=dtype,
        **options,
    )
