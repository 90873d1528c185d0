"""Remake tests/fixtures/hf/tiny-gpt-oss-mxfp4 and tiny-gpt-oss-dequantized: a tiny gpt-oss checkpoint whose
experts are stored as MXFP4, as openai/gpt-oss-20b stores them, and the same model with those experts in float.

tiny-gpt-oss's config with intermediate_size 32 (MXFP4 groups 32 values along each expert's input: hidden 32
and intermediate 32), new random weights (seeded; norms and biases as scripts/make_family_fixtures.py draws
them, each expert row scaled by 2^N(0, 1) so that the groups' exponents differ). Its experts are quantized
here to MXFP4 (per group of 32: the smallest power of two that brings the largest |value| within 6, each
value rounded to the nearest E2M1 number, codes packed two a byte, the low nibble first) and written as
`*_blocks` / `*_scales` with `quantization_config: {quant_method: mxfp4}`. The float checkpoint holds
transformers' own dequantization of those blocks (transformers.integrations.mxfp4.convert_moe_packed_tensors,
float32), checked here to equal this quantizer's rounded values exactly; its reference.json has transformers'
logits (full forward and cached path) for it, checked equal to transformers' own on the MXFP4 files (loaded
with Mxfp4Config(dequantize=True)). The tests read the committed files and never need transformers.

    .venv/bin/pip install -e '.[bench]' && .venv/bin/python scripts/make_mxfp4_fixture.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from make_family_fixtures import cached_logits  # this directory's; its PROMPT-token prefill, then steps
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

HF = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # E2M1 codes 0-7; 8-15 are their negatives
EXPERTS = ("gate_up_proj", "down_proj")
NOT_CONVERTED = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
]  # as gpt-oss-20b


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[E, in, out] float → (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32], the rounded
    values [E, in, out] as float32: code value x 2^exponent)."""
    rows = weight.transpose(1, 2).reshape(*weight.shape[:1], weight.shape[2], -1, 32)  # [E, out, G, 32]
    largest = rows.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)  # [E, out, G, 1]
    scaled = rows / torch.exp2(exponent)
    index = (scaled.abs()[..., None] - MAGNITUDES).abs().argmin(-1)  # nearest magnitude
    codes = index + 8 * (scaled < 0)  # the sign bit
    values = (MAGNITUDES[index] * torch.where(scaled < 0, -1.0, 1.0)) * torch.exp2(exponent)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = (exponent[..., 0] + 127).to(torch.uint8)
    return blocks, scales, values.reshape(*rows.shape[:2], -1).transpose(1, 2).contiguous()


def random_model() -> transformers.GptOssForCausalLM:
    config = transformers.AutoConfig.from_pretrained(HF / "tiny-gpt-oss")
    config.intermediate_size = 32
    torch.manual_seed(41)
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
            elif param.ndim == 1:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(EXPERTS):  # [E, in, out]: rows of different magnitudes
                param.mul_(torch.exp2(torch.randn(param.shape[0], 1, param.shape[2])))
    return model


def main() -> None:
    model = random_model()
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    quantized = {}
    for name in [n for n in state if n.endswith(EXPERTS)]:
        blocks, scales, values = quantize(state[name])
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(theirs, values), f"{name}: transformers' dequantization differs from the quantizer's"
        quantized.update({f"{name}_blocks": blocks, f"{name}_scales": scales})
        state[name] = theirs
    mxfp4_dir, float_dir = HF / "tiny-gpt-oss-mxfp4", HF / "tiny-gpt-oss-dequantized"
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    model.save_pretrained(float_dir, safe_serialization=True)
    mxfp4_dir.mkdir(exist_ok=True)
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    (mxfp4_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    kept = {name: tensor for name, tensor in state.items() if not name.endswith(EXPERTS)}
    save_file({**kept, **quantized}, str(mxfp4_dir / "model.safetensors"), metadata={"format": "pt"})

    ids = torch.tensor(json.loads((HF / "tiny-gpt-oss" / "reference.json").read_text())["input_ids"])
    quantized_model = transformers.GptOssForCausalLM.from_pretrained(  # transformers reading the MXFP4 files
        mxfp4_dir, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        logits, cached = model(ids).logits, cached_logits(model, ids)
        assert torch.equal(quantized_model(ids).logits, logits), "transformers reads the MXFP4 files differently"
    reference = {
        "note": "tiny-gpt-oss with intermediate_size 32, new random weights, experts as transformers dequantizes "
        "tiny-gpt-oss-mxfp4's blocks (equal to the fixture script's quantizer's values); transformers' logits "
        "on the MXFP4 checkpoint itself are these, exactly",
        "reference": f"transformers {transformers.__version__} GptOssForCausalLM, float32",
        "input_ids": ids.tolist(),
        "logits": logits.tolist(),
        "cached_logits": cached.tolist(),
    }
    (float_dir / "reference.json").write_text(json.dumps(reference))


if __name__ == "__main__":
    main()
