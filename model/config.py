"""One frozen description of a decoder: everything the forward pass needs to know about shapes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder; optional Mixtral-style MoE FFN.

    Frozen so it can be a static argument of jitted functions and a dict key of compiled steps.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    context_length: int = 2048  # positions the model was trained for
    n_experts: int = 0  # 0 = dense SwiGLU MLP
    n_experts_per_token: int = 2
    memory: str = "kv"  # "kv" (softmax KV cache); "vq" comes with Transformer-VQ
    dtype: str = "float32"  # weight storage: float32 | bfloat16 | int8 (per-output-channel scales, f32 norms)
    # grok-1 options (defaults = plain Llama / Mixtral)
    attn_multiplier: float = 0.0  # attention-logit scale; 0 = 1/sqrt(head_dim)
    attn_logit_cap: float = 0.0  # cap * tanh(logit / cap) before masking; 0 = off
    embedding_multiplier: float = 1.0
    output_multiplier: float = 1.0
    sandwich_norms: bool = False  # RMSNorm on each sub-block's output too, before the residual add
    moe_routing: str = "mixtral"  # mixtral: softmax over the top-k logits | grok: softmax over all, top-k, not renormalised
    moe_activation: str = "silu"  # silu | gelu (tanh approximation, grok) | gelu_exact
    moe_dense: bool = False  # evaluate every expert for every token (grok-1's released code); else only used experts

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_experts and not 0 < self.n_experts_per_token <= self.n_experts:
            raise ValueError(f"n_experts_per_token={self.n_experts_per_token} not in 1..{self.n_experts}")
        if self.memory != "kv":
            raise ValueError(f"unknown memory kind {self.memory!r} (supported: 'kv')")
        if self.dtype not in ("float32", "bfloat16", "int8"):
            raise ValueError(f"unsupported dtype {self.dtype!r} (float32 | bfloat16 | int8)")
        if self.moe_routing not in ("mixtral", "grok"):
            raise ValueError(f"unknown moe_routing {self.moe_routing!r} (mixtral | grok)")
        if self.moe_activation not in ("silu", "gelu", "gelu_exact"):
            raise ValueError(f"unknown moe_activation {self.moe_activation!r} (silu | gelu | gelu_exact)")

    @property
    def n_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.dim * self.ffn_dim * max(1, self.n_experts) + self.dim * self.n_experts
        per_layer = attn + ffn + (4 if self.sandwich_norms else 2) * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.vocab_size * self.dim + head + self.dim

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config fields: {sorted(unknown)}")
        return cls(**data)


WEIGHTS = {"f32": "float32", "bf16": "bfloat16", "int8": "int8"}  # --weights names → dtypes


def grok_config(**changes: Any) -> ModelConfig:
    """The grok-1 architecture (sandwich norms, capped attention logits, multipliers, MoE with grok's
    routing and gated-gelu experts, tied embeddings) at the size of the grok fixture; scale with
    `changes`. grok-1 itself: vocab 131072, dim 6144, 64 layers, 48/8 heads of 128, ffn 32768, 8 experts."""
    base = ModelConfig(
        vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=48,
        rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True, context_length=8192,
        n_experts=8, n_experts_per_token=2, attn_multiplier=0.25, attn_logit_cap=30.0,
        embedding_multiplier=8.0, output_multiplier=0.5773502691896257, sandwich_norms=True,
        moe_routing="grok", moe_activation="gelu",
    )
    return base.replace(**changes)


def tiny_config(**changes: Any) -> ModelConfig:
    """A small random-weight config for tests: GQA (4 query / 2 kv heads), untied head."""
    base = ModelConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=128,
        rope_theta=10000.0,
        tie_embeddings=False,
        context_length=256,
    )
    return base.replace(**changes)
