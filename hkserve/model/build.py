"""`build_model(config)`: the decoder a config asks for, and the shapes of its params."""

from __future__ import annotations

import functools

import jax

from hkserve.kernels.dispatch import KernelSpec
from hkserve.model.config import ModelConfig
from hkserve.model.model import Model
from hkserve.model.transformer import build_kv_model
from hkserve.model.vq_model import build_vq_model


def build_model(config: ModelConfig, kernels: KernelSpec | None = None, layers: str | None = None) -> Model:
    """The KV decoder (transformer.py) or, for memory="vq", Transformer-VQ's (vq_model.py). `kernels`
    (kernels/dispatch.py `resolve`) runs a KV decoder's decode attention and, for quantized weights, its
    int8/int4 products through the CPU kernels; `layers`
    "scan" or "loop" (layer_loop.py; None: the backend's default) how its blocks run."""
    if config.memory == "vq":
        if kernels is not None:
            raise ValueError("the CPU kernels serve KV-memory models only")
        return build_vq_model(config)
    return build_kv_model(config, kernels, layers)


@functools.cache
def param_shapes(config: ModelConfig) -> dict:
    """{module: {name: ShapeDtypeStruct}} of the params `build_model(config).init` creates."""
    return jax.eval_shape(build_model(config).init, jax.random.PRNGKey(0))
