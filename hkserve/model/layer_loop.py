"""The decoder's layers as a Python loop over per-layer weights (the default on GPUs), not a scan.

`hk.layer_stack` scans the blocks over params stacked [L, ...]. On XLA's GPU backend every step then
copies each layer's slice of the large weights before the GEMM that reads it: the H200 trace of a
Llama 3.2 1B step showed three 33.5 MB copies per layer (one per MLP matrix), 0.82 of the 4.3 ms
(docs/benchmarks.md, "GPU"). Unrolled over weights that are arrays of their own, each GEMM reads its
weight where it lies. `unstack` makes those arrays once at load (the model's `prepare`); the stored
format stays stacked. The CPU keeps the scan: its compile time grows with the layers unrolled, and
its kernels read the stacked weights in place (layer_weights.py).
"""

from __future__ import annotations

import re

import jax

from hkserve.model.layer_weights import STACK as STACKED

_LAYER = re.compile(r"^decoder/layer_(\d+)/")
MODES = ("scan", "loop")


def layer_scope(layer: int) -> str:
    """The name scope (inside "decoder") of layer `layer`'s modules in the loop."""
    return f"layer_{layer}"


def default_mode() -> str:
    """ "loop" on a GPU backend, where the scan's weight slices are copied; "scan" elsewhere."""
    return "loop" if jax.default_backend() == "gpu" else "scan"


def is_unstacked(params: dict) -> bool:
    return any(_LAYER.match(module) for module in params)


def unstack(params: dict, n_layers: int) -> dict:
    """Stacked params → the loop's: "decoder/layers/M" [L, ...] becomes "decoder/layer_i/M" [...]."""
    out: dict = {}
    for module, names in params.items():
        if not module.startswith(STACKED):
            out[module] = names
            continue
        rest = module[len(STACKED) :]
        for i in range(n_layers):
            out[f"decoder/{layer_scope(i)}/{rest}"] = {name: value[i] for name, value in names.items()}
    return out


def stacked_path(path: str) -> str | None:
    """ "decoder/layer_i/M/name" → "decoder/layers/M/name" (whose partition rule it follows); None
    for a path outside the loop's layers."""
    if not _LAYER.match(path):
        return None
    return _LAYER.sub(STACKED, path)
