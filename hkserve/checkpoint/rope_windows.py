"""Gemma-style sliding-layer patterns, which both config readers share."""

from __future__ import annotations


def sliding_by_pattern(n_layers: int, pattern: int) -> tuple[bool, ...]:
    """Every `pattern`-th layer (1-based) is full, the others slide (HF's sliding_window_pattern)."""
    return tuple((i + 1) % pattern != 0 for i in range(n_layers))
