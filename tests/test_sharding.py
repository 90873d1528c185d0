"""Sharded equals single-device: meshes 1x8, 2x4 and 8x1 of 8 simulated CPU devices against 1x1."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, require_fixtures, tiny_config

from hkserve.model.build import param_shapes
from hkserve.model.sharding import param_specs, parse_mesh

MESHES = ["1x8", "2x4", "8x1"]


def run_worker(*args: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "sharded_worker.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(np.load(args[1]))


def assert_meshes_agree(results: dict, meshes: list[str] = MESHES, reference: str = "1x1") -> None:
    for mesh in meshes:
        want = results[f"{reference}/tokens"], results[f"{reference}/logits"]
        np.testing.assert_array_equal(results[f"{mesh}/tokens"], want[0], err_msg=mesh)
        np.testing.assert_allclose(results[f"{mesh}/logits"], want[1], atol=1e-4, rtol=0, err_msg=mesh)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """The tiny model's runs of the three tests below, in one worker process (one JAX start; the 1x1
    scan run is the reference of all three)."""
    return run_worker("tiny", str(tmp_path_factory.mktemp("sharding") / "tiny.npz"))


@pytest.mark.timeout(1500)  # sets up `tiny`; the worker's own limit is 1200 s
def test_tiny_model_on_every_mesh_equals_single_device(tiny):
    assert_meshes_agree(tiny)


@pytest.mark.timeout(1500)
def test_the_layer_loop_on_two_meshes_equals_single_device_and_the_scan(tiny):
    """The GPU default (hkserve/model/layer_loop.py): per-layer weights sharded by their stacks' rules."""
    assert_meshes_agree(tiny, ["loop-1x8", "loop-2x4", "1x1"], reference="loop-1x1")


@pytest.mark.timeout(1500)
def test_the_paged_kv_layout_on_two_meshes_equals_single_device_and_the_static_layout(tiny):
    """Blocks sharded on the model axis like the static memory; on 2x4 each data shard's slots take
    only that shard's blocks (engine/block_pool.py). Speculating on 2x4 with a pool of one request per
    data shard: each shard preempts on its own, and the greedy tokens stay the single device's."""
    assert_meshes_agree(tiny, ["1x8", "2x4", "static-1x1", "spec-small-2x4"])
    assert tiny["2x4/preemptions"] == 0 and tiny["spec-small-2x4/preemptions"] > 0


@pytest.mark.slow  # ~120 s; the tiny model's meshes above run in the default suite
@pytest.mark.timeout(1500)  # the worker's own limit is 1200 s
def test_smollm2_golden_cases_on_every_mesh_equal_single_device_and_reference(tmp_path, smollm2_home, golden):
    results = run_worker(
        "smollm2", str(tmp_path / "smollm2.npz"), str(smollm2_home), str(require_fixtures() / "smollm2_golden.json")
    )
    assert_meshes_agree(results)
    for row, case in enumerate(golden["cases"]):
        got = [t for t in results["1x1/tokens"][row].tolist() if t >= 0]
        assert got == case["greedy_ids"], case["name"]


def test_every_param_has_a_rule_and_non_dividing_heads_are_replicated():
    import jax

    config = tiny_config(n_heads=9, n_kv_heads=3, head_dim=16, ffn_dim=128)
    mesh = parse_mesh("1x1")
    specs = param_specs(param_shapes(config), mesh, config)
    assert set(specs) == set(param_shapes(config))
    devices = np.asarray(jax.devices()[:1] * 4).reshape(1, 4)  # a 1x4 mesh shape, for spec fitting only
    fake = jax.sharding.Mesh(devices, ("data", "model"))
    specs = param_specs(param_shapes(config), fake, config)
    assert specs["decoder/layers/attention/q_proj"]["w"] == jax.sharding.PartitionSpec(None, None, None)
    assert specs["decoder/layers/mlp/up_proj"]["w"] == jax.sharding.PartitionSpec(None, None, "model")
    assert specs["decoder/embed"]["embeddings"] == jax.sharding.PartitionSpec("model", None)


def test_a_param_without_rule_is_an_error_naming_it():
    import jax

    shapes = {"decoder/mystery": {"w": jax.ShapeDtypeStruct((4, 4), np.float32)}}
    with pytest.raises(ValueError, match="decoder/mystery/w"):
        param_specs(shapes, parse_mesh("1x1"), tiny_config())
