"""Remake tests/fixtures/hf/*: tiny random checkpoints of each RoPE scaling type and of the families
added after ../shared/fixtures (Granite, OLMo 2, SmolLM3, Qwen2-MoE, Qwen3-MoE, gpt-oss), built and run by
transformers, with its logits (one forward over two 12-token rows, and its cached path: a 4-token prefill,
then one token per step) and greedy continuation as the reference the tests compare against.
The tests read the committed files and never need transformers.

    .venv/bin/pip install 'transformers>=4.45' torch && .venv/bin/python scripts/make_family_fixtures.py [NAME...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
TINY = {
    "vocab_size": 128,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
# name → (transformers config class, its rope_parameters, note). Small original contexts and large factors
# so the scaling moves the logits well past the tolerance at the 12 positions of the test.
ROPE_TYPES = {
    "tiny-rope-linear": ("LlamaConfig", {"rope_type": "linear", "factor": 4.0}, "linear: every frequency / 4"),
    "tiny-rope-dynamic": ("LlamaConfig", {"rope_type": "dynamic", "factor": 4.0}, "dynamic NTK, within the context"),
    "tiny-rope-yarn": (
        "LlamaConfig",
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 100.0},
        "yarn: ramp (dims 0..5 at base 100) between extrapolated and interpolated frequencies, cos/sin x mscale",
    ),
    "tiny-rope-longrope": (
        "Phi3Config",
        {
            "rope_type": "longrope",
            "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0],
            "long_factor": [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0],
        },
        "longrope (Phi-3.5): short factors and sqrt(1 + ln 4 / ln 16) on cos/sin within the original context",
    ),
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "initializer_range": 0.1}
# name → (transformers config class, its arguments beyond TINY, note): multipliers far from 1 so each shows.
FAMILIES = {
    "tiny-granite": (
        "GraniteConfig",
        {"embedding_multiplier": 3.0, "attention_multiplier": 0.2, "residual_multiplier": 0.5, "logits_scaling": 2.5},
        "granite: embedding, attention, residual multipliers and logits_scaling",
    ),
    "tiny-smollm3": (
        "SmolLM3Config",
        {"no_rope_layer_interval": 2, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        "smollm3: no RoPE on its second layer (no_rope_layers [1, 0]; the real models: every 4th)",
    ),
    "tiny-olmo2": ("Olmo2Config", {}, "olmo2: norms after attention and MLP only, q/k norms over all heads"),
    # MoE with 4 experts, 2 per token; weights drawn wider than the 0.02 default so routing and the shared
    # expert move the logits far past the tolerance.
    "tiny-qwen2-moe": (
        "Qwen2MoeConfig",
        {**MOE, "shared_expert_intermediate_size": 40, "norm_topk_prob": False},
        "qwen2_moe: q/k/v biases, top-2 of 4 experts not renormalised, shared expert with its sigmoid gate",
    ),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        {**MOE, "norm_topk_prob": True},
        "qwen3_moe: q/k norms per head, top-2 of 4 experts renormalised (norm_topk_prob), no shared expert",
    ),
    # gpt-oss: a swiglu_limit small enough that the clamps bite, a window of 4 that the steps pass.
    "tiny-gpt-oss": (
        "GptOssConfig",
        {
            "num_hidden_layers": 3,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 24,
            "initializer_range": 0.1,
            "sliding_window": 4,
            "swiglu_limit": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 100.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
        "gpt_oss: attention sinks, q/k/v/o biases, sliding/full layers (window 4), yarn RoPE, top-2 of 4 "
        "experts with router and expert biases, clamped SwiGLU (limit 0.5)",
    ),
}
FIXTURES = {**ROPE_TYPES, **FAMILIES}
SMALL_BIASES = {"tiny-gpt-oss"}  # biases everywhere (o_proj, router, experts [E, ...]): drawn around 0
ROWS, LENGTH, PROMPT, NEW = 2, 12, 4, 8


def cached_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, V]: transformers' own cached path, a PROMPT-token prefill then one token per step."""
    out = model(ids[:, :PROMPT], use_cache=True)
    rows = [out.logits]
    for pos in range(PROMPT, ids.shape[1]):
        out = model(ids[:, pos : pos + 1], past_key_values=out.past_key_values, use_cache=True)
        rows.append(out.logits)
    return torch.cat(rows, dim=1)


def build(name: str, seed: int) -> None:
    class_name, args, note = FIXTURES[name]
    torch.manual_seed(seed)
    if name in ROPE_TYPES:
        args = {"rope_parameters": {"rope_theta": TINY["rope_theta"], **args}}
    config = getattr(transformers, class_name)(**{**TINY, **args})
    if class_name == "Phi3Config":
        config.original_max_position_embeddings = args["rope_parameters"]["original_max_position_embeddings"]
        config.pad_token_id = 0
    model = getattr(transformers, class_name.replace("Config", "ForCausalLM"))(config).float().eval()
    with torch.no_grad():  # random norms and biases, so a mistake in them shows
        for pname, param in model.named_parameters():
            if name in SMALL_BIASES and pname.endswith("bias"):  # near 0, not 1: the output stays token-dependent
                param.copy_(0.1 * torch.randn_like(param))
            elif param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    ids = torch.randint(0, TINY["vocab_size"], (ROWS, LENGTH))
    with torch.no_grad():
        logits = model(ids).logits
        cached = cached_logits(model, ids)
        greedy = model.generate(ids[:1, :PROMPT], max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    out = OUT / name
    model.save_pretrained(out, safe_serialization=True)
    reference = {
        "note": note,
        "reference": f"transformers {transformers.__version__} {class_name.replace('Config', 'ForCausalLM')}, float32",
        "input_ids": ids.tolist(),
        "logits": logits.tolist(),
        "cached_logits": cached.tolist(),
        "greedy_prompt": ids[0, :PROMPT].tolist(),
        "greedy_ids": greedy[0, PROMPT:].tolist(),
    }
    (out / "reference.json").write_text(json.dumps(reference))


def main() -> None:
    for name in sys.argv[1:] or FIXTURES:
        build(name, list(FIXTURES).index(name))


if __name__ == "__main__":
    main()
