"""Random-weight models of real shapes for `bench engine --random NAME`: throughput depends on shapes and
dtype, not on the values, so a 1B model needs no download."""

from __future__ import annotations

import jax

from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig, tiny_config

RANDOM_CONFIGS = {
    # Llama 3.2 1B: 1.24B params, tied embeddings. RoPE without Llama 3's frequency scaling (ModelConfig
    # has no rope scaling yet), which changes no shape and no cost.
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
    "tiny-llama": tiny_config(vocab_size=512, tie_embeddings=True),
}


def random_config(name: str, dtype: str) -> ModelConfig:
    if name not in RANDOM_CONFIGS:
        raise ValueError(f"unknown random config {name!r} (known: {', '.join(RANDOM_CONFIGS)})")
    return RANDOM_CONFIGS[name].replace(dtype=dtype)


def random_params(config: ModelConfig, seed: int = 0) -> dict:
    """Params initialized by one jitted init on the default device, in the config's dtype: a bfloat16
    model never exists in float32 or on the host."""
    return jax.jit(build_model(config).init)(jax.random.PRNGKey(seed))
