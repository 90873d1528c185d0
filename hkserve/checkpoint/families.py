"""One `Family` record per architecture the importers know, and the registry they look them up in.

Adding a family is one record here (registered with `register`) plus its fixtures: the importers
(hf_config.py, gguf_config.py, hf.py, gguf_import.py, grok.py) read records, never a family's name.
"""

from __future__ import annotations

from hkserve.checkpoint.family import Family, TensorNames
from hkserve.checkpoint.params import ImportFormatError

# Each tensor's name in Hugging Face transformers (Llama layout; Mixtral's experts one tensor each) and
# in llama.cpp's convert_hf_to_gguf.py (experts stacked, Gemma's norms stored with its +1 added).
_NAMES = (  # neutral key, HF name, GGUF name
    ("embed", "model.embed_tokens.weight", "token_embd.weight"),
    ("final_norm", "model.norm.weight", "output_norm.weight"),
    ("lm_head", "lm_head.weight", "output.weight"),
    ("attn_norm", "input_layernorm.weight", "attn_norm.weight"),
    ("mlp_norm", "post_attention_layernorm.weight", "ffn_norm.weight"),
    ("post_attn_norm", "", "post_attention_norm.weight"),
    ("post_mlp_norm", "", "post_ffw_norm.weight"),
    ("q_proj", "self_attn.q_proj.weight", "attn_q.weight"),
    ("k_proj", "self_attn.k_proj.weight", "attn_k.weight"),
    ("v_proj", "self_attn.v_proj.weight", "attn_v.weight"),
    ("o_proj", "self_attn.o_proj.weight", "attn_output.weight"),
    ("q_bias", "self_attn.q_proj.bias", "attn_q.bias"),
    ("k_bias", "self_attn.k_proj.bias", "attn_k.bias"),
    ("v_bias", "self_attn.v_proj.bias", "attn_v.bias"),
    ("q_norm", "self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("k_norm", "self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("gate_proj", "mlp.gate_proj.weight", "ffn_gate.weight"),
    ("up_proj", "mlp.up_proj.weight", "ffn_up.weight"),
    ("down_proj", "mlp.down_proj.weight", "ffn_down.weight"),
    ("router", "block_sparse_moe.gate.weight", "ffn_gate_inp.weight"),
    ("expert_gate", "block_sparse_moe.experts.{e}.w1.weight", "ffn_gate_exps.weight"),
    ("expert_up", "block_sparse_moe.experts.{e}.w3.weight", "ffn_up_exps.weight"),
    ("expert_down", "block_sparse_moe.experts.{e}.w2.weight", "ffn_down_exps.weight"),
)
HF_NAMES = TensorNames(layer_prefix="model.layers.{i}.", **{key: hf for key, hf, _ in _NAMES})
GGUF_NAMES = TensorNames(layer_prefix="blk.{i}.", norms_hold_offset=True, **{key: gguf for key, _, gguf in _NAMES})
# Gemma: post_attention_layernorm is the attention output's norm, pre_feedforward_layernorm the MLP's.
HF_GEMMA_NAMES = HF_NAMES.replace(
    mlp_norm="pre_feedforward_layernorm.weight",
    post_attn_norm="post_attention_layernorm.weight",
    post_mlp_norm="post_feedforward_layernorm.weight",
)
HF_PHI3_NAMES = HF_NAMES.replace(qkv_proj="self_attn.qkv_proj.weight", gate_up_proj="mlp.gate_up_proj.weight")

# llama: q/k rows permuted for llama.cpp's pairwise RoPE; the others keep HF's rotate-half layout.
GGUF_LLAMA_NAMES = GGUF_NAMES.replace(permuted_qk=True)
GGUF_PHI3_NAMES = GGUF_NAMES.replace(qkv_proj="attn_qkv.weight", gate_up_proj="ffn_up.weight")

GEMMA_HF_KEYS = frozenset({
    "hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
    "sliding_window_size", "rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern",
    "use_bidirectional_attention",
})  # fmt: skip
GEMMA_OPTIONS = {"norm_offset": 1.0, "sandwich_norms": True, "mlp_activation": "gelu"}
GEMMA = dict(
    hf=HF_GEMMA_NAMES,
    gguf=GGUF_NAMES,
    hf_keys=GEMMA_HF_KEYS,
    hf_activations=("gelu_pytorch_tanh",),
    activation_option="",
    tied_by_default=True,
    gguf_sliding=True,
    soft_caps=True,
)

LLAMA = Family(
    "llama", {}, hf=HF_NAMES, gguf=GGUF_LLAMA_NAMES, hf_architectures=("LlamaForCausalLM",), gguf_architecture="llama"
)
# llama.cpp writes Mistral and Mixtral as llama: their GGUF files import through LLAMA.
MISTRAL = Family("mistral", {}, hf=HF_NAMES, gguf=GGUF_LLAMA_NAMES, hf_architectures=("MistralForCausalLM",))
MIXTRAL = Family(
    "mixtral",
    {},
    hf=HF_NAMES,
    gguf=GGUF_LLAMA_NAMES,
    hf_architectures=("MixtralForCausalLM",),
    hf_keys=frozenset({"num_local_experts", "num_experts_per_tok"}),
    activation_option="moe_activation",
)
# Qwen: a sliding window only with use_sliding_window (from max_window_layers on), never in GGUF.
QWEN = dict(hf=HF_NAMES, gguf=GGUF_NAMES, hf_keys=frozenset({"use_sliding_window"}), sliding_opt_in=True)
QWEN2 = Family("qwen2", {"qkv_bias": True}, hf_architectures=("Qwen2ForCausalLM",), gguf_architecture="qwen2", **QWEN)
QWEN3 = Family("qwen3", {"qk_norm": True}, hf_architectures=("Qwen3ForCausalLM",), gguf_architecture="qwen3", **QWEN)
GEMMA2 = Family(
    "gemma2",
    GEMMA_OPTIONS,
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_architecture="gemma2",
    sliding_pattern=2,  # alternating, sliding first
    gguf_dim_scale_layers=46,
    **GEMMA,
)
GEMMA3 = Family(
    "gemma3",
    {**GEMMA_OPTIONS, "qk_norm": True},
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_architecture="gemma3",
    default_rope_theta=1e6,
    hf_local_theta_key="rope_local_base_freq",
    gguf_local_theta_key="rope.freq_base_swa",
    sliding_pattern=6,  # 5 sliding layers, then a full one
    gguf_dim_scale_layers=62,
    **GEMMA,
)
PHI3 = Family(
    "phi3",
    {},
    hf=HF_PHI3_NAMES,
    gguf=GGUF_PHI3_NAMES,
    hf_architectures=("Phi3ForCausalLM",),
    hf_keys=frozenset({"partial_rotary_factor"}),
    gguf_architecture="phi3",
    gguf_sliding=True,
)
# Qwen-MoE: experts as mlp.experts.{e}.*, the router mlp.gate; Qwen2-MoE adds a shared expert with a sigmoid
# gate. norm_topk_prob picks the routing (renormalised top-k or not).
HF_QWEN_MOE_NAMES = HF_NAMES.replace(
    router="mlp.gate.weight",
    expert_gate="mlp.experts.{e}.gate_proj.weight",
    expert_up="mlp.experts.{e}.up_proj.weight",
    expert_down="mlp.experts.{e}.down_proj.weight",
)
_SHARED_EXPERT = (  # neutral key, HF name, GGUF name
    ("shared_gate_proj", "mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight"),
    ("shared_up_proj", "mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight"),
    ("shared_down_proj", "mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight"),
    ("shared_expert_gate", "mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight"),
)
HF_QWEN2_MOE_NAMES = HF_QWEN_MOE_NAMES.replace(**{key: hf for key, hf, _ in _SHARED_EXPERT})
GGUF_QWEN2_MOE_NAMES = GGUF_NAMES.replace(**{key: gguf for key, _, gguf in _SHARED_EXPERT})
QWEN_MOE_KEYS = frozenset({
    "use_sliding_window", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
})  # fmt: skip
QWEN_MOE = dict(activation_option="moe_activation", sliding_opt_in=True, qwen_moe=True)
# llama.cpp: qwen2moe never renormalises the top-k, qwen3moe always does (its build_moe_ffn norm_w).
QWEN2_MOE = Family(
    "qwen2_moe", {"qkv_bias": True}, HF_QWEN2_MOE_NAMES, GGUF_QWEN2_MOE_NAMES, **QWEN_MOE,
    hf_architectures=("Qwen2MoeForCausalLM",), gguf_architecture="qwen2moe", gguf_moe_routing="grok",
    hf_keys=QWEN_MOE_KEYS | {"shared_expert_intermediate_size", "qkv_bias"},
)  # fmt: skip
QWEN3_MOE = Family(
    "qwen3_moe", {"qk_norm": True}, HF_QWEN_MOE_NAMES, GGUF_NAMES, **QWEN_MOE, hf_keys=QWEN_MOE_KEYS,
    hf_architectures=("Qwen3MoeForCausalLM",), gguf_architecture="qwen3moe", gguf_moe_routing="mixtral",
)  # fmt: skip
# Granite (3.x dense): Llama's tensors and four scalar multipliers (GGUF: the *_scale keys).
GRANITE = Family(
    "granite",
    {},
    hf=HF_NAMES,
    gguf=GGUF_LLAMA_NAMES,
    hf_architectures=("GraniteForCausalLM",),
    gguf_architecture="granite",
    hf_keys=frozenset({"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"}),
    multipliers=True,
)
# OLMo 2: norms only after attention and MLP (before the residual add), q/k norms over all heads.
OLMO2 = Family(
    "olmo2",
    {"sandwich_norms": True, "pre_norms": False, "qk_norm": True, "qk_norm_full": True},
    hf=HF_NAMES.replace(
        attn_norm="",
        mlp_norm="",
        post_attn_norm="post_attention_layernorm.weight",
        post_mlp_norm="post_feedforward_layernorm.weight",
    ),
    gguf=GGUF_NAMES.replace(attn_norm="", mlp_norm=""),
    hf_architectures=("Olmo2ForCausalLM",),
    gguf_architecture="olmo2",
)
# SmolLM3: Llama with no RoPE on every 4th layer (no_rope_layers; llama.cpp fixes every 4th); a window
# only with use_sliding_window.
SMOLLM3 = Family(
    "smollm3",
    {},
    hf=HF_NAMES,
    gguf=GGUF_LLAMA_NAMES,
    hf_architectures=("SmolLM3ForCausalLM",),
    gguf_architecture="smollm3",
    hf_keys=frozenset({"use_sliding_window", "no_rope_layers", "no_rope_layer_interval"}),
    sliding_opt_in=True,
    tied_by_default=True,
    nope_layers=True,
)
# gpt-oss: attention sinks, q/k/v/o biases, sliding/full layers, yarn; experts stored [E, in, out] with
# gate|up interleaved by columns, biases on the router and every expert product, clamped SwiGLU. HF only:
# the pinned llama.cpp converter (0c1e5709) has no gpt-oss class, and its gpt-oss GGUF files hold MXFP4
# experts, which the GGUF importer does not read.
_GPT_OSS_TENSORS = {  # neutral key → HF name (the experts stacked, gate|up interleaved by columns)
    "o_bias": "self_attn.o_proj.bias", "sinks": "self_attn.sinks", "router": "mlp.router.weight",
    "router_bias": "mlp.router.bias", "expert_gate_up": "mlp.experts.gate_up_proj",
    "expert_gate_up_bias": "mlp.experts.gate_up_proj_bias", "expert_down": "mlp.experts.down_proj",
    "expert_down_bias": "mlp.experts.down_proj_bias",
}  # fmt: skip
HF_GPT_OSS_NAMES = HF_NAMES.replace(**_GPT_OSS_TENSORS, expert_gate="", expert_up="", experts_in_out=True)
GPT_OSS = Family(
    "gpt_oss",
    {"attn_sinks": True, "moe_biases": True, "moe_activation": "clamped_swiglu"},
    hf=HF_GPT_OSS_NAMES,
    hf_architectures=("GptOssForCausalLM",),
    hf_keys=frozenset({"num_local_experts", "num_experts_per_tok", "swiglu_alpha", "swiglu_limit"}),
    hf_activations=("silu",),
    activation_option="",
    default_rope_theta=150000.0,
    sliding_pattern=2,  # transformers' default layer_types: alternating, sliding first
    gpt_oss=True,
)
# xai-org/grok-1's Haiku module names (grok.py reads its config); weights already [in, out].
GROK_NAMES = TensorNames(
    layer_prefix="transformer/decoder_layer_{i}/",
    embed="language_model/in_out_embed/embeddings",
    final_norm="language_model/rms_norm/scale",
    lm_head="",
    attn_norm="rms_norm/scale",
    post_attn_norm="rms_norm_1/scale",
    mlp_norm="rms_norm_2/scale",
    post_mlp_norm="rms_norm_3/scale",
    q_proj="multi_head_attention/query/w",
    k_proj="multi_head_attention/key/w",
    v_proj="multi_head_attention/value/w",
    o_proj="multi_head_attention/linear/w",
    router="router/w",
    expert_gate="moe/linear/w",  # the gelu branch
    expert_up="moe/linear_v/w",  # the linear branch
    expert_down="moe/linear_1/w",
    out_in=False,
)
GROK = Family(
    "grok-1",
    {"tie_embeddings": True, "sandwich_norms": True, "moe_routing": "grok", "moe_activation": "gelu"},
    release=GROK_NAMES,
)

FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make `family` known to the importers (by its HF architecture names and GGUF architecture)."""
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


_ALL = (
    LLAMA,
    MISTRAL,
    MIXTRAL,
    QWEN2,
    QWEN3,
    QWEN2_MOE,
    QWEN3_MOE,
    GEMMA2,
    GEMMA3,
    PHI3,
    GRANITE,
    OLMO2,
    SMOLLM3,
    GPT_OSS,
    GROK,
)
for _family in _ALL:
    register(_family)


def hf_family(architecture: str) -> Family:
    """The family of an HF config.json "architectures" name."""
    by_arch = {a: f for f in FAMILIES.values() for a in f.hf_architectures}
    if architecture not in by_arch:
        supported = ", ".join(sorted(by_arch))
        raise ImportFormatError(f"unsupported architecture {architecture!r} (supported: {supported})")
    return by_arch[architecture]


def gguf_family(architecture: str) -> Family:
    """The family of a GGUF file's general.architecture."""
    by_arch = {f.gguf_architecture: f for f in FAMILIES.values() if f.gguf_architecture}
    if architecture not in by_arch:
        supported = ", ".join(by_arch)
        raise ImportFormatError(f"unsupported GGUF architecture {architecture!r} (supported: {supported})")
    return by_arch[architecture]
