"""The RoPE scaling types and the families whose fixtures live in this repository (tests/fixtures/hf,
remade by scripts/make_family_fixtures.py) against the logits transformers computed: full forward,
the cached path (4-token prefill, then one token per step) and greedy decoding through the Engine."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from family_fixtures import LOCAL, full_logits, local_fixture
from test_families import engine_greedy, full_and_cached_logits

from hkserve.checkpoint.hf import load_hf
from hkserve.checkpoint.hf_config import config_from_hf
from hkserve.checkpoint.params import ImportFormatError
from hkserve.checkpoint.quantize import convert_params
from hkserve.kernels import dispatch
from hkserve.model.build import build_model, param_shapes
from hkserve.model.sharding import param_specs

TOL = 1e-4  # relative to the largest reference logit


@pytest.mark.parametrize("name", LOCAL)
def test_full_cached_and_engine_greedy_match_transformers(name):
    path = local_fixture(name)
    ref = json.loads((path / "reference.json").read_text())
    config, params = load_hf(path)
    model = build_model(config)
    ids = np.asarray(ref["input_ids"], np.int32)
    want = np.asarray(ref["logits"], np.float32)
    full, cached = full_and_cached_logits(model, params, ids)
    atol = TOL * np.abs(want).max()
    np.testing.assert_allclose(full, want, atol=atol, rtol=0, err_msg="full forward")
    np.testing.assert_allclose(cached, want, atol=atol, rtol=0, err_msg="cached path")
    assert engine_greedy(model, params, ref["greedy_prompt"], len(ref["greedy_ids"])) == ref["greedy_ids"]


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-gpt-oss"])
def test_cached_path_matches_transformers_cached_path(name):
    """Our 4-token prefill then one token per step against transformers' own (its KV cache), not only
    against its full forward: the fixtures made since scripts/make_family_fixtures.py records both."""
    path = local_fixture(name)
    ref = json.loads((path / "reference.json").read_text())
    config, params = load_hf(path)
    _, cached = full_and_cached_logits(build_model(config), params, np.asarray(ref["input_ids"], np.int32))
    want = np.asarray(ref["cached_logits"], np.float32)
    np.testing.assert_allclose(cached, want, atol=TOL * np.abs(want).max(), rtol=0)


@pytest.mark.parametrize("name", ["tiny-smollm3", "tiny-olmo2", "tiny-qwen2-moe", "tiny-gpt-oss"])
def test_layer_loop_and_sharding_rules_cover_the_new_options(name):
    """The layer loop (the GPU default) gets each layer's RoPE switch (SmolLM3), runs without pre-norms
    (OLMo 2), with the shared expert (Qwen2-MoE) and with sinks and biases (gpt-oss) as the scan does; every
    param, full-width q/k norms, the shared expert, sinks and expert biases included, has a partition rule."""
    path = local_fixture(name)
    ref = json.loads((path / "reference.json").read_text())
    config, params = load_hf(path)
    loop = build_model(config, layers="loop")
    ids = np.asarray(ref["input_ids"], np.int32)
    want = np.asarray(ref["logits"], np.float32)
    full, _ = full_and_cached_logits(loop, loop.prepare(params), ids)
    np.testing.assert_allclose(full, want, atol=TOL * np.abs(want).max(), rtol=0)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 4).reshape(2, 2), ("data", "model"))
    specs = param_specs(param_shapes(config), mesh, config)  # raises for a param without a rule
    assert set(specs) == set(param_shapes(config))
    if config.shared_expert_dim:  # split like a dense MLP, on its width
        shared = "decoder/layers/moe/shared_expert/"
        assert specs[shared + "up_proj"]["w"] == jax.sharding.PartitionSpec(None, None, "model")
        assert specs[shared + "down_proj"]["w"] == jax.sharding.PartitionSpec(None, "model", None)


@pytest.mark.parametrize(("name", "dtype"), [("tiny-qwen2-moe", "int8"), ("tiny-qwen2-moe", "bfloat16")])
def test_moe_weight_variants_keep_the_shared_expert(name, dtype):
    """int8 and bf16 variants quantize or cast the shared expert and its gate like the other weights; the
    int8 one also through the CPU kernels (the shared expert's gate|up fused and packed with the layer stack)."""
    path = local_fixture(name)
    ref = json.loads((path / "reference.json").read_text())
    config, params = load_hf(path)
    variant_config, variant = convert_params(params, config, dtype)
    shared = variant["decoder/layers/moe/shared_expert/gate_proj"]
    assert shared["w"].dtype == (np.int8 if dtype == "int8" else jnp.bfloat16)
    got = full_logits(build_model(variant_config), variant, ref["input_ids"])
    want = np.asarray(ref["logits"], np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * np.abs(want).max(), rtol=0)
    if dtype == "int8":
        kernels = dispatch.resolve("auto", "int8")
        assert kernels is not None
        model = build_model(variant_config, kernels, "scan")
        packed = model.prepare(variant)
        assert "decoder/layers/moe/shared_expert/gate_up_proj" in packed
        np.testing.assert_allclose(full_logits(model, packed, ref["input_ids"]), got, atol=1e-3 * np.abs(want).max())


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("tiny-qwen2-moe", {"qkv_bias": False}, "qkv_bias"),
        ("tiny-qwen3-moe", {"attention_bias": True}, "attention_bias"),
        ("tiny-qwen3-moe", {"shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
        ("tiny-qwen2-moe", {"router_type": "sigmoid"}, "router_type"),
        ("tiny-qwen2-moe", {"decoder_sparse_step": 2}, r"dense MLP layers \[0\]"),
        ("tiny-qwen3-moe", {"mlp_only_layers": [1]}, r"dense MLP layers \[1\]"),
    ],
)
def test_moe_fields_the_decoder_does_not_implement_are_refused(name, change, named):
    cfg = json.loads((local_fixture(name) / "config.json").read_text())
    with pytest.raises(ImportFormatError, match=named):
        config_from_hf(cfg | change)


def test_smollm3_nope_layers_default_to_every_fourth_and_bad_lists_are_refused():
    cfg = json.loads((local_fixture("tiny-smollm3") / "config.json").read_text())
    cfg = {k: v for k, v in cfg.items() if k not in ("no_rope_layers", "no_rope_layer_interval", "layer_types")}
    config = config_from_hf({**cfg, "num_hidden_layers": 8})
    assert config.rope_layers == (True, True, True, False) * 2
    assert config_from_hf({**cfg, "num_hidden_layers": 3}).rope_layers == ()  # RoPE on all three
    with pytest.raises(ImportFormatError, match="no_rope_layers"):
        config_from_hf({**cfg, "no_rope_layers": [1, 2]})
