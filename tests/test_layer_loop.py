"""The layer loop (the GPU default, hkserve/model/layer_loop.py) computes what the layer scan computes:
every HF fixture family against transformers' logits through the full and the cached path, the engine
on its unstacked params, and their partition rules on a 2x4 mesh (with the sharded run in
test_sharding.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from family_fixtures import fixture, reference
from helpers import init_params, tiny_config
from test_families import TOL, engine_greedy, full_and_cached_logits

from hkserve.checkpoint.hf import load_hf
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.model import layer_loop
from hkserve.model.build import build_model, param_shapes
from hkserve.model.sharding import param_specs, parse_mesh


@pytest.mark.parametrize("name", ["tiny-llama-untied", "tiny-mixtral", "tiny-qwen2", "tiny-gemma2", "tiny-gemma3"])
def test_loop_matches_transformers_and_the_scan(name):
    """Biases (Qwen2), MoE (Mixtral), sandwich norms, sliding layers with their own RoPE base and soft
    caps (Gemma 2/3): each layer's window and base reach its block in the loop as in the scan."""
    ref = reference(name)
    config, params = load_hf(fixture("hf", name))
    loop, scan = build_model(config, layers="loop"), build_model(config, layers="scan")
    ids = np.asarray(ref["input_ids"], np.int32)
    want = np.asarray(ref["logits"], np.float32)
    full, cached = full_and_cached_logits(loop, loop.prepare(params), ids)
    np.testing.assert_allclose(full, want, atol=TOL, rtol=0, err_msg="full forward")
    np.testing.assert_allclose(cached, want, atol=TOL, rtol=0, err_msg="cached path")
    scan_full, _ = full_and_cached_logits(scan, params, ids)
    np.testing.assert_allclose(full, scan_full, atol=1e-5, rtol=0)
    stacked_full, _ = full_and_cached_logits(loop, params, ids)  # forward unstacks stacked params itself
    np.testing.assert_allclose(stacked_full, full, atol=1e-6, rtol=0)  # another program (on a GPU: other fusions)
    assert engine_greedy(loop, params, ref["greedy_prompt"], len(ref["greedy_ids"])) == ref["greedy_ids"]


def test_engine_holds_one_array_per_layer_and_decodes_as_the_scan():
    config = tiny_config(vocab_size=96)
    scan = build_model(config, layers="scan")
    params = init_params(config, 3)
    engine = Engine(
        build_model(config, layers="loop"), params, EngineOptions(slots=2, max_len=64, prefill_buckets=(16,))
    )
    held = engine.params
    assert not any(m.startswith("decoder/layers/") for m in held)
    gate = [held[f"decoder/layer_{i}/mlp/gate_proj"]["w"] for i in range(config.n_layers)]
    assert all(w.shape == params["decoder/layers/mlp/gate_proj"]["w"].shape[1:] for w in gate)
    for i, w in enumerate(gate):
        np.testing.assert_array_equal(w, params["decoder/layers/mlp/gate_proj"]["w"][i])
    assert engine_greedy(engine.model, params, [5, 7, 11, 13], 10) == engine_greedy(scan, params, [5, 7, 11, 13], 10)


def test_each_layers_weight_follows_its_stacks_partition_rule():
    config = tiny_config(n_heads=8, n_kv_heads=4, head_dim=8, ffn_dim=128)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 8).reshape(2, 4), ("data", "model"))
    stacked = param_specs(param_shapes(config), mesh, config)
    shapes = jax.eval_shape(lambda p: layer_loop.unstack(p, config.n_layers), param_shapes(config))
    unstacked = param_specs(shapes, mesh, config)
    assert set(unstacked) == {
        m.replace("decoder/layers/", f"decoder/layer_{i}/") if m.startswith("decoder/layers/") else m
        for m in stacked
        for i in range(config.n_layers)
    }
    for module, names in unstacked.items():
        source = module if not module.startswith("decoder/layer_") else "decoder/layers/" + module.split("/", 2)[2]
        for name, spec in names.items():
            want = stacked[source][name]
            assert spec == (jax.sharding.PartitionSpec(*want[1:]) if source != module else want), (module, name)
    assert unstacked["decoder/layer_1/mlp/down_proj"]["w"] == jax.sharding.PartitionSpec("model", None)


def test_unknown_modes_and_the_kernels_are_refused():
    config = tiny_config()
    with pytest.raises(ValueError, match="layers must be one of"):
        build_model(config, layers="unrolled")
    from hkserve.kernels.dispatch import KernelSpec

    with pytest.raises(ValueError, match="stacked layer weights"):
        build_model(config, kernels=KernelSpec("w8a32", 1), layers="loop")
    param_specs(param_shapes(config), parse_mesh("1x1"), config)


@pytest.mark.parametrize(("backend", "mode"), [("cpu", "scan"), ("gpu", "loop"), ("tpu", "scan")])
def test_the_loop_is_the_default_on_gpus(monkeypatch, backend, mode):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert layer_loop.default_mode() == mode
    assert (build_model(tiny_config()).prepare is not None) == (mode == "loop")
