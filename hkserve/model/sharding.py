"""Device mesh ("data", "model") and the partition rules that lay params and memory out on it.

Parallelism is a table: each param path regex maps to the PartitionSpec it wants. A param that no
rule matches is an error naming it. A dim is sharded on "model" only when the axis size divides it;
otherwise that dim is replicated — e.g. SmolLM2's 9 query / 3 kv heads do not divide a 2-, 4- or
8-way model axis, so its attention is replicated while its MLP (1536) and vocabulary (49152) are
sharded. Tensor-parallel attention then needs heads divisible by the model axis.

Memory: slots on "data"; kv heads on "model" when divisible (matching the k/v projections), else
replicated.

Transformer-VQ (memory="vq", params stacked over G = 2 * n_layers GAUs): q/r projections, u, v',
the output projection, the codebook and the VQ memory split by heads on "model" when divisible. The
fused k|v|g projection is replicated: its columns are [all k | all v | all g], so an even split of them
does not follow heads. The output bias follows the vocabulary.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hkserve.model import layer_loop
from hkserve.model.config import ModelConfig
from hkserve.model.int4 import is_int5_sym, is_int8_sym
from hkserve.model.memory import KVMemory
from hkserve.model.paged_memory import PagedKVMemory
from hkserve.model.vq_memory import VQMemory

# (path regex, spec, unit) — the spec lists one entry per dim; "model" = shard that dim when the
# axis divides `unit` (a config field: whole heads only), or the dim itself when unit is None.
# Stacked layer params carry a leading [L] dim (never sharded); one layer's weight
# of the layer loop ("decoder/layer_i/...", layer_loop.py) follows its stack's rule without it.
PARAM_RULES: list[tuple[str, P, str | None]] = [
    (r"decoder/embed/embeddings$", P("model", None), None),  # [V, D]: vocab-parallel
    (r"decoder/lm_head/w$", P(None, "model"), None),  # [D, V]
    (r"decoder/final_norm/scale$", P(None), None),
    (r"decoder/layers/(post_)?(attn_norm|mlp_norm)/scale$", P(None, None), None),
    (r"decoder/layers/attention/q_proj/w$", P(None, None, "model"), "n_heads"),  # [L, D, H*Dh]
    (r"decoder/layers/attention/(k_proj|v_proj)/w$", P(None, None, "model"), "n_kv_heads"),  # [L, D, Hkv*Dh]
    (r"decoder/layers/attention/o_proj/w$", P(None, "model", None), "n_heads"),  # [L, H*Dh, D]
    (r"decoder/layers/attention/q_proj/b$", P(None, "model"), "n_heads"),  # [L, H*Dh]
    (r"decoder/layers/attention/(k_proj|v_proj)/b$", P(None, "model"), "n_kv_heads"),  # [L, Hkv*Dh]
    (r"decoder/layers/attention/(q_norm|k_norm)/scale$", P(None, None), None),  # [L, Dh] or [L, H*Dh]
    (r"decoder/layers/attention/(o_proj/b|sinks)$", P(None, None), None),  # [L, D], [L, H] (gpt-oss)
    (r"decoder/layers/mlp/(gate_proj|up_proj)/w$", P(None, None, "model"), None),  # [L, D, F]
    (r"decoder/layers/mlp/down_proj/w$", P(None, "model", None), None),  # [L, F, D]
    (r"decoder/layers/moe/router/w$", P(None, None, None), None),  # [L, D, E]
    (r"decoder/layers/moe/(gate_proj|up_proj)$", P(None, None, None, "model"), None),  # [L, E, D, F]
    (r"decoder/layers/moe/down_proj$", P(None, None, "model", None), None),  # [L, E, F, D]
    (r"decoder/layers/moe/router/b$", P(None, None), None),  # [L, E] (gpt-oss's biases)
    (r"decoder/layers/moe/(gate_bias|up_bias)$", P(None, None, "model"), None),  # [L, E, F], as gate_proj's F
    (r"decoder/layers/moe/down_bias$", P(None, None, None), None),  # [L, E, D]
    (r"decoder/layers/moe/shared_expert/(gate_proj|up_proj)/w$", P(None, None, "model"), None),  # [L, D, Fs]
    (r"decoder/layers/moe/shared_expert/down_proj/w$", P(None, "model", None), None),  # [L, Fs, D]
    (r"decoder/layers/moe/shared_gate/w$", P(None, None, None), None),  # [L, D, 1]
    # int8 weights' per-output-channel scales follow their weight's output dim
    (r"decoder/embed/scale$", P("model"), None),  # [V]
    (r"decoder/lm_head/scale$", P("model"), None),  # [V]
    (r"decoder/layers/attention/q_proj/scale$", P(None, "model"), "n_heads"),  # [L, H*Dh]
    (r"decoder/layers/attention/(k_proj|v_proj)/scale$", P(None, "model"), "n_kv_heads"),
    (
        r"decoder/layers/(attention/o_proj|(mlp|moe/shared_expert)/down_proj|moe/router|moe/shared_gate)/scale$",
        P(None, None),
        None,
    ),  # [L, D|E|1]
    (r"decoder/layers/(mlp|moe/shared_expert)/(gate_proj|up_proj)/scale$", P(None, "model"), None),  # [L, F]
    (r"decoder/layers/moe/(gate_proj|up_proj)_scale$", P(None, None, "model"), None),  # [L, E, F]
    (r"decoder/layers/moe/down_proj_scale$", P(None, None, None), None),  # [L, E, D]
    # the CPU kernels' fused projections (model/packing.py), on a 1x1 mesh: replicated
    (r"decoder/layers/(attention/qkv_proj|(mlp|moe/shared_expert)/gate_up_proj)/scale$", P(None, None), None),
    # Transformer-VQ
    (r"decoder/out_bias/b$", P("model"), None),  # [V]
    (r"decoder/layers/gau/input_norm/(scale|bias)$", P(None, None), None),  # [G, D]
    (r"decoder/layers/gau/(q_proj|r_proj)/w$", P(None, None, "model"), "n_heads"),  # [G, D, H*dk]
    (r"decoder/layers/gau/kvg_proj/w$", P(None, None, None), None),  # [G, D, H*(dk+2dv)]
    (r"decoder/layers/gau/o_proj/w$", P(None, "model", None), "n_heads"),  # [G, H*dv, D]
    (r"decoder/layers/gau/(xl_u|xl_v)$", P(None, "model"), "n_heads"),  # [G, H*dk]
    (r"decoder/layers/gau/codebook/c_sum$", P(None, "model", None, None), "n_heads"),  # [G, H, S, dk]
    (r"decoder/layers/gau/codebook/c_count$", P(None, "model", None), "n_heads"),  # [G, H, S]
    (r"decoder/layers/gau/position_keys/r$", P(None, "model", None, None), "n_heads"),  # [G, H, M+1, dk]
    (r"decoder/layers/gau/(q_proj|r_proj)/scale$", P(None, "model"), "n_heads"),  # [G, H*dk]
    (r"decoder/layers/gau/(kvg_proj|o_proj)/scale$", P(None, None), None),  # [G, H*(dk+2dv)] | [G, D]
]


def parse_mesh(text: str | None, config: ModelConfig | None = None, devices=None) -> Mesh:
    """ "DxM" → a ("data", "model") mesh. Default: every device on "model" when that divides the
    attention heads, else all on "data"."""
    devices = list(devices if devices is not None else jax.devices())
    n = len(devices)
    if text:
        try:
            data, model = (int(x) for x in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"--mesh must look like DATAxMODEL (e.g. 2x4), got {text!r}") from None
        if data * model != n:
            raise ValueError(f"mesh {data}x{model} needs {data * model} devices, {n} available")
    elif config is None or (config.n_heads % n == 0 and config.n_kv_heads % n == 0):
        data, model = 1, n
    else:
        data, model = n, 1
    return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


def _fit(spec: P, shape: tuple[int, ...], mesh: Mesh, units: int | None) -> P:
    """Replicate the dims whose size (or unit count) the mesh axis does not divide."""
    if len(spec) != len(shape):
        raise ValueError(f"partition spec {spec} does not fit shape {shape}")
    return P(*(a if a is None or (units or shape[i]) % mesh.shape[a] == 0 else None for i, a in enumerate(spec)))


def param_specs(params_shapes: dict, mesh: Mesh, config: ModelConfig) -> dict:
    """{module: {name: PartitionSpec}} for a Haiku param tree (arrays or ShapeDtypeStructs)."""
    specs: dict = {}
    for module, names in params_shapes.items():
        for name, leaf in names.items():
            path = f"{module}/{name}"
            # packed for the CPU kernels, which run on a 1x1 mesh, or an int4 weight with its group scales and
            # mins, or signed 8-bit or 5-bit groups (model/int4.py; not sharded yet): replicated
            if leaf.dtype == np.uint8 or "min" in names or is_int8_sym(names) or is_int5_sym(names):
                specs.setdefault(module, {})[name] = P(*([None] * len(leaf.shape)))
                continue
            stacked = layer_loop.stacked_path(path)  # one layer's weight follows its stack's rule
            rule = next((r for r in PARAM_RULES if re.search(r[0], stacked or path)), None)
            if rule is None:
                raise ValueError(f"no partition rule matches param {path!r}")
            units = getattr(config, rule[2]) if rule[2] else None
            shape = (1, *leaf.shape) if stacked else tuple(leaf.shape)
            spec = _fit(rule[1], shape, mesh, units)
            specs.setdefault(module, {})[name] = P(*spec[1:]) if stacked else spec
    return specs


def param_shardings(params_shapes: dict, mesh: Mesh, config: ModelConfig) -> dict:
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), param_specs(params_shapes, mesh, config), is_leaf=lambda x: isinstance(x, P)
    )


def memory_spec(config: ModelConfig, mesh: Mesh) -> P:
    """Spec of K and V [L, B, S, Hkv, Dh] (a paged pool's [L, NB, bs, Hkv, Dh] alike)."""
    heads = "model" if config.n_kv_heads % mesh.shape["model"] == 0 else None
    return P(None, "data", None, heads, None)


def memory_shardings(config: ModelConfig, mesh: Mesh, layout: str = "static"):
    """KVMemory of NamedShardings: k, v per `memory_spec`, step [B] on "data". For memory="vq" a
    VQMemory: slots on "data", heads on "model" when divisible. For layout "paged" a PagedKVMemory:
    the pool's blocks [L, NB, bs, Hkv, Dh] on "data" (each data shard its own blocks, for its own
    slots: engine/block_pool.py), heads as the static memory's, and the table's rows on "data"."""
    if config.memory == "vq":
        heads = "model" if config.n_heads % mesh.shape["model"] == 0 else None
        per_code = NamedSharding(mesh, P(None, "data", heads, None))  # z_win [G,B,H,M], n [G,B,H,S]
        per_value = NamedSharding(mesh, P(None, "data", heads, None, None))  # v_win, u_mean [G,B,H,*,dv]
        return VQMemory(NamedSharding(mesh, P("data")), per_code, per_value, per_code, per_value)
    kv = NamedSharding(mesh, memory_spec(config, mesh))
    if layout == "paged":
        return PagedKVMemory(kv, kv, NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data", None)))
    return KVMemory(kv, kv, NamedSharding(mesh, P("data")))


def check_slots(slots: int, mesh: Mesh) -> None:
    if slots % mesh.shape["data"]:
        raise ValueError(f"{slots} slots do not divide over the data axis of size {mesh.shape['data']}")
