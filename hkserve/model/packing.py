"""Stored int8 params → the layout the CPU kernels read (hkserve/kernels/pack.py), once at load."""

from __future__ import annotations

import jax.numpy as jnp

from hkserve.kernels import pack


def pack_params(params: dict, served: dict) -> dict:
    """Pack every param the kernel-mode decoder reads as uint8 (`served`: its param shapes). Tied
    embeddings [V, D] are packed as the [D, V] output head; the lookup reads their columns back."""
    out: dict = {}
    for module, names in params.items():
        out[module] = {}
        for name, value in names.items():
            if served[module][name].dtype != jnp.uint8:
                out[module][name] = value
                continue
            weight = jnp.swapaxes(value, -1, -2) if name == "embeddings" else value
            out[module][name] = pack.pack(weight)
            assert out[module][name].shape == served[module][name].shape, (module, name)
    return out
