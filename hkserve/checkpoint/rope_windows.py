"""Arithmetic both config readers share: Gemma-style sliding-layer patterns and Llama 3's RoPE
frequency factors."""

from __future__ import annotations

import math

import numpy as np


def sliding_by_pattern(n_layers: int, pattern: int) -> tuple[bool, ...]:
    """Every `pattern`-th layer (1-based) is full, the others slide (HF's sliding_window_pattern)."""
    return tuple((i + 1) % pattern != 0 for i in range(n_layers))


def llama3_freq_factors(
    head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float, original_context: int
) -> tuple[float, ...]:
    """Divisors of the RoPE frequencies for rope_type "llama3" (Llama 3.1/3.2), computed as llama.cpp's
    converter writes its rope_freqs tensor: long wavelengths slowed by `factor`, short ones kept, the
    band between interpolated."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    factors = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(float(factor))
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)
