"""A GGUF file straight into int4 params (config dtype "int4"), its blocks kept as they are.

A stack of linear weights (one GGUF name over the layers: `attn_v.weight`) whose every tensor is Q4_0,
Q4_1 or Q4_K stays int4 (gguf_quant.grouped, exact); any other stack (a Q4_K_M file's Q5_0/Q6_K/Q8_0
ones, a float one) becomes 8-bit groups of the same form (gguf_quant.grouped8: Q5_*/Q8_0 and mixes
with Q4_* exact, Q6_K requantized within (max - min) / 510), named in config.int8_linears; an 8-bit
stack whose every tensor is Q4_0, Q5_0 or Q8_0 (d * (q - offset), no min) becomes signed 8-bit groups
with the file's float16 scales instead (gguf_quant.grouped8_sym, exact; config.int8_sym_linears: 1.0625
bytes a weight instead of 1.25, and no min for the kernel to add); among those, a stack whose every
tensor is Q5_0 becomes signed 5-bit groups, the blocks as they are (gguf_quant.grouped5, exact;
config.int5_linears: 0.6875 bytes a weight, the file's own; a Q5_0/Q8_0 mix stays 8-bit). A stack is
one array per module, so its precision is decided over all its layers: 4 bits are never forced on a
tensor the file kept at more (its int4 requantization cost Gemma 3 270M's Q4_K_M 2x its perplexity).

The importer (gguf_import.py) reads every tensor through one decoder; here that decoder returns each
linear weight [out, in] as a numpy structured array of groups [out, in / 32] (16 nibble bytes or 32
8-bit values, scale, min; or 32 int8 values and a float16 scale; or 16 nibble bytes, 4 high-bit
bytes and a float16 scale), so the importer's own row operations
(transposes, llama's RoPE un-permutation, phi3's splits) move whole groups, and its name mapping
(params.py) places them. The embeddings stay float and become int8 per row (quantize.py), as every int4
model keeps them.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from tqdm import tqdm

from hkserve.checkpoint import gguf_import
from hkserve.checkpoint.families import gguf_family
from hkserve.checkpoint.gguf_config import config_from_gguf
from hkserve.checkpoint.gguf_precision import EXACT_INT4
from hkserve.checkpoint.gguf_quant import SYM8, grouped5, grouped8, grouped8_sym, grouped_tensor
from hkserve.checkpoint.gguf_reader import dequantize, field, open_gguf
from hkserve.checkpoint.params import _LAYER_PATHS, _TOP_PATHS, ImportFormatError
from hkserve.checkpoint.quantize import quantize_int8
from hkserve.checkpoint.tensor_map import neutral_tensors
from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig
from hkserve.model.int4 import GROUP, Int4Weight, Int5Sym, Int8Group, Int8Sym, quantize_int4
from hkserve.model.int4 import dequantize as dequantize_grouped

GROUPS = np.dtype([("q", np.uint8, (GROUP // 2,)), ("scale", np.float32), ("min", np.float32)])
GROUPS8 = np.dtype([("q", np.uint8, (GROUP,)), ("scale", np.float32), ("min", np.float32)])
GROUPS8S = np.dtype([("q", np.int8, (GROUP,)), ("scale", np.float16)])
GROUPS5 = np.dtype([("q", np.uint8, (GROUP // 2,)), ("high", np.uint8, (GROUP // 8,)), ("scale", np.float16)])
EMBEDDINGS = "token_embd.weight"


def _as_groups(w: Int4Weight | Int8Group | Int8Sym | Int5Sym) -> np.ndarray:
    """A grouped weight [in, out] → structured groups [out, in / 32] (the file's row order)."""
    n_groups, out = w.scale.shape
    kind = {Int8Group: GROUPS8, Int8Sym: GROUPS8S, Int5Sym: GROUPS5}.get(type(w), GROUPS)
    groups = np.empty((out, n_groups), kind)
    for name, value in zip(kind.names, w):  # per-input fields [in, out] move whole groups
        groups[name] = np.moveaxis(value.reshape(n_groups, -1, out), -1, 0) if kind[name].shape else value.T
    return groups


def _per_input(groups: np.ndarray, name: str) -> np.ndarray:
    """A per-input field of structured groups [..., in / 32, out] → [..., in (or in / 8), out]."""
    *lead, _, out = groups.shape
    return np.moveaxis(groups[name], -1, -2).reshape(*lead, -1, out)


def from_groups(groups: np.ndarray) -> Int4Weight | Int8Group | Int8Sym | Int5Sym:
    """Structured groups [..., in / 32, out] (stacked, in [in, out] order) → the weight [..., in, out]."""
    q = _per_input(groups, "q")
    if groups.dtype == GROUPS5:
        return Int5Sym(q, _per_input(groups, "high"), groups["scale"])
    if groups.dtype == GROUPS8S:
        return Int8Sym(q, groups["scale"])
    return (Int8Group if groups.dtype == GROUPS8 else Int4Weight)(q, groups["scale"], groups["min"])


def stack_name(tensor_name: str) -> str:
    """A GGUF tensor's name without its layer: `blk.3.attn_v.weight` → `attn_v.weight`."""
    return re.sub(r"^blk\.\d+\.", "", tensor_name)


def eight_bit_stacks(reader) -> set[str]:
    """The stacks (stack_name) of 2-D linear weights with a tensor of another type than Q4_0/Q4_1/Q4_K."""
    return {
        stack_name(t.name)
        for t in reader.tensors
        if len(t.shape) == 2 and t.name != EMBEDDINGS and t.tensor_type not in EXACT_INT4
    }


def sym_stacks(reader, eight_bit: set[str]) -> set[str]:
    """The 8-bit stacks whose every tensor is Q4_0, Q5_0 or Q8_0: signed 8-bit groups, no min."""
    other = {stack_name(t.name) for t in reader.tensors if len(t.shape) == 2 and t.tensor_type not in SYM8}
    return eight_bit - other


def q5_0_stacks(reader, sym: set[str]) -> set[str]:
    """The signed stacks whose every tensor is Q5_0: signed 5-bit groups, the blocks as they are."""
    other = {stack_name(t.name) for t in reader.tensors if len(t.shape) == 2 and t.tensor_type != Q.Q5_0}
    return sym - other


def decoder(eight_bit: set[str], sym: set[str], five: set[str] = frozenset()):
    """The importer's decoder: a 2-D linear weight as groups (8-bit ones for the `eight_bit` stacks,
    signed 8-bit ones for the `sym` stacks among them, signed 5-bit ones for the `five` stacks among
    those); the embeddings and 1-D tensors as float32."""

    def decode(tensor) -> np.ndarray:
        if tensor.name == EMBEDDINGS or len(tensor.shape) != 2:
            return dequantize(tensor)
        if stack_name(tensor.name) in eight_bit:
            shape = tuple(int(d) for d in reversed(tensor.shape))
            name = stack_name(tensor.name)
            to_groups = grouped5 if name in five else grouped8_sym if name in sym else grouped8
            return _as_groups(to_groups(np.asarray(tensor.data), tensor.tensor_type, shape))
        w = grouped_tensor(tensor)
        if w is None or isinstance(w, Int8Group):  # not reached for a file's stacks (they are 8-bit then)
            w = quantize_int4(dequantize(tensor).T if w is None else dequantize_grouped(w))
        return _as_groups(w)

    return decode


def load_gguf_int4(path: str | Path, progress: bool = False) -> tuple[ModelConfig, dict]:
    """→ (the int4 ModelConfig, its params as numpy) from a GGUF file."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, "int4")
    arch = field(reader, "general.architecture")
    eight_bit = eight_bit_stacks(reader)
    signed = sym_stacks(reader, eight_bit)
    tensors = gguf_import._Tensors(reader, decode=decoder(eight_bit, signed, q5_0_stacks(reader, signed)))
    floats, params = param_shapes(config), {}  # floats: the norms' and biases' dtypes
    forms: dict = {GROUPS8: set(), GROUPS8S: set(), GROUPS5: set()}  # the modules of each non-int4 form
    stacked: dict[tuple[str, str, bool], list] = {}  # (module, name, per layer) → values in layer order
    layers = tqdm(range(config.n_layers), desc="int4", unit="layer", disable=not progress)
    for key, layer, value in neutral_tensors(tensors, gguf_family(arch).gguf, config, layers):
        module, name = (_TOP_PATHS if layer is None else _LAYER_PATHS)[key]
        stacked.setdefault((module, name, layer is not None), []).append(value)
    if tensors.unread:
        raise ImportFormatError(f"{arch}: tensors this importer does not use: {', '.join(sorted(tensors.unread)[:5])}")
    for (module, name, per_layer), values in stacked.items():
        value = np.stack(values) if per_layer else values[0]
        if value.dtype in (GROUPS, *forms):
            w = from_groups(value)
            params[module] = {**params.get(module, {}), "w": w[0], **{n: getattr(w, n) for n in value.dtype.names[1:]}}
            if value.dtype != GROUPS:
                forms[value.dtype].add(module.rsplit("/", 1)[-1])
        elif name == "embeddings":
            values8, scale = quantize_int8(value, -1)
            params[module] = {"embeddings": values8, "scale": scale}
        else:
            params.setdefault(module, {})[name] = np.asarray(value, floats[module][name].dtype)
    eight, sym, five = (tuple(sorted(forms[k])) for k in (GROUPS8, GROUPS8S, GROUPS5))
    config = config.replace(int8_linears=eight, int8_sym_linears=sym, int5_linears=five)
    for module, names in param_shapes(config).items():
        for name, spec in names.items():
            got = params.get(module, {}).get(name)
            if got is None or got.shape != spec.shape or got.dtype != spec.dtype:
                raise ImportFormatError(f"int4 import: {module}/{name} is {got is not None and got.shape}, not {spec}")
    return config, params
