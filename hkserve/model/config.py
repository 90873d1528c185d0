"""One frozen description of a decoder: everything the forward pass needs to know about shapes."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Llama-family decoder; optional Mixtral-style MoE FFN; or, with memory="vq", a Transformer-VQ
    decoder (n_layers x two gated attention units, no FFN; n_heads = H, head_dim = d_k, ffn_dim unused).

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
    memory: str = "kv"  # "kv" (softmax KV cache) | "vq" (Transformer-VQ: codebook keys, constant-size state)
    dtype: str = "float32"  # weight storage: float32 | bfloat16 | int8 (per-output-channel scales, f32 norms)
    # | int4 (linear weights in groups of 32 with f32 scale and min, model/int4.py; embeddings int8)
    int8_linears: tuple[str, ...] = ()  # int4 only: linear modules (by name: q_proj ... down_proj, lm_head)
    # stored as 8-bit groups of the same form (model/int4.Int8Group): a GGUF's stacks that hold other types
    # than Q4_0/Q4_1/Q4_K (checkpoint/gguf_int4.py)
    int8_sym_linears: tuple[str, ...] = ()  # int4 only: linear modules stored as signed 8-bit groups with a
    # float16 scale and no min (model/int4.Int8Sym): a GGUF's stacks of Q4_0/Q5_0/Q8_0 (not all Q4_0)
    int5_linears: tuple[str, ...] = ()  # int4 only: linear modules stored as signed 5-bit groups with a
    # float16 scale (model/int4.Int5Sym): a GGUF's stacks whose every tensor is Q5_0
    kv_dtype: str = "auto"  # the KV memory's: auto (float32 for float32 weights, else bfloat16) | float32 | bfloat16
    # grok-1 options (defaults = plain Llama / Mixtral)
    attn_multiplier: float = 0.0  # attention-logit scale; 0 = 1/sqrt(head_dim)
    attn_logit_cap: float = 0.0  # cap * tanh(logit / cap) before masking; 0 = off
    embedding_multiplier: float = 1.0
    output_multiplier: float = 1.0
    sandwich_norms: bool = False  # RMSNorm on each sub-block's output too, before the residual add
    moe_routing: str = (
        "mixtral"  # mixtral: softmax over the top-k logits | grok: softmax over all, top-k, not renormalised
    )
    moe_activation: str = "silu"  # silu | gelu (tanh approximation, grok) | gelu_exact | clamped_swiglu
    # (gpt-oss: gate clamped above at swiglu_limit, up to ±swiglu_limit, (up + 1) * gate * sigmoid(alpha * gate))
    swiglu_limit: float = 0.0  # with moe_activation="clamped_swiglu"
    swiglu_alpha: float = 0.0
    moe_biases: bool = False  # biases on the router and on each expert's gate, up and down products (gpt-oss)
    shared_expert_dim: int = 0  # with n_experts: a gated MLP of this width that every token uses, scaled by
    # sigmoid(x @ shared_gate), added to the routed experts (Qwen2-MoE); 0 = none
    moe_dense: bool = False  # evaluate every expert for every token (grok-1's released code); else only used experts
    # Options of other families (defaults = plain Llama); docs in README "Supported model families"
    mlp_activation: str = "silu"  # dense MLP's gate: silu (SwiGLU) | gelu (tanh approximation: Gemma's GeGLU)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    o_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    attn_sinks: bool = False  # a learned logit per query head in each softmax's denominator (gpt-oss)
    qk_norm: bool = False  # RMSNorm over each head of q and of k before RoPE (Qwen3, Gemma 3)
    qk_norm_full: bool = False  # with qk_norm: one RMSNorm over all of q's heads [H*Dh] and k's [Hkv*Dh] (OLMo 2)
    pre_norms: bool = True  # RMSNorm before attention and MLP; False = only the sandwich's after-norms (OLMo 2)
    norm_offset: float = 0.0  # every RMSNorm multiplies by (norm_offset + scale): Gemma stores w for 1 + w
    final_logit_cap: float = 0.0  # cap * tanh(logit / cap) on the output logits (Gemma 2); 0 = off
    rope_freq_factors: tuple[float, ...] = ()  # divisors of the head_dim/2 RoPE frequencies (Llama 3); () = none
    rope_attn_factor: float = 1.0  # multiplies RoPE's cos and sin, so q and k (YaRN, LongRoPE); 1 = none
    sliding_window: int = 0  # keys a sliding layer sees, its own position included (Mistral, Gemma); 0 = none
    sliding_layers: tuple[bool, ...] = ()  # per layer: does it slide? (n_layers entries when sliding_window > 0)
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers (Gemma 3); 0 = rope_theta
    rope_layers: tuple[bool, ...] = ()  # per layer: does it apply RoPE? () = every layer (SmolLM3: not every 4th)
    residual_multiplier: float = 1.0  # each sub-block's output is scaled by it before the residual add (Granite)
    # Transformer-VQ (memory="vq"); docs/transformer-vq.md
    vq_value_dim: int = 0  # d_v per head (the paper: 2 * dim)
    vq_codes: int = 512  # C, codebook size per head
    vq_block_len: int = 512  # L, training block length (serving takes any block length)
    vq_mem_len: int = 512  # M, window of exact keys; the position band covers distances 0..M
    vq_pe_lam: float = 1e5  # lambda of the relative-position sinusoids
    vq_e_preln: bool = True  # RMSNorm before the output head

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2 and self.memory == "kv":
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.n_experts and not 0 < self.n_experts_per_token <= self.n_experts:
            raise ValueError(f"n_experts_per_token={self.n_experts_per_token} not in 1..{self.n_experts}")
        if self.shared_expert_dim and not self.n_experts:
            raise ValueError("shared_expert_dim needs n_experts (a shared expert sits beside routed ones)")
        if self.memory not in ("kv", "vq"):
            raise ValueError(f"unknown memory kind {self.memory!r} (supported: 'kv', 'vq')")
        if self.memory == "vq":
            self._check_vq()
        if self.dtype not in ("float32", "bfloat16", "int8", "int4"):
            raise ValueError(f"unsupported dtype {self.dtype!r} (float32 | bfloat16 | int8 | int4)")
        if self.kv_dtype not in KV_DTYPES.values():
            raise ValueError(f"unsupported kv_dtype {self.kv_dtype!r} ({' | '.join(KV_DTYPES.values())})")
        if self.kv_dtype != "auto" and self.memory != "kv":
            raise ValueError("kv_dtype chooses a KV memory's dtype: a Transformer-VQ memory keeps its own")
        if self.dtype == "int4" and (self.n_experts or self.memory != "kv"):
            raise ValueError("int4 weights are implemented for dense KV decoders only (not MoE experts, not VQ)")
        if self.int8_linears and (self.dtype != "int4" or not set(self.int8_linears) <= set(LINEARS)):
            raise ValueError(f"int8_linears names int4 models' linear modules ({', '.join(LINEARS)})")
        if self.int8_sym_linears and (
            self.dtype != "int4"
            or not set(self.int8_sym_linears) <= set(LINEARS)
            or set(self.int8_sym_linears) & set(self.int8_linears)
        ):
            raise ValueError(
                f"int8_sym_linears names int4 models' linear modules not in int8_linears ({', '.join(LINEARS)})"
            )
        if self.int5_linears and (
            self.dtype != "int4"
            or not set(self.int5_linears) <= set(LINEARS)
            or set(self.int5_linears) & set(self.int8_linears + self.int8_sym_linears)
        ):
            raise ValueError(f"int5_linears names int4 models' linear modules in no other list ({', '.join(LINEARS)})")
        if self.moe_routing not in ("mixtral", "grok"):
            raise ValueError(f"unknown moe_routing {self.moe_routing!r} (mixtral | grok)")
        if self.moe_activation not in ("silu", "gelu", "gelu_exact", "clamped_swiglu"):
            raise ValueError(
                f"unknown moe_activation {self.moe_activation!r} (silu | gelu | gelu_exact | clamped_swiglu)"
            )
        if (self.moe_activation == "clamped_swiglu") != (self.swiglu_limit > 0 and self.swiglu_alpha > 0):
            raise ValueError(
                "moe_activation='clamped_swiglu' needs swiglu_limit > 0 and swiglu_alpha > 0 (and only it)"
            )
        if self.moe_biases and not self.n_experts:
            raise ValueError("moe_biases needs n_experts")
        if self.mlp_activation not in ("silu", "gelu"):
            raise ValueError(f"unknown mlp_activation {self.mlp_activation!r} (silu | gelu)")
        self._check_attention_options()

    def _check_attention_options(self) -> None:
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(f"rope_freq_factors needs head_dim/2 = {self.head_dim // 2} entries")
        if self.rope_layers and len(self.rope_layers) != self.n_layers:
            raise ValueError(f"rope_layers needs one entry per layer ({self.n_layers})")
        if self.qk_norm_full and not self.qk_norm:
            raise ValueError("qk_norm_full needs qk_norm")
        if not self.pre_norms and not self.sandwich_norms:
            raise ValueError("pre_norms=False needs sandwich_norms (a block needs some norm)")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 0")
        if self.sliding_window and len(self.sliding_layers) != self.n_layers:
            raise ValueError(f"sliding_window needs sliding_layers with one entry per layer ({self.n_layers})")
        if not self.sliding_window and any(self.sliding_layers):
            raise ValueError("sliding_layers without a sliding_window")
        if self.memory == "vq" and (self.sliding_window or self.qkv_bias or self.qk_norm or self.rope_freq_factors):
            raise ValueError("memory='vq' has none of the KV decoder's attention options")
        if self.memory == "vq" and (self.rope_attn_factor != 1.0 or self.o_bias or self.attn_sinks):
            raise ValueError("memory='vq' has none of the KV decoder's attention options")

    def _check_vq(self) -> None:
        sizes = {
            "vq_value_dim": self.vq_value_dim,
            "vq_codes": self.vq_codes,
            "vq_block_len": self.vq_block_len,
            "vq_mem_len": self.vq_mem_len,
        }
        bad = [f"{k}={v}" for k, v in sizes.items() if v <= 0]
        if bad:
            raise ValueError(f"memory='vq' needs positive {', '.join(bad)}")
        if self.dim % 2:
            raise ValueError(f"dim={self.dim} must be even for the sin|cos position sinusoids")
        if self.n_kv_heads != self.n_heads:
            raise ValueError(
                f"memory='vq' has no kv-head grouping: n_kv_heads={self.n_kv_heads} must equal n_heads={self.n_heads}"
            )
        if self.n_experts:
            raise ValueError("memory='vq' has no FFN, so no experts")

    def layer_windows(self) -> tuple[int, ...]:
        """Per layer: how many keys (own position included) it attends to; 0 = all (full attention)."""
        if not self.sliding_window:
            return (0,) * self.n_layers
        return tuple(self.sliding_window if slides else 0 for slides in self.sliding_layers)

    def layer_rope_thetas(self) -> tuple[float, ...]:
        """Per layer: the RoPE base (sliding layers may have their own)."""
        local = self.rope_local_theta or self.rope_theta
        return tuple(local if w else self.rope_theta for w in self.layer_windows())

    def layer_rope_on(self) -> tuple[float, ...]:
        """Per layer: 1.0 if it applies RoPE, else 0.0."""
        return tuple(float(on) for on in self.rope_layers) if self.rope_layers else (1.0,) * self.n_layers

    @property
    def n_params(self) -> int:
        """Numbers in the serving param tree (for VQ: learned weights plus the codebooks)."""
        if self.memory == "vq":
            return self._vq_n_params()
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        attn += (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.qkv_bias else 0
        attn += (self.dim if self.o_bias else 0) + (self.n_heads if self.attn_sinks else 0)
        qk_norm_width = (self.n_heads + self.n_kv_heads) * self.head_dim if self.qk_norm_full else 2 * self.head_dim
        attn += qk_norm_width if self.qk_norm else 0
        ffn = 3 * self.dim * self.ffn_dim * max(1, self.n_experts) + self.dim * self.n_experts
        ffn += (3 * self.dim * self.shared_expert_dim + self.dim) if self.shared_expert_dim else 0
        ffn += self.n_experts * (1 + 2 * self.ffn_dim + self.dim) if self.moe_biases else 0
        norms = (2 if self.pre_norms else 0) + (2 if self.sandwich_norms else 0)
        per_layer = attn + ffn + norms * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * per_layer + self.vocab_size * self.dim + head + self.dim

    def _vq_n_params(self) -> int:
        h, d, dk, dv, s = self.n_heads, self.dim, self.head_dim, self.vq_value_dim, self.vq_codes
        gau = (
            2 * d  # input norm gain and bias
            + d * h * dk * 2  # q_proj, r_proj
            + d * h * (dk + 2 * dv)  # kvg_proj
            + h * dv * d  # o_proj
            + 2 * h * dk  # xl_u, xl_v
            + h * s * (dk + 1)
        )  # codebook c_sum, c_count
        head = self.vocab_size + (0 if self.tie_embeddings else self.vocab_size * self.dim)  # (+ output bias)
        return 2 * self.n_layers * gau + self.vocab_size * self.dim + head + (self.dim if self.vq_e_preln else 0)

    def replace(self, **changes: Any) -> ModelConfig:
        """A changed copy; a dtype other than int4 drops int8_linears, int8_sym_linears and int5_linears
        (they describe the int4 variant)."""
        if changes.get("dtype", "int4") != "int4":
            changes.setdefault("int8_linears", ())
            changes.setdefault("int8_sym_linears", ())
            changes.setdefault("int5_linears", ())
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown config fields: {sorted(unknown)}")
        # JSON has no tuples; the config must stay hashable
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})


LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
KV_DTYPES = {"auto": "auto", "f32": "float32", "bf16": "bfloat16"}  # --kv-dtype names → ModelConfig.kv_dtype
WEIGHTS = {"f32": "float32", "bf16": "bfloat16", "int8": "int8", "int4": "int4"}  # --weights names → dtypes


def with_kv_dtype(config: ModelConfig, name: str) -> ModelConfig:
    """The model's config with --kv-dtype `name` (KV_DTYPES); "auto" leaves it as it is."""
    if name not in KV_DTYPES:
        raise ValueError(f"--kv-dtype must be one of {' | '.join(KV_DTYPES)}, got {name!r}")
    return config if name == "auto" else config.replace(kv_dtype=KV_DTYPES[name])


