"""A GGUF file straight into int4 params (config dtype "int4"), its 4-bit blocks kept as they are.

The importer (gguf_import.py) reads every tensor through one decoder; here that decoder returns each
linear weight [out, in] as a numpy structured array of groups [out, in / 32] (16 nibble bytes, scale,
min: gguf_quant.grouped's exact mapping for Q4_0/Q4_1/Q4_K, requantized for the other types), so the
importer's own row operations (transposes, llama's RoPE un-permutation, phi3's splits) move whole
groups, and its name mapping (params.py) places them. The embeddings stay float and become int8
per row (quantize.py), as every int4 model keeps them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from hkserve.checkpoint import gguf_import
from hkserve.checkpoint.families import gguf_family
from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_quant import grouped_tensor
from hkserve.checkpoint.gguf_reader import dequantize, field, open_gguf
from hkserve.checkpoint.params import _LAYER_PATHS, _TOP_PATHS, ImportFormatError
from hkserve.checkpoint.quantize import quantize_int8
from hkserve.checkpoint.tensor_map import neutral_tensors
from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig
from hkserve.model.int4 import GROUP, Int4Weight, Int8Group, quantize_int4
from hkserve.model.int4 import dequantize as dequantize_grouped

GROUPS = np.dtype([("q", np.uint8, (GROUP // 2,)), ("scale", np.float32), ("min", np.float32)])
EMBEDDINGS = "token_embd.weight"


def _as_groups(w: Int4Weight) -> np.ndarray:
    """Int4Weight [in, out] → structured groups [out, in / 32] (the file's row order)."""
    half, out = w.nibbles.shape
    groups = np.empty((out, half * 2 // GROUP), GROUPS)
    groups["q"] = np.moveaxis(w.nibbles.reshape(-1, GROUP // 2, out), -1, 0)
    groups["scale"], groups["min"] = w.scale.T, w.min.T
    return groups


def from_groups(groups: np.ndarray) -> Int4Weight:
    """Structured groups [..., in / 32, out] (stacked, in [in, out] order) → Int4Weight [..., in, out]."""
    *lead, n_groups, out = groups.shape
    nibbles = np.moveaxis(groups["q"], -1, -2).reshape(*lead, n_groups * GROUP // 2, out)
    return Int4Weight(nibbles, groups["scale"], groups["min"])


def decode(tensor) -> np.ndarray:
    """The importer's decoder: a 2-D linear weight as groups; the embeddings and 1-D tensors as float32."""
    if tensor.name == EMBEDDINGS or len(tensor.shape) != 2:
        return dequantize(tensor)
    w = grouped_tensor(tensor)
    if w is None or isinstance(w, Int8Group):  # float or Q8_0: 4-bit by min/max per group
        w = quantize_int4(dequantize(tensor).T if w is None else dequantize_grouped(w))
    return _as_groups(w)


def load_gguf_int4(path: str | Path, progress: bool = False) -> tuple[ModelConfig, dict]:
    """→ (the int4 ModelConfig, its params as numpy) from a GGUF file."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, "int4")
    arch = field(reader, "general.architecture")
    tensors = gguf_import._Tensors(reader, decode=decode)
    shapes, params = param_shapes(config), {}
    stacked: dict[tuple[str, str, bool], list] = {}  # (module, name, per layer) → values in layer order
    layers = tqdm(range(config.n_layers), desc="int4", unit="layer", disable=not progress)
    for key, layer, value in neutral_tensors(tensors, gguf_family(arch).gguf, config, layers):
        module, name = (_TOP_PATHS if layer is None else _LAYER_PATHS)[key]
        stacked.setdefault((module, name, layer is not None), []).append(value)
    if tensors.unread:
        raise ImportFormatError(f"{arch}: tensors this importer does not use: {', '.join(sorted(tensors.unread)[:5])}")
    for (module, name, per_layer), values in stacked.items():
        value = np.stack(values) if per_layer else values[0]
        if value.dtype == GROUPS:
            w = from_groups(value)
            params[module] = {**params.get(module, {}), "w": w.nibbles, "scale": w.scale, "min": w.min}
        elif name == "embeddings":
            values8, scale = quantize_int8(value, -1)
            params[module] = {"embeddings": values8, "scale": scale}
        else:
            params.setdefault(module, {})[name] = np.asarray(value, shapes[module][name].dtype)
    for module, names in shapes.items():
        for name, spec in names.items():
            got = params.get(module, {}).get(name)
            if got is None or got.shape != spec.shape or got.dtype != spec.dtype:
                raise ImportFormatError(f"int4 import: {module}/{name} is {got is not None and got.shape}, not {spec}")
    return config, params
