"""Smoke test of `bench engine` on a tiny checkpoint: it runs end to end and its JSON line is complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, hkserve, require_fixtures


def test_bench_engine_json_on_tiny_model(tmp_path):
    hkserve("convert", str(require_fixtures() / "hf" / "tiny-llama-tied"), "--name", "tiny", "--quiet", home=tmp_path)
    env = {**os.environ, "HKSERVE_HOME": str(tmp_path)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hkserve.cli.main",
            "bench",
            "engine",
            "--model",
            "tiny",
            "--slots",
            "1,2",
            "--steps",
            "3",
            "--hf-batches",
            "1",
            "--repeats",
            "1",
            "--bandwidth-mb",
            "256",
            "--json",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])

    assert set(report["hkserve"]) == {"1", "2"} and all(v > 0 for v in report["hkserve"].values())
    limits = report["limits"]
    for key in ("bandwidth_gb_s", "bandwidth_tok_s", "matmul_gflop_s", "compute_tok_s"):
        assert limits[key] > 0, key
    ratios = report["ratios"]
    assert ratios["hkserve_1_over_bandwidth_limit"] > 0 and ratios["hkserve_2_over_compute_limit"] > 0
    peer = report["hf_transformers"]  # None where torch/transformers are not installed (CI's '.[test]')
    if peer is None:
        assert ratios["hkserve_1_over_hf_1"] is None
    else:
        assert set(peer) == {"1"} and peer["1"] > 0
        assert ratios["hkserve_1_over_hf_1"] > 0
    assert "hkserve" in result.stdout.splitlines()[0]  # the human table comes first


@pytest.mark.slow  # int8 variant, kernel build in a fresh home, 2 x 2 engines: minutes on a busy machine
@pytest.mark.timeout(900)
def test_bench_engine_by_kernels_on_tiny_model(tmp_path):
    hkserve("convert", str(require_fixtures() / "hf" / "tiny-llama-tied"), "--name", "tiny", "--quiet", home=tmp_path)
    args = ["--model", "tiny", "--slots", "1,2", "--steps", "3", "--hf-batches", "1", "--repeats", "2"]
    args += ["--bandwidth-mb", "64", "--weights", "int8", "--kernels", "auto,xla", "--json"]
    result = hkserve("bench", "engine", *args, home=tmp_path, timeout=850)
    by_kernels = json.loads(result.stdout.strip().splitlines()[-1])["by_kernels"]
    for side in ("int8/auto", "int8/xla"):  # the kernels and XLA's dots, alternated
        assert set(by_kernels[side]) == {"1", "2"}, side
        for figure in by_kernels[side].values():
            assert figure["tok_s"] > 0 and figure["spread"] >= 1 and len(figure["runs"]) == 2
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert "not installed" in by_kernels["llama.cpp"]["skipped"]
    else:
        assert "--llama-gguf" in by_kernels["llama.cpp"]["skipped"]
