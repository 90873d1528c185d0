"""Stored int8 (int4) params → the layout the CPU kernels read (hkserve/kernels/pack.py, pack4.py): packed
once when the store writes the variant (pack_layers; unpack_layers gives the XLA path its layout back), or
at load for a store written before that.

Projections of one input inside the layer stack (q, k, v; gate, up) are then fused into one packed
weight (`fuse`): their tiles concatenated, each projection starting at a whole tile, and their
scales zero-padded to match. One kernel call then quantizes the input once and spreads all their
tiles over the threads: SmolLM2's k and v have 3 tiles each, too few to split on their own.
Projections with a bias stay separate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hkserve.kernels import pack, pack4
from hkserve.model.int4 import is_int5_sym, is_int8_group, is_int8_sym
from hkserve.model.layer_weights import STACK

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The version of the packed layout a model store keeps (pack_layers: kernels/pack.py, pack4.py as of
# this number). A store written with another one is refused (checkpoint/store.py); tests/test_packed_store.py
# pins the layout's bytes, so a change to pack.py or pack4.py fails there until this is bumped.
STORED_LAYOUT = 1


def pack_params(params: dict, served: dict) -> dict:
    """Pack every param the kernel-mode decoder reads as uint8 (`served`: its param shapes), then fuse."""
    return fuse(pack_layers(params, served))


def pack_layers(params: dict, served: dict) -> dict:
    """Each param the kernel-mode decoder reads as uint8 packed on its own, the tree's structure kept:
    the layout a model store keeps (checkpoint/store.py), so a param already packed passes through.
    Tied embeddings [V, D] are packed as the [D, V] output head; the lookup reads their columns back."""
    out: dict = {}
    for module, names in params.items():
        out[module] = dict(names)
        want = served[module]
        if "min" in names and want["w"].dtype == jnp.uint8:  # int4 or 8-bit groups (kernels/pack4.py)
            if names["w"].shape != want["w"].shape:
                pack_groups = pack4.pack8 if is_int8_group(names) else pack4.pack4
                out[module].update(zip(("w", "scale", "min"), pack_groups(names["w"], names["scale"], names["min"])))
            assert all(out[module][n].shape == want[n].shape for n in ("w", "scale", "min")), module
            continue
        if is_int5_sym(names) and want["w"].ndim == names["w"].ndim + 1:  # signed 5-bit groups (pack4.pack5)
            out[module].update(zip(("w", "high", "scale"), pack4.pack5(names["w"], names["high"], names["scale"])))
        if is_int5_sym(names):
            assert all(out[module][n].shape == want[n].shape for n in ("w", "high", "scale")), module
            continue
        if is_int8_sym(names) and want["w"].dtype == jnp.uint8:  # signed 8-bit groups (pack4.pack8_sym)
            if names["w"].shape != want["w"].shape:
                out[module].update(zip(("w", "scale"), pack4.pack8_sym(names["w"], names["scale"])))
            assert all(out[module][n].shape == want[n].shape for n in ("w", "scale")), module
            continue
        for name, value in names.items():
            if want[name].dtype == jnp.uint8 and value.dtype != jnp.uint8:
                out[module][name] = pack.pack(jnp.swapaxes(value, -1, -2) if name == "embeddings" else value)
            assert out[module][name].shape == want[name].shape, (module, name)
    return out


def stored_packing(prepare) -> functools.partial | None:
    """A model's `prepare` → its pack_layers (what a store keeps packed), or None where it packs nothing."""
    if isinstance(prepare, functools.partial) and prepare.func is pack_params:
        return functools.partial(pack_layers, served=prepare.keywords["served"])
    return None


def unpack_layers(params: dict, plain: dict) -> dict:
    """pack_layers' inverse: packed params → the stored layout of `plain` (param shapes), for the XLA path."""
    out: dict = {}
    for module, names in params.items():
        out[module] = dict(names)
        want = plain[module]
        if is_int5_sym(names) and names["w"].ndim == want["w"].ndim + 1:  # pack4.pack5, inverted
            n = want["w"].shape[-1]
            out[module].update(w=_unpack4(names["w"], n), high=_unpack_high(names["high"], n))
            out[module].update(scale=_untile(names["scale"], n, jnp.float16))
            assert all(out[module][name].shape == want[name].shape for name in want), module
            continue
        sym = is_int8_sym(names)
        if ("min" in names or sym) and names["w"].shape != want["w"].shape:
            unpack = _unpack8g if names["w"].shape[-1] == 2048 else _unpack4
            w = unpack(names["w"], want["w"].shape[-1])
            out[module].update(w=jax.lax.bitcast_convert_type(w, jnp.int8) if sym else w)
            groups = ("scale",) if sym else ("scale", "min")
            out[module].update({n: _untile(names[n], want[n].shape[-1], want[n].dtype) for n in groups})
        else:
            for name, value in names.items():
                if value.dtype == jnp.uint8 and want[name].dtype == jnp.int8:
                    head = want[name].shape[::-1][:2] if name == "embeddings" else want[name].shape[-2:]
                    w = _unpack8(value, *head)
                    out[module][name] = jnp.swapaxes(w, -1, -2) if name == "embeddings" else w
        assert all(out[module][n].shape == want[n].shape for n in want), module
    return out


