"""Stored int8 (int4) params → the layout the CPU kernels read (hkserve/kernels/pack.py, pack4.py), once at load.

Projections of one input inside the layer stack (q, k, v; gate, up) are then fused into one packed
weight (`fuse`): their tiles concatenated, each projection starting at a whole tile, and their
scales zero-padded to match. One kernel call then quantizes the input once and spreads all their
tiles over the threads: SmolLM2's k and v have 3 tiles each, too few to split on their own.
Projections with a bias stay separate.
"""

from __future__ import annotations

import jax.numpy as jnp

from hkserve.kernels import pack, pack4
from hkserve.model.int4 import is_int8_group
from hkserve.model.layer_weights import STACK

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def pack_params(params: dict, served: dict) -> dict:
    """Pack every param the kernel-mode decoder reads as uint8 (`served`: its param shapes). Tied
    embeddings [V, D] are packed as the [D, V] output head; the lookup reads their columns back."""
    out: dict = {}
    for module, names in params.items():
        out[module] = {}
        if "min" in names and served[module]["w"].dtype == jnp.uint8:  # int4 or 8-bit groups (kernels/pack4.py)
            pack_groups = pack4.pack8 if is_int8_group(names) else pack4.pack4
            packed = dict(zip(("w", "scale", "min"), pack_groups(names["w"], names["scale"], names["min"])))
            out[module] = {**names, **packed}
            assert all(packed[n].shape == served[module][n].shape for n in packed), module
            continue
        for name, value in names.items():
            if served[module][name].dtype != jnp.uint8:
                out[module][name] = value
                continue
            weight = jnp.swapaxes(value, -1, -2) if name == "embeddings" else value
            out[module][name] = pack.pack(weight)
            assert out[module][name].shape == served[module][name].shape, (module, name)
    return fuse(out)


def _fusable(entry: dict | None) -> bool:
    """A packed stacked weight without a bias: int8 (w, scale) or int4 (w, scale, min; kernels/pack4.py)."""
    if entry is None or entry["w"].dtype != jnp.uint8:
        return False
    return (set(entry) == {"w", "scale"} and entry["w"].ndim == 5) or (
        set(entry) == {"w", "scale", "min"} and entry["w"].ndim == 4
    )


def fuse(params: dict) -> dict:
    """Each module of the layer stack with all the parts of a FUSED projection, packed and without
    biases, gets them as one `<module>/<fused name>` {w [L, sum N_pad/64, K/4, 64, 4], scale [L, sum N_pad]}
    (int4: {w [L, sum N_pad/64, K/32, 1024], scale and min [L, sum N_pad/64, K/32, 64]})."""
    out = dict(params)
    for module in params:
        for name, parts in FUSED.items():
            if not (module.startswith(STACK) and module.endswith("/" + parts[0])):
                continue
            parent = module[: -len(parts[0])]
            entries = [params.get(parent + part) for part in parts]
            if not all(_fusable(e) for e in entries) or len({e["w"].shape[-1] for e in entries}) > 1:
                continue  # (int4 and 8-bit groups are not fused together)
            for part in parts:
                del out[parent + part]
            if "min" in entries[0]:  # int4: w, scale and min are all per tile [L, N/64, ...]
                out[parent + name] = {n: jnp.concatenate([e[n] for e in entries], axis=1) for n in entries[0]}
                continue
            scales = []
            for e in entries:
                n = e["scale"].shape[-1]
                scales.append(jnp.pad(e["scale"], [(0, 0), (0, pack.padded_width(n) - n)]))
            out[parent + name] = {
                "w": jnp.concatenate([e["w"] for e in entries], axis=1),
                "scale": jnp.concatenate(scales, axis=-1),
            }
    return out
