"""Assemble importer output into the decoder's Haiku param tree, checking every name and shape.

Importers speak one neutral layout, independent of the file format: a stream of
(key, layer index or None, array), with the keys
  top level (layer None): "embed": [V, D], "final_norm": [D], "lm_head": [D, V] (untied only);
  per layer: "q_proj": [D, H*Dh], "k_proj", "v_proj", "o_proj": [H*Dh, D],
    optional "q_bias": [H*Dh], "k_bias", "v_bias": [Hkv*Dh], "o_bias": [D], "sinks": [H],
    "q_norm", "k_norm": [Dh] (with qk_norm_full: [H*Dh], [Hkv*Dh]),
    "attn_norm", "mlp_norm": [D] (unless pre_norms=False), "post_attn_norm", "post_mlp_norm": [D],
    "gate_proj": [D, F], "up_proj", "down_proj": [F, D]
    or (MoE) "router": [D, E], "expert_gate": [E, D, F], "expert_up", "expert_down": [E, F, D],
    with a shared expert also "shared_gate_proj": [D, Fs], "shared_up_proj", "shared_down_proj": [Fs, D],
    "shared_expert_gate": [D, 1]; with moe_biases "router_bias": [E], "expert_gate_bias",
    "expert_up_bias": [E, F], "expert_down_bias": [E, D].
Linear weights are [in, out]; importers transpose from the [out, in] convention of HF and GGUF.
"""

from __future__ import annotations

from collections.abc import Iterable

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
    "o_bias": ("decoder/layers/attention/o_proj", "b"),
    "sinks": ("decoder/layers/attention", "sinks"),
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
    "router_bias": ("decoder/layers/moe/router", "b"),
    "expert_gate_bias": ("decoder/layers/moe", "gate_bias"),
    "expert_up_bias": ("decoder/layers/moe", "up_bias"),
    "expert_down_bias": ("decoder/layers/moe", "down_bias"),
    "shared_gate_proj": ("decoder/layers/moe/shared_expert/gate_proj", "w"),
    "shared_up_proj": ("decoder/layers/moe/shared_expert/up_proj", "w"),
    "shared_down_proj": ("decoder/layers/moe/shared_expert/down_proj", "w"),
    "shared_expert_gate": ("decoder/layers/moe/shared_gate", "w"),
}
_TOP_PATHS = {
    "embed": ("decoder/embed", "embeddings"),
    "final_norm": ("decoder/final_norm", "scale"),
    "lm_head": ("decoder/lm_head", "w"),
}


def assemble_params(config: ModelConfig, tensors: Iterable[tuple[str, int | None, np.ndarray]]) -> dict:
    """(key, layer index or None, array) in the neutral layout → {module: {name: np.ndarray}} in the
    param dtypes; errors name the tensor.

    Every param is allocated once, at its final shape and dtype ([L, ...] for the layer stacks), and
    each tensor is copied (cast, transposed as the importer's view says) into its place as it arrives:
    the importer can drop it right after, so converting holds the model once, plus the tensor in hand.
    """
    expected = param_shapes(config)
    params = {
        module: {name: np.empty(s.shape, s.dtype) for name, s in names.items()} for module, names in expected.items()
    }
    filled: dict[tuple[str, str], set] = {}
    for key, layer, value in tensors:
        paths = _TOP_PATHS if layer is None else _LAYER_PATHS
        label = key if layer is None else f"layers.{layer}.{key}"
        if key not in paths or paths[key][1] not in expected.get(paths[key][0], {}):
            raise ImportFormatError(f"tensor {label} has no place in this config")
        module, name = paths[key]
        target = params[module][name]
        if layer is not None:
            if not 0 <= layer < config.n_layers:
                raise ImportFormatError(f"found layer {layer}, config says {config.n_layers} layers")
            target = target[layer]
        if value.shape != target.shape:
            raise ImportFormatError(f"tensor {label}: shape {tuple(value.shape)}, expected {target.shape}")
        target[...] = value
        filled.setdefault((module, name), set()).add(layer)

    for module, names in expected.items():
        for name in names:
            have = filled.get((module, name))
            if not have:
                raise ImportFormatError(f"checkpoint lacks {module}/{name}")
            if None not in have and len(have) < config.n_layers:
                first = min(set(range(config.n_layers)) - have)
                raise ImportFormatError(f"layer {first} lacks tensor {module}/{name}")
    return params
