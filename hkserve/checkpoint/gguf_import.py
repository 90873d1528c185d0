"""Import a llama-architecture GGUF file: dequantize with the `gguf` package, un-permute q/k rows."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tqdm import tqdm

from hkserve.checkpoint.params import ImportFormatError, assemble_params
from hkserve.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    path = Path(path)
    if not path.is_file():
        raise ImportFormatError(f"no such GGUF file: {path}")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct/IndexError, ... on damaged files
        raise ImportFormatError(f"{path.name} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def field(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


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

    dim, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = int(field(reader, f"{arch}.rope.dimension_count", dim // heads))
    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab = int(field(reader, f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    names = {t.name for t in reader.tensors}
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ImportFormatError(f"unsupported RoPE scaling {scaling!r}")
    return ModelConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=int(need("block_count")),
        n_heads=heads,
        n_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn_dim=int(field(reader, f"{arch}.expert_feed_forward_length", None) or need("feed_forward_length")),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
        context_length=int(field(reader, f"{arch}.context_length", 2048)),
        n_experts=int(field(reader, f"{arch}.expert_count", 0) or 0),
        n_experts_per_token=int(field(reader, f"{arch}.expert_used_count", 2) or 2),
        dtype=dtype,
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert permutation of attn_q/attn_k rows ([out, in]).

    llama.cpp interleaves each head's two rotary halves (pairs (0, Dh/2), (1, Dh/2+1), ...) so it can
    rotate adjacent pairs; we rotate halves (Hugging Face layout), so put the rows back.
    """
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor) -> np.ndarray:
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))


def load_gguf(
    path: str | Path, dtype: str = "float32", progress: bool = False
) -> tuple[ModelConfig, dict, gguf.GGUFReader]:
    """→ (ModelConfig, Haiku params as numpy, the open reader for the tokenizer)."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, dtype)
    raw = {}
    for t in tqdm(reader.tensors, desc="dequantize", unit="tensor", disable=not progress):
        try:
            raw[t.name] = _dequantize(t)
        except (NotImplementedError, ValueError) as e:
            raise ImportFormatError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from None

    def take(name: str) -> np.ndarray:
        try:
            return raw[name]
        except KeyError:
            raise ImportFormatError(f"GGUF lacks tensor {name}") from None

    layers = []
    for i in range(config.n_layers):
        p = f"blk.{i}."
        layer = {
            "attn_norm": take(p + "attn_norm.weight"),
            "q_proj": unpermute_rope_rows(take(p + "attn_q.weight"), config.n_heads).T,
            "k_proj": unpermute_rope_rows(take(p + "attn_k.weight"), config.n_kv_heads).T,
            "v_proj": take(p + "attn_v.weight").T,
            "o_proj": take(p + "attn_output.weight").T,
            "mlp_norm": take(p + "ffn_norm.weight"),
        }
        if config.n_experts:  # stacked experts: [E, out, in]
            layer["router"] = take(p + "ffn_gate_inp.weight").T
            layer["expert_gate"] = take(p + "ffn_gate_exps.weight").swapaxes(1, 2)
            layer["expert_up"] = take(p + "ffn_up_exps.weight").swapaxes(1, 2)
            layer["expert_down"] = take(p + "ffn_down_exps.weight").swapaxes(1, 2)
        else:
            layer["gate_proj"] = take(p + "ffn_gate.weight").T
            layer["up_proj"] = take(p + "ffn_up.weight").T
            layer["down_proj"] = take(p + "ffn_down.weight").T
        layers.append(layer)
    tensors = {"embed": take("token_embd.weight"), "final_norm": take("output_norm.weight"), "layers": layers}
    if not config.tie_embeddings:
        tensors["lm_head"] = take("output.weight").T
    return config, assemble_params(config, tensors), reader
