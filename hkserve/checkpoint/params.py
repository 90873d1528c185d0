"""Assemble importer output into the decoder's Haiku param tree, checking every name and shape.

Importers speak one neutral layout, independent of the file format:
  {"embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only),
   "layers": [ {"attn_norm": [D], "q_proj": [D, H*Dh], "k_proj", "v_proj", "o_proj": [H*Dh, D],
                optional "q_bias": [H*Dh], "k_bias", "v_bias": [Hkv*Dh], "q_norm", "k_norm": [Dh],
                "post_attn_norm", "post_mlp_norm": [D],
                "mlp_norm": [D], "gate_proj": [D, F], "up_proj", "down_proj": [F, D]
                or (MoE) "router": [D, E], "expert_gate": [E, D, F], "expert_up", "expert_down": [E, F, D]}
     per layer ]}
Linear weights are [in, out]; importers transpose from the [out, in] convention of HF and GGUF.
"""

from __future__ import annotations

import jax
import numpy as np

from hkserve.model.build import param_shapes
from hkserve.model.config import ModelConfig


class ImportFormatError(ValueError):
    """A checkpoint that cannot be imported: bad file, unsupported architecture, missing tensors."""


_LAYER_PATHS = {
    "attn_norm": ("decoder/layers/attn_norm", "scale"),
    "q_proj": ("decoder/layers/attention/q_proj", "w"),
    "k_proj": ("decoder/layers/attention/k_proj", "w"),
    "v_proj": ("decoder/layers/attention/v_proj", "w"),
    "o_proj": ("decoder/layers/attention/o_proj", "w"),
    "q_bias": ("decoder/layers/attention/q_proj", "b"),
    "k_bias": ("decoder/layers/attention/k_proj", "b"),
    "v_bias": ("decoder/layers/attention/v_proj", "b"),
    "q_norm": ("decoder/layers/attention/q_norm", "scale"),
    "k_norm": ("decoder/layers/attention/k_norm", "scale"),
    "mlp_norm": ("decoder/layers/mlp_norm", "scale"),
    "post_attn_norm": ("decoder/layers/post_attn_norm", "scale"),
    "post_mlp_norm": ("decoder/layers/post_mlp_norm", "scale"),
    "gate_proj": ("decoder/layers/mlp/gate_proj", "w"),
    "up_proj": ("decoder/layers/mlp/up_proj", "w"),
    "down_proj": ("decoder/layers/mlp/down_proj", "w"),
    "router": ("decoder/layers/moe/router", "w"),
    "expert_gate": ("decoder/layers/moe", "gate_proj"),
    "expert_up": ("decoder/layers/moe", "up_proj"),
    "expert_down": ("decoder/layers/moe", "down_proj"),
}
_TOP_PATHS = {
    "embed": ("decoder/embed", "embeddings"),
    "final_norm": ("decoder/final_norm", "scale"),
    "lm_head": ("decoder/lm_head", "w"),
}


def assemble_params(config: ModelConfig, tensors: dict) -> dict:
    """Neutral layout → {module: {name: np.ndarray}} in the config's dtype; errors name the tensor."""
    expected = param_shapes(config)
    dtype = np.dtype(jax.numpy.dtype(config.dtype))
    params: dict = {}

    def put(path: tuple[str, str], value: np.ndarray, label: str):
        module, name = path
        spec = expected.get(module, {}).get(name)
        if spec is None:
            raise ImportFormatError(f"tensor {label} has no place in this config")
        if tuple(value.shape) != tuple(spec.shape):
            raise ImportFormatError(f"tensor {label}: shape {tuple(value.shape)}, expected {tuple(spec.shape)}")
        params.setdefault(module, {})[name] = np.ascontiguousarray(value).astype(dtype, copy=False)

    for key, value in tensors.items():
        if key != "layers":
            put(_TOP_PATHS[key], np.asarray(value), key)
    layers = tensors.get("layers", [])
    if len(layers) != config.n_layers:
        raise ImportFormatError(f"found {len(layers)} layers, config says {config.n_layers}")
    for key in layers[0] if layers else ():
        missing = [i for i, layer in enumerate(layers) if key not in layer]
        if missing:
            raise ImportFormatError(f"layer {missing[0]} lacks tensor {key}")
        put(_LAYER_PATHS[key], np.stack([np.asarray(layer[key]) for layer in layers]), f"layers.*.{key}")

    for module, names in expected.items():
        for name in names:
            if name not in params.get(module, {}):
                raise ImportFormatError(f"checkpoint lacks {module}/{name}")
    return params
