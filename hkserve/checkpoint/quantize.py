"""Weight variants of a float (float32 or bfloat16) model: a cast to the other float dtype, int8
weight-only quantization (symmetric absmax per output channel, float32 scales; norm scales stay float32),
or int4 linear weights (min/max per group of 32 inputs, model/int4.py) with int8 embeddings."""

from __future__ import annotations

import numpy as np

from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig
from hkserve.model.int4 import quantize_int4

# Quantized params and the axis their absmax reduces over (the input axis of each product).
INT8_AXES = {"w": -2, "embeddings": -1, "gate_proj": -2, "up_proj": -2, "down_proj": -2}


def quantize_int8(w: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """→ (int8 values, float32 scale with `axis` removed) so that w ≈ values * scale."""
    w = np.asarray(w, np.float32)
    scale = np.abs(w).max(axis=axis) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    values = np.clip(np.rint(w / np.expand_dims(scale, axis)), -127, 127).astype(np.int8)
    return values, scale


def convert_params(params: dict, config: ModelConfig, dtype: str) -> tuple[ModelConfig, dict]:
    """Float params of `config` → (config of the variant, its params as numpy)."""
    target = config.replace(dtype=dtype)
    if dtype == config.dtype:
        return target, params
    if config.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"variants are made from float (float32 | bfloat16) weights, not {config.dtype}")
    out: dict = {}
    shapes = param_shapes(target)
    for module, names in shapes.items():
        for name in names:
            if dtype == "int4" and name == "w":
                q = quantize_int4(params[module][name])
                out.setdefault(module, {}).update(w=q.nibbles, scale=q.scale, min=q.min)
            elif (dtype == "int8" and name in INT8_AXES) or (dtype == "int4" and name == "embeddings"):
                values, scale = quantize_int8(params[module][name], INT8_AXES[name])
                out.setdefault(module, {})[name] = values
                out[module]["scale" if name in ("w", "embeddings") else f"{name}_scale"] = scale
    for module, names in shapes.items():  # the rest (norm scales, or everything for bf16): cast
        for name, spec in names.items():
            if name not in out.get(module, {}):
                out.setdefault(module, {})[name] = np.asarray(params[module][name]).astype(spec.dtype)
    for module, names in shapes.items():  # every expected param, with its shape
        for name, spec in names.items():
            assert out[module][name].shape == spec.shape and out[module][name].dtype == spec.dtype, (module, name)
    return target, out