def _unpack8(packed, k: int, n: int):
    """uint8 [..., N_pad/64, K_pad/4, 64, 4] → int8 [..., K, N] (kernels/pack.py's pack, inverted)."""
    *lead, tiles, quads, _, _ = packed.shape
    nl = len(lead)
    w = jnp.transpose(packed, (*range(nl), nl + 1, nl + 3, nl, nl + 2)).reshape(*lead, quads * 4, tiles * pack.N_TILE)
    return (w[..., :k, :n].astype(jnp.int16) - 128).astype(jnp.int8)


def _unpack4(packed, n: int):
    """uint8 [..., T, G, 1024] → stored nibbles [..., G * 16, N] (kernels/pack4.py's pack4, inverted: a byte
    keeps its two nibbles, only its place moves)."""
    *lead, tiles, groups, _ = packed.shape
    nl = len(lead)
    w = packed.reshape(*lead, tiles, groups, 4, 4, 16, 4)  # [..., T, G, j, c, 16, e]
    w = jnp.transpose(w, (*range(nl), nl + 1, nl + 2, nl + 5, nl, nl + 3, nl + 4))  # [..., G, j, e, T, c, 16]
    return w.reshape(*lead, groups * 16, tiles * pack4.N_TILE)[..., :n]


def _unpack_high(plane, n: int):
    """uint8 [..., T, G, 256] (pack4.pack5's high bits) → stored high [..., G * 4, N]: bit i of byte 4g + b
    is input 32g + 8b + i's."""
    *lead, tiles, groups, _ = plane.shape
    nl = len(lead)
    b = plane.reshape(*lead, tiles, groups, 4, 16, 2, 2).astype(jnp.uint16)  # [..., T, G, j, l, h, byte]
    word = b[..., 0] | (b[..., 1] << 8)  # [..., T, G, j, l, h]
    ar = functools.partial(jnp.arange, dtype=jnp.int32)
    # bit c + 4 + 8 (k % 2) - 4 (k // 2): unpack k = 0, 1, 2, 3 of line c at c + 4, c + 12, c, c + 8
    shift = ar(4)[:, None] + 4 + 8 * ar(2)[:, None, None, None] - 4 * ar(2)[:, None, None, None, None, None, None]
    shift = shift.astype(jnp.uint16)
    word = jnp.transpose(word, (*range(nl), nl + 1, nl + 2, nl + 4, nl, nl + 3))  # [..., G, j, h, T, l]
    w = word[..., None, :, :, None, :, None, :]  # [..., G, 1, j, h, 1, T, 1, l]
    bits = (w >> shift) & 1  # [..., G, k//2, j, h, k%2, T, c, l]: input 16 (k//2) + 4j + 2h + k%2
    bits = bits.reshape(*lead, groups * 4, 8, tiles * pack4.N_TILE)[..., :n].astype(jnp.uint8)
    return (bits << jnp.arange(8, dtype=jnp.uint8)[:, None]).sum(axis=-2, dtype=jnp.uint8)


def _unpack8g(packed, n: int):
    """uint8 [..., T, G, 2048] → stored 8-bit groups [..., G * 32, N] (kernels/pack4.py's pack8, inverted)."""
    *lead, tiles, groups, _ = packed.shape
    nl = len(lead)
    w = packed.reshape(*lead, tiles, groups, 8, 4, 16, 4)  # [..., T, G, j, c, 16, e]
    w = jnp.transpose(w, (*range(nl), nl + 1, nl + 2, nl + 5, nl, nl + 3, nl + 4))  # [..., G, j, e, T, c, 16]
    return w.reshape(*lead, groups * 32, tiles * pack4.N_TILE)[..., :n]


def _untile(tiled, n: int, dtype):
    """Scale or min [..., T, G, 64] → [..., G, N]."""
    *lead, tiles, groups, _ = tiled.shape
    return jnp.swapaxes(tiled, -3, -2).reshape(*lead, groups, tiles * pack4.N_TILE)[..., :n].astype(dtype)


def _fusable(entry: dict | None) -> bool:
    """A packed stacked weight without a bias: int8 (w, scale), int4 or 8-bit groups (w, scale, min;
    kernels/pack4.py), signed 8-bit or 5-bit groups (w, float16 scale; pack4.pack8_sym, pack5)."""
    if entry is None or entry["w"].dtype != jnp.uint8:
        return False
    return (set(entry) == {"w", "scale"} and entry["w"].ndim == (4 if is_int8_sym(entry) else 5)) or (
        set(entry) in ({"w", "scale", "min"}, {"w", "high", "scale"}) and entry["w"].ndim == 4
    )


def _form(entry: dict) -> tuple:
    """What a packed weight's kernel is told by: its bytes per (tile, group) or row, scale dtype, a min."""
    return entry["w"].shape[-1], entry["scale"].dtype, "min" in entry, "high" in entry


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
            if not all(_fusable(e) for e in entries) or len({_form(e) for e in entries}) > 1:
                continue  # (int4, 8-bit groups and signed 8-bit or 5-bit ones are not fused together)
            for part in parts:
                del out[parent + part]
            if entries[0]["w"].ndim == 4:  # grouped: w, scale (and min) are all per tile [L, N/64, ...]
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
