"""Random-weight models of real shapes for `bench engine --random NAME`: throughput depends on shapes and
dtype, not on the values, so a 1B model needs no download."""

from __future__ import annotations

import jax

from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig

RANDOM_CONFIGS = {
    # Llama 3.2 1B: 1.24B params, tied embeddings. Plain RoPE: the Llama 3 frequency scaling changes no
    # shape and no cost, and the transformers peer is written as a plain Llama checkpoint (hf_write).
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        context_length=131072,
    ),
    # The same layout at toy size, for dry runs on a CPU.
    "tiny-llama": ModelConfig(
        vocab_size=512,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        tie_embeddings=True,
        context_length=256,
    ),
}


def random_config(name: str, dtype: str) -> ModelConfig:
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random config {name!r} (known: {', '.join(RANDOM_CONFIGS)})")
    return RANDOM_CONFIGS[name].replace(dtype=dtype)


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Params initialized by one jitted init on the default device, in the config's dtype: a bfloat16
    model never exists in float32 or on the host."""
    return jax.jit(build_model(config).init)(jax.random.PRNGKey(seed))
