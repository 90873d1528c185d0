"""MXFP4 expert weights of Hugging Face gpt-oss checkpoints (openai/gpt-oss-20b, -120b) → float.

Such a checkpoint stores each expert projection W ([E, in, out] as transformers runs it) as `W_blocks`
(uint8 [E, out, in/32, 16]: two FP4 E2M1 codes a byte, the low nibble the earlier value) and `W_scales`
(uint8 [E, out, in/32]: one E8M0 exponent, biased by 127, per 32 values along `in`). A value is its code's
E2M1 number (a sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^(scale - 127):
at most two significant bits times a power of two, exact in float32 and bfloat16. So the import expands
the experts into the float weights the MoE already runs, with no rounding at all.
"""

from __future__ import annotations

import numpy as np

from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.safetensors_dir import SafetensorsDir

GROUP = 32  # values per E8M0 scale, two a byte: 16 bytes a group
SCALE_BIAS = 127
# transformers' Mxfp4Config fields: which modules stay float (the file says it by its *_blocks names) and
# whether transformers expands them on load; neither changes the values.
_CONFIG_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa / 2 if exponent == 0 else (1 + mantissa / 2) * 2.0 ** (exponent - 1)
    return sign * magnitude


E2M1 = np.array([_e2m1(code) for code in range(16)], np.float32)  # [16] the value of each 4-bit code


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] → float32 [..., G * 32], exactly."""
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ImportFormatError(f"MXFP4 blocks and scales must be uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ImportFormatError(f"MXFP4 blocks {blocks.shape} do not fit scales {scales.shape} (16 bytes a scale)")
    if (scales == 255).any():  # E8M0's NaN
        raise ImportFormatError("MXFP4 scale 255 (not a number) in a checkpoint")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., G, 16, 2]: the low nibble first
    values = E2M1[codes].reshape(*scales.shape, GROUP)  # [..., G, 32] float32
    exponents = scales.astype(np.int32)[..., None] - SCALE_BIAS  # [..., G, 1]
    np.ldexp(values, exponents, out=values)  # in place: one float copy of a layer's experts at a time
    return values.reshape(*scales.shape[:-1], -1)


def check_quantization_config(family: str, quantization: dict | None, mxfp4_family: bool) -> None:
    """config.json's quantization_config: absent, or MXFP4 in a family whose experts it is checked for;
    anything else is refused (its weights would be read as something they are not)."""
    if quantization is None:
        return
    method = quantization.get("quant_method")
    if method != "mxfp4" or not mxfp4_family:
        raise ImportFormatError(f"{family}: quantization_config quant_method {method!r} is not supported")
    unknown = set(quantization) - _CONFIG_KEYS
    if unknown:
        raise ImportFormatError(f"{family}: quantization_config field(s) {sorted(unknown)} are not supported")


class Mxfp4Tensors:
    """An HF checkpoint's tensors with MXFP4 ones expanded: `get(W)` for a W stored as W_blocks and
    W_scales returns the float32 [E, in, out] weight; everything else is the directory's own."""

    def __init__(self, tensors: SafetensorsDir):
        self.tensors = tensors

    @property
    def unread(self) -> set[str]:
        return self.tensors.unread

    def get(self, name: str) -> np.ndarray:
        blocks, scales = name + "_blocks", name + "_scales"
        if name in self.tensors or blocks not in self.tensors or scales not in self.tensors:
            return self.tensors.get(name)
        weight = dequantize_mxfp4(self.tensors.raw(blocks), self.tensors.raw(scales))  # [E, out, in]
        if weight.ndim != 3:
            raise ImportFormatError(f"MXFP4 {name}: blocks of {weight.ndim + 1} dims, not [E, out, in/32, 16]")
        return weight.swapaxes(1, 2)