def default_weights(backend: str, requested: str | None) -> str:
    """The --weights name to serve with: as requested, else f32 on a CPU backend (XLA's CPU matrix
    products are slow in bfloat16) and bf16 on any accelerator (gpu, cuda, rocm, tpu: bandwidth-bound
    decode reads half the bytes, and the KV memory follows the weights' dtype)."""
    if requested is not None:
        if requested not in WEIGHTS:
            raise ValueError(f"unknown weights {requested!r} ({' | '.join(WEIGHTS)})")
        return requested
    return "f32" if backend == "cpu" else "bf16"


def grok_config(**changes: Any) -> ModelConfig:
    """The grok-1 architecture (sandwich norms, capped attention logits, multipliers, MoE with grok's
    routing and gated-gelu experts, tied embeddings) at the size of the grok fixture; scale with
    `changes`. grok-1 itself: vocab 131072, dim 6144, 64 layers, 48/8 heads of 128, ffn 32768, 8 experts."""
    base = ModelConfig(
        vocab_size=128,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=48,
        rope_theta=10000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
        context_length=8192,
        n_experts=8,
        n_experts_per_token=2,
        attn_multiplier=0.25,
        attn_logit_cap=30.0,
        embedding_multiplier=8.0,
        output_multiplier=0.5773502691896257,
        sandwich_norms=True,
        moe_routing="grok",
        moe_activation="gelu",
    )
    return base.replace(**changes)
