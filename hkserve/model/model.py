"""The interface every decoder (KV or Transformer-VQ) offers the engine, the importers and training."""

from __future__ import annotations

from typing import NamedTuple

from hkserve.kernels.dispatch import KernelSpec
from hkserve.model.config import ModelConfig


class Model(NamedTuple):
    """Pure functions of one config. `forward` is not jitted here: callers jit with their shardings."""

    config: ModelConfig
    init: callable  # (rng) -> params
    forward: callable  # (params, tokens [b,T], memory, lengths [b], slots=None, attend_len=S, last_only=False)
    prepare: callable | None = None  # params -> what serving derives once from them (VQ keys, packed int8); None: as is
    kernels: KernelSpec | None = None  # the CPU kernels it runs (kernels/dispatch.py); the sampler reads it too
