"""Sharded equals single-device for the new families: Qwen2 (dense, q/k/v biases, bf16 weights), Gemma 3
(q/k norms, sliding windows, two RoPE bases), Qwen2-MoE (experts and the shared expert split on "model") and
gpt-oss (sinks, expert biases split with their experts) on meshes 1x8 and 2x4 of 8 simulated devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from family_fixtures import LOCAL, fixture, local_fixture
from helpers import REPO


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-gemma3", "tiny-qwen2-moe", "tiny-gpt-oss"])
def test_family_on_1x8_and_2x4_equals_single_device_and_reference(tmp_path, name):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(REPO)}
    out = tmp_path / "results.npz"
    worker = REPO / "tests" / "families_sharded_worker.py"
    path = local_fixture(name) if name in LOCAL else fixture("hf", name)
    result = subprocess.run(
        [sys.executable, str(worker), str(path), str(out)],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    results = dict(np.load(out))
    ref = json.loads((path / "reference.json").read_text())
    want = np.asarray(ref["logits"], np.float32).reshape(-1, np.shape(ref["logits"])[-1])  # [2 * 13, V]
    np.testing.assert_allclose(results["1x1/logits"], want, atol=1e-4, rtol=0)
    assert results["1x1/tokens"][0].tolist() == ref["greedy_ids"]
    for mesh in ("1x8", "2x4"):
        np.testing.assert_array_equal(results[f"{mesh}/tokens"], results["1x1/tokens"], err_msg=mesh)
        np.testing.assert_allclose(results[f"{mesh}/logits"], results["1x1/logits"], atol=1e-4, rtol=0, err_msg=mesh)
