"""Float weights expanded from a stored int8 or int4 variant, for a model stored without its float32
master (a quantized GGUF keeps only the precision it serves: issue 36).

The expansion is each stored weight's own dequantization in float32 (int8: values * scale per output
channel or row; int4 and 8-bit groups: scale * q + min per group, model/int4.py), so it equals the
GGUF's dequantization exactly only where the variant kept the file's blocks exactly (an int4 variant's
Q4_*/Q5_*/Q8_0 matrices); an int8 variant, and an int4 one's int8 embeddings and requantized (Q6_K)
matrices, carry their quantization error. `hkserve convert FILE --weights f32` stores the exact float32
expansion instead.
"""

from __future__ import annotations

import numpy as np

from hkserve.checkpoint.quantize import INT8_AXES
from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig
from hkserve.model.int4 import (
    Int4Weight,
    Int5Sym,
    Int8Group,
    Int8Sym,
    dequantize,
    is_int5_sym,
    is_int8_group,
    is_int8_sym,
)

QUANTIZED = ("int8", "int4")


def _scale_name(name: str) -> str:
    return "scale" if name in ("w", "embeddings") else f"{name}_scale"


def expand_params(params: dict, config: ModelConfig) -> tuple[ModelConfig, dict]:
    """Quantized params of `config` (int8 | int4) → (the float32 config, float32 params as numpy)."""
    if config.dtype not in QUANTIZED:
        raise ValueError(f"expand_params takes int8 or int4 weights, not {config.dtype}")
    target = config.replace(dtype="float32")
    out: dict = {}
    for module, names in param_shapes(target).items():
        stored = params[module]
        out[module] = {}
        for name, spec in names.items():
            value = np.asarray(stored[name])
            if name == "w" and "min" in stored:  # int4 (8-bit) groups [..., K_pad/2 (K_pad), N] → [..., K, N]
                kind = Int8Group if is_int8_group(stored) else Int4Weight
                full = dequantize(kind(value, np.asarray(stored["scale"]), np.asarray(stored["min"])))
                value = full[..., : spec.shape[-2], :]
            elif name == "w" and is_int5_sym(stored):  # signed 5-bit groups [..., K_pad/2, N] → [..., K, N]
                parts = (np.asarray(stored["high"]), np.asarray(stored["scale"]))
                value = dequantize(Int5Sym(value, *parts))[..., : spec.shape[-2], :]
            elif name == "w" and is_int8_sym(stored):  # signed 8-bit groups [..., K_pad, N] → [..., K, N]
                value = dequantize(Int8Sym(value, np.asarray(stored["scale"])))[..., : spec.shape[-2], :]
            elif name in INT8_AXES and value.dtype == np.int8:
                scale = np.asarray(stored[_scale_name(name)])
                value = value.astype(np.float32) * np.expand_dims(scale, INT8_AXES[name])
            out[module][name] = np.asarray(value, np.float32)
            assert out[module][name].shape == spec.shape, (module, name, out[module][name].shape, spec.shape)
    return target, out
