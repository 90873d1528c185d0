"""The shape of a model family's record: where each file format keeps its tensors (`TensorNames`) and
what the architecture implies (`Family`). families.py holds the records; the importers read them and
never a family's name.

A record that asks for something the importers do not implement (an option the decoder lacks, biases
on a fused projection, sandwich norms with no names for them...) is refused when it is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hkserve.model.config import ModelConfig

# HF hidden_act / hidden_activation names → ModelConfig.mlp_activation / moe_activation values.
HF_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}
_ACTIVATION_OPTIONS = ("mlp_activation", "moe_activation", "")
_CONFIG_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def _not_implemented(owner: str, what: str) -> ValueError:
    return ValueError(f"{owner}: {what} is not implemented by the importers (refusing the record)")


@dataclass(frozen=True)
class TensorNames:
    """One file format's names for the neutral layout of params.py. Per-layer names follow
    `layer_prefix` ("{i}": the layer); an expert name with "{e}" is one tensor per expert, without it
    one stacked [E, ...] tensor. "" = the format has no such tensor for this family."""

    layer_prefix: str
    embed: str
    final_norm: str
    lm_head: str
    attn_norm: str
    mlp_norm: str
    q_proj: str
    k_proj: str
    v_proj: str
    o_proj: str
    gate_proj: str = ""
    up_proj: str = ""
    down_proj: str = ""
    router: str = ""
    expert_gate: str = ""
    expert_up: str = ""
    expert_down: str = ""
    expert_gate_up: str = ""  # gate|up interleaved by columns, [E, in, 2F] (gpt-oss); replaces expert_gate/up
    experts_in_out: bool = False  # expert weights stored [E, in, out] though the linear ones are [out, in]
    shared_gate_proj: str = ""  # the shared expert's MLP and its sigmoid gate (Qwen2-MoE)
    shared_up_proj: str = ""
    shared_down_proj: str = ""
    shared_expert_gate: str = ""
    post_attn_norm: str = ""  # sandwich norms (Gemma, grok)
    post_mlp_norm: str = ""
    q_bias: str = ""  # with qkv_bias; k_bias / v_bias by the same pattern
    k_bias: str = ""
    v_bias: str = ""
    o_bias: str = ""  # with o_bias
    sinks: str = ""  # with attn_sinks: one logit per query head
    router_bias: str = ""  # with moe_biases: the router's [E], the experts' gate|up [E, 2F] (interleaved
    expert_gate_up_bias: str = ""  # as expert_gate_up) and down [E, D]
    expert_down_bias: str = ""
    q_norm: str = ""  # with qk_norm
    k_norm: str = ""
    qkv_proj: str = ""  # q|k|v fused by rows (Phi-3); replaces q_proj/k_proj/v_proj
    gate_up_proj: str = ""  # gate|up fused by rows (Phi-3); replaces gate_proj/up_proj
    out_in: bool = True  # linear weights stored [out, in] (HF, GGUF), transposed on import; else [in, out]
    permuted_qk: bool = False  # q/k rows interleaved for llama.cpp's pairwise RoPE (undone on import)
    norms_hold_offset: bool = False  # norm weights stored with the family's norm_offset added (llama.cpp)

    def __post_init__(self):
        if (self.qkv_proj or self.gate_up_proj) and not self.out_in:
            raise _not_implemented(self.layer_prefix, "a fused projection stored [in, out]")

    def replace(self, **changes: Any) -> TensorNames:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Family:
    """Everything an architecture implies, whatever file it comes from. Only `name` and `options` are
    required; a field left at its default is the plain-Llama behaviour."""

    name: str
    options: Mapping[str, Any]  # ModelConfig fields the architecture fixes (never read from the file)
    hf: TensorNames | None = None  # tensor names in an HF checkpoint; None = no HF import
    gguf: TensorNames | None = None  # tensor names in a GGUF file; None = no GGUF import
    release: TensorNames | None = None  # names in the family's own release format (grok-1's Haiku arrays)
    hf_architectures: tuple[str, ...] = ()  # config.json "architectures" names
    hf_keys: frozenset[str] = frozenset()  # config.json keys read beyond hf_config.COMMON
    gguf_architecture: str = ""  # general.architecture; "" = llama.cpp writes it as another family
    hf_activations: tuple[str, ...] = ("silu", "gelu_pytorch_tanh")  # hidden_act values accepted
    activation_option: str = "mlp_activation"  # the ModelConfig field hidden_act sets; "" = fixed by options
    tied_by_default: bool = False  # tie_word_embeddings when config.json does not say
    default_rope_theta: float = 10000.0  # rope_theta when config.json does not say
    hf_local_theta_key: str = ""  # config.json key of the sliding layers' RoPE base (Gemma 3)
    gguf_local_theta_key: str = ""  # the same in GGUF metadata, after "{arch}."
    sliding_pattern: int = 0  # every n-th layer full, the others slide, when the file lists no layer types
    sliding_opt_in: bool = False  # window only with use_sliding_window, from max_window_layers on (Qwen)
    gguf_sliding: bool = False  # whether a sliding window in GGUF metadata is imported (else refused)
    soft_caps: bool = False  # logit soft caps, √dim embedding scale, query_pre_attn_scalar (Gemma)
    gguf_dim_scale_layers: int = 0  # layer count for which llama.cpp scales attention by dim/heads (27B)
    nope_layers: bool = False  # layers without RoPE from no_rope_layers / no_rope_layer_interval (SmolLM3)
    multipliers: bool = False  # Granite's embedding, attention, residual multipliers and logits_scaling
    qwen_moe: bool = False  # Qwen-MoE keys: num_experts, moe_intermediate_size, norm_topk_prob, sparse layers
    gpt_oss: bool = False  # gpt-oss keys: attention_bias (q/k/v/o biases), swiglu_alpha / swiglu_limit
    gguf_moe_routing: str = ""  # the moe_routing llama.cpp fixes for the GGUF architecture (no norm_topk_prob there)

    def __post_init__(self):
        unknown = set(self.options) - _CONFIG_FIELDS
        if unknown:
            raise _not_implemented(self.name, f"option(s) {sorted(unknown)} (not ModelConfig fields)")
        if self.activation_option not in _ACTIVATION_OPTIONS:
            raise _not_implemented(self.name, f"activation_option {self.activation_option!r}")
        if set(self.hf_activations) - set(HF_ACTIVATIONS):
            raise _not_implemented(self.name, f"activation(s) {sorted(set(self.hf_activations) - set(HF_ACTIVATIONS))}")
        if self.multipliers and self.soft_caps:
            raise _not_implemented(self.name, "Granite's multipliers together with Gemma's soft caps")
        if self.sliding_pattern and self.sliding_opt_in:
            raise _not_implemented(self.name, "a sliding pattern together with sliding_opt_in")
        if self.hf_architectures and self.hf is None:
            raise _not_implemented(self.name, "HF architectures without HF tensor names")
        if self.gguf_architecture and self.gguf is None:
            raise _not_implemented(self.name, "a GGUF architecture without GGUF tensor names")
        for names in (self.hf, self.gguf, self.release):
            if names is not None:
                self._check_names(names)

    def _check_names(self, names: TensorNames) -> None:
        """Each option that reads tensors has names for them in every format the family imports."""
        needs = {
            "sandwich_norms": ("post_attn_norm", "post_mlp_norm"),
            "qkv_bias": ("q_bias", "k_bias", "v_bias"),
            "qk_norm": ("q_norm", "k_norm"),
            "o_bias": ("o_bias",),
            "attn_sinks": ("sinks",),
            "moe_biases": ("router_bias", "expert_gate_up_bias", "expert_down_bias", "expert_gate_up"),
        }
        if self.gpt_oss and not (names.q_bias and names.k_bias and names.v_bias and names.o_bias):
            raise _not_implemented(self.name, "attention_bias without q/k/v/o bias names")
        if self.qwen_moe and not (names.router and names.expert_gate and names.expert_up and names.expert_down):
            raise _not_implemented(self.name, "Qwen-MoE keys without expert tensor names")
        for option, tensors in needs.items():
            missing = [t for t in tensors if not getattr(names, t)]
            if self.options.get(option) and missing:
                raise _not_implemented(self.name, f"{option} without tensor names {missing}")
        if self.options.get("qkv_bias") and names.qkv_proj:
            raise _not_implemented(self.name, "biases on a fused qkv projection")
