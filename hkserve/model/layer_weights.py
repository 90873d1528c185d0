"""The scanned layers' packed int8 (and int4) weights, handed to the CPU kernels whole instead of layer by layer.

`hk.layer_stack` scans the decoder's blocks over their stacked params, and XLA's CPU backend
materializes each layer's slice before a custom call (or a dot) can read it: for SmolLM2 that copied
~130 MB of packed weights per decode step, as long as the products themselves took. So in kernel
mode the packed [L, ...] weights are held out of the params the stack slices (`split`), and a
`Linear` inside the stack passes the whole stack plus the scan's layer index to the kernel, which
reads that layer where it lies (`held`). Projections that read the same input (q, k, v; gate, up)
are held fused, as one packed weight that `prepare` concatenated (model/packing.py): one kernel
call quantizes the input once and splits all their tiles over the threads (`fused`).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import haiku as hk
import jax
import jax.numpy as jnp

from hkserve.kernels import dispatch, ffi, pack, q4ffi

STACK = "decoder/layers/"  # hk.layer_stack's module prefix of the decoder's blocks


class HeldWeight(NamedTuple):
    packed: jax.Array  # [L, N/64, K/4, 64, 4] uint8, every layer's packed weight (int4: [L, N/64, K/32, 1024])
    scale: jax.Array  # [L, N] float32 (int4: [L, N/64, K/32, 64])
    layer: jax.Array  # [] int32: the layer the scan is at
    mins: jax.Array | None = None  # int4 only: [L, N/64, K/32, 64] float32 (kernels/pack4.py; 8-bit groups: w
    # [L, N/64, K/32, 2048], pack4.pack8; signed 8-bit groups: no mins, scale [L, N/64, K/32, 64] float16;
    # signed 5-bit groups: no mins, w [L, N/64, K/32, 1024], scale float16 as signed 8-bit groups', and high)
    high: jax.Array | None = None  # signed 5-bit groups only: [L, N/64, K/32, 256] uint8 (pack4.pack5)

    def matmul(self, x: jax.Array, n: int) -> jax.Array:
        """x [..., K] · this layer's weight → [..., n] through the active CPU kernel of its form (int8 per
        channel: n is its scale's length)."""
        kernel = dispatch.matmuls()
        if self.mins is not None:  # int4 or 8-bit groups
            kind = q4ffi.kind_for(self.packed, kernel.int4)
            return q4ffi.matmul_int4(x, *self[:2], self.mins, n, kind, kernel.isa, kernel.threads, layer=self.layer)
        if self.high is not None:  # signed 5-bit groups
            return q4ffi.matmul_int5_sym(
                x, self.packed, self.high, self.scale, n, kernel.isa, kernel.threads, self.layer, kernel.int5
            )
        if self.scale.dtype == jnp.float16:  # signed 8-bit groups
            return q4ffi.matmul_int8_sym(x, *self[:2], n, kernel.isa, kernel.threads, layer=self.layer)
        return ffi.matmul(x, self.packed, self.scale, kernel.kind, kernel.isa, kernel.threads, layer=self.layer)


_HELD: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hkserve_held_weights", default=None)
_LAYER: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar("hkserve_layer", default=None)


def split(params: dict) -> tuple[dict, dict]:
    """(params without the stacked packed weights, {module path inside the stack: (packed, scale)})."""
    rest, held = {}, {}
    for module, names in params.items():
        w = names.get("w")
        int4 = "min" in names and w is not None and w.ndim == 4  # packed by kernels/pack4.py
        sym = "min" not in names and w is not None and w.ndim == 4  # pack4.pack8_sym, pack5
        if module.startswith(STACK) and w is not None and w.dtype == jnp.uint8 and (w.ndim == 5 or int4 or sym):
            parts = ("w", "scale", "min") if int4 else ("w", "scale", "high") if "high" in names else ("w", "scale")
            held[module[len(STACK) :]] = tuple(names[p] for p in parts)
            others = {k: v for k, v in names.items() if k not in parts}
            if others:  # e.g. a bias beside the weight
                rest[module] = others
        else:
            rest[module] = names
    return rest, held


@contextlib.contextmanager
def holding(held: dict):
    """While the decoder is traced: these stacked weights are read in place, not as params."""
    token = _HELD.set(held)
    try:
        yield
    finally:
        _HELD.reset(token)


@contextlib.contextmanager
def at_layer(layer: jax.Array):
    """While one scanned block is traced: the index of the layer it computes."""
    token = _LAYER.set(layer)
    try:
        yield
    finally:
        _LAYER.reset(token)


def held(module: str) -> HeldWeight | None:
    """The held weight of the module at this path inside the layer stack, with the current layer."""
    weights, layer = _HELD.get(), _LAYER.get()
    if weights is None or layer is None or module not in weights:
        return None
    packed, scale, *rest = weights[module]
    if len(weights[module]) == 3 and weights[module][2].dtype == jnp.uint8:  # (w, scale, high): 5-bit groups
        return HeldWeight(packed, scale, layer, high=rest[0])
    return HeldWeight(packed, scale, layer, *rest)


def fused(name: str, widths: tuple[int, ...], x: jax.Array) -> list[jax.Array] | None:
    """Inside a module of the layer stack in kernel mode: x [..., K] through the fused projections
    `name` (e.g. "qkv_proj"), split into outputs [..., width] per projection; None when not held fused.
    Each projection's columns start at a whole tile (its width padded to 64)."""
    weight = held(f"{hk.experimental.current_name()}/{name}")
    if weight is None:
        return None
    y = weight.matmul(x, weight.packed.shape[1] * pack.N_TILE)  # every part's columns, padded to whole tiles
    outs, at = [], 0
    for width in widths:
        outs.append(y[..., at : at + width])
        at += pack.padded_width(width)
    return outs
