"""grok-1's architecture against grok-1's own model.py outputs (../shared/fixtures/grok)."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from grok_worker import grok_logits
from helpers import REPO, load_grok_npz, require_fixtures

from hkserve.model.build import build_model
from hkserve.model.config import grok_config

ATOL = 3e-5  # the fixture README's tolerance: catches every deviation it lists


@pytest.fixture(scope="module")
def fixture():
    path = require_fixtures() / "grok" / "grok_tiny_reference.npz"
    config, params = load_grok_npz(path)
    data = np.load(path)
    return path, config, params, data


def logits_for(config, params, data):
    return grok_logits(build_model(config), params, data["tokens"], 7)


def test_full_and_cached_logits_match_grok(fixture):
    _, config, params, data = fixture
    assert config == grok_config(context_length=16)
    full, cached = logits_for(config, params, data)
    np.testing.assert_allclose(full, data["logits_full"], atol=ATOL, rtol=0)
    np.testing.assert_allclose(cached, data["logits_cached"], atol=ATOL, rtol=0)


def test_only_used_experts_computed_equals_all_experts(fixture):
    _, config, params, data = fixture
    selective, _ = logits_for(config, params, data)
    dense, _ = logits_for(config.replace(moe_dense=True), params, data)
    np.testing.assert_allclose(selective, dense, atol=1e-5, rtol=0)


@pytest.mark.timeout(900)  # the worker's own limit is 600 s
def test_sharded_meshes_match_grok(fixture, tmp_path):
    path, _, _, data = fixture
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(REPO)}
    out = tmp_path / "grok.npz"
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "grok_worker.py"), str(path), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = np.load(out)
    for mesh in ("1x1", "1x8", "2x4"):
        np.testing.assert_allclose(results[f"{mesh}/full"], data["logits_full"], atol=ATOL, rtol=0, err_msg=mesh)
        np.testing.assert_allclose(results[f"{mesh}/cached"], data["logits_cached"], atol=ATOL, rtol=0, err_msg=mesh)


def _permute_heads(params, layer_fn):
    out = jax.tree_util.tree_map(np.array, params)
    attn = "decoder/layers/attention/"
    for name in ("q_proj", "k_proj", "o_proj"):
        out[attn + name]["w"] = layer_fn(name, out[attn + name]["w"])
    return out


def _interleaved_rope(name, w):
    """Columns permuted so our rotate-half RoPE acts like an interleaved-pairs RoPE."""
    if name == "o_proj":
        return w
    heads = w.shape[-1] // 16
    w = w.reshape(w.shape[0], w.shape[1], heads, 2, 8).swapaxes(3, 4)  # pairs (i, i+8) → adjacent
    return w.reshape(w.shape[0], w.shape[1], heads * 16)


def _kv_head_is_h_mod_2(name, w):
    """Query heads reordered so query head h reads kv head h % 2 instead of h // 2."""
    order = [0, 2, 1, 3]
    if name == "q_proj":
        return w.reshape(w.shape[0], w.shape[1], 4, 16)[:, :, order].reshape(w.shape)
    if name == "o_proj":
        return w.reshape(w.shape[0], 4, 16, w.shape[-1])[:, order].reshape(w.shape)
    return w


SENSITIVITIES = {
    "no post-norms (sandwich)": dict(sandwich_norms=False),
    "no embedding multiplier": dict(embedding_multiplier=1.0),
    "no output multiplier": dict(output_multiplier=1.0),
    "no soft cap": dict(attn_logit_cap=0.0),
    "exact erf gelu": dict(moe_activation="gelu_exact"),
    "RMSNorm eps 1e-6": dict(norm_eps=1e-6),
    "renormalized top-2 gates (Mixtral routing)": dict(moe_routing="mixtral"),
}


@pytest.mark.parametrize("name", list(SENSITIVITIES))
def test_each_config_feature_is_needed(fixture, name):
    _, config, params, data = fixture
    full, _ = logits_for(config.replace(**SENSITIVITIES[name]), params, data)
    assert np.abs(full - data["logits_full"]).max() > ATOL, name


@pytest.mark.parametrize("layout", [_interleaved_rope, _kv_head_is_h_mod_2])
def test_rotary_layout_and_kv_grouping_are_grok_s(fixture, layout):
    _, config, params, data = fixture
    full, _ = logits_for(config, _permute_heads(params, layout), data)
    assert np.abs(full - data["logits_full"]).max() > ATOL
