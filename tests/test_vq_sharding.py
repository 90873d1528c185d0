"""The Transformer-VQ decoder sharded on a 2x4 mesh of 8 simulated CPU devices (slots on "data", heads on
"model") equals 1x1."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import REPO, tiny_vq_config

from hkserve.model.build import param_shapes
from hkserve.model.sharding import memory_shardings, param_specs, parse_mesh


@pytest.mark.timeout(900)  # the worker's own limit is 600 s
def test_vq_decoder_sharded_2x4_equals_single_device(tmp_path):
    out = tmp_path / "vq.npz"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "vq_sharded_worker.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    results = dict(np.load(out))
    keys = [k.split("/", 1)[1] for k in results if k.startswith("1x1/")]
    assert {"logits0", "logits6", "n", "u_mean"} <= set(keys)
    for key in keys:
        want, got = results[f"1x1/{key}"], results[f"2x4/{key}"]
        if want.dtype.kind in "iu" or key == "n":  # codes, steps and counts agree exactly
            np.testing.assert_array_equal(got, want, err_msg=key)
        else:
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=key)


def test_vq_heads_shard_on_model_only_when_divisible():
    import jax
    from jax.sharding import PartitionSpec as P

    fake = jax.sharding.Mesh(np.asarray(jax.devices()[:1] * 4).reshape(1, 4), ("data", "model"))
    for heads, split in ((4, "model"), (2, None)):
        config = tiny_vq_config(n_heads=heads, n_kv_heads=heads)
        specs = param_specs(param_shapes(config), fake, config)
        assert specs["decoder/layers/gau/q_proj"]["w"] == P(None, None, split)
        assert specs["decoder/layers/gau/o_proj"]["w"] == P(None, split, None)
        assert specs["decoder/layers/gau/codebook"]["c_sum"] == P(None, split, None, None)
        assert specs["decoder/layers/gau/kvg_proj"]["w"] == P(None, None, None)
        assert memory_shardings(config, fake).u_mean.spec == P(None, "data", split, None, None)
    assert param_specs(param_shapes(config), parse_mesh("1x1"), config)  # every VQ param has a rule
