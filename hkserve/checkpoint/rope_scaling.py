"""RoPE scaling types → what the decoder applies: divisors of the inverse frequencies, a factor on
cos/sin (transformers' `attention_scaling`) and, where transformers' frequencies change with the
sequence length, the longest context they are fixed over. Each type follows transformers'
`rope_init_fn` (modeling_rope_utils) for the positions served.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from hkserve.checkpoint.params import ImportFormatError

SUPPORTED = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class RopeScaling(NamedTuple):
    freq_factors: tuple[float, ...]  # [Dh/2] divisors of the default inverse frequencies; () = none
    attn_factor: float  # multiplies cos and sin (so q and k) after rotation; 1.0 = none
    max_positions: int  # positions served exactly; 0 = no limit beyond max_position_embeddings


def _base_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))  # [Dh/2]


def _divisors(head_dim: int, theta: float, inv_freq: np.ndarray) -> tuple[float, ...]:
    return tuple(float(x) for x in _base_inv_freq(head_dim, theta) / inv_freq)


def llama3_freq_factors(
    head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float, original_context: int
) -> tuple[float, ...]:
    """Divisors for rope_type "llama3" (Llama 3.1/3.2), computed as llama.cpp's converter writes its
    rope_freqs tensor: long wavelengths slowed by `factor`, short ones kept, the band between interpolated."""
    factors = []
    for freq in 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < original_context / high_freq_factor:
            factors.append(1.0)
        elif wavelen > original_context / low_freq_factor:
            factors.append(float(factor))
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def _yarn(rope: dict, head_dim: int, theta: float, max_positions: int) -> RopeScaling:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between (in
    dimension index, from the rotations beta_fast/beta_slow make over the original context), and
    cos/sin scaled by the paper's mscale."""
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or max_positions / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = rope.get("attention_factor")
    if attn is None:
        attn = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else get_mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rope.get("beta_fast") or 32), correction_dim(rope.get("beta_slow") or 1)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / ((high - low) or 0.001), 0, 1)
    base = _base_inv_freq(head_dim, theta)
    inv_freq = base / factor * ramp + base * (1 - ramp)
    return RopeScaling(_divisors(head_dim, theta, inv_freq), float(attn), 0)


def longrope(
    short: tuple[float, ...], long: tuple[float, ...], attn: float, original: int, context: int
) -> RopeScaling:
    """LongRoPE's one set of frequencies for a context served: transformers switches every position to
    the long factors once a forward's sequence passes the original context (keys already cached with the
    short ones included), llama.cpp once the context it serves does. So a context past the original gets
    the long factors at every position (llama.cpp's choice), one within it the short ones, capped there."""
    if context > original:
        return RopeScaling(long, attn, 0)
    return RopeScaling(short, attn, original)


def _longrope(rope: dict, head_dim: int, max_positions: int, original: int) -> RopeScaling:
    """LongRoPE (Phi-3.5, Phi-4-mini) from config.json: served within the original context (short
    factors), where transformers' frequencies are fixed whatever the sequence length."""
    factor = rope.get("factor") or max_positions / original
    attn = rope.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = (tuple(float(x) for x in rope[key]) for key in ("short_factor", "long_factor"))
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != head_dim // 2:
            raise ImportFormatError(f"longrope {name} has {len(factors)} entries, not head_dim/2 = {head_dim // 2}")
    return longrope(short, long, float(attn), original, original)


def rope_scaling(kind: str, rope: dict, head_dim: int, theta: float, max_positions: int) -> RopeScaling:
    """One RoPE parameter dict (config.json's rope_scaling / rope_parameters) of type `kind`."""
    if kind == "default":
        return RopeScaling((), 1.0, 0)
    if kind == "linear":
        return RopeScaling((float(rope["factor"]),) * (head_dim // 2), 1.0, 0)
    if kind == "dynamic":
        # transformers' dynamic NTK frequencies are the default ones until the sequence passes
        # max_position_embeddings (the context this server caps at); past it they change with the length.
        return RopeScaling((), 1.0, max_positions)
    if kind == "yarn":
        return _yarn(rope, head_dim, theta, max_positions)
    if kind == "longrope":
        return _longrope(rope, head_dim, max_positions, int(rope["original_max_position_embeddings"]))
    if kind == "llama3":
        args = (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"])
        original = int(rope["original_max_position_embeddings"])
        return RopeScaling(llama3_freq_factors(head_dim, theta, *map(float, args), original), 1.0, 0)
    raise ImportFormatError(f"rope_type {kind!r} is not supported (supported: {', '.join(SUPPORTED)})")
