"""scripts/device-check.sh cannot rot: its dry run (JAX on the CPU, toy sizes) goes through every stage of
the GPU run, with a tiny GGUF standing in for SmolLM2 through the same split, stash, join and convert."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from importlib import metadata

import tomllib
from helpers import REPO, SHARED, require_fixtures
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

STAGES = (
    "setup",
    "convert-smollm2",
    "golden-tests",
    "bench-llama-1b",
    "profile-llama-1b",
    "bench-smollm2",
    "paged-attention",
    "startup",
    "quant-weights",
)


def run(*args: str, env: dict) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert result.returncode == 0, (
        f"{args} exited {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-3000:]}"
    )
    return result


def test_dry_run_goes_through_every_stage_and_writes_the_json(tmp_path):
    gguf = require_fixtures() / "gguf" / "tiny-llama3-rope" / "tiny-llama3-rope.f32.gguf"
    dev, stash, out = tmp_path / "dev", tmp_path / "stash", tmp_path / "out"
    env = {
        **os.environ,
        "DEVICE_CHECK_DRY_RUN": "1",
        "DEVICE_CHECK_DEV": str(dev),
        "DEVICE_CHECK_STASH": str(stash),
        "HKSERVE_SHARED": str(SHARED),
        "PYTHON": sys.executable,
        "OUT": str(out),
        "DEVICE_CHECK_LIMITS": "golden-tests=199 nonexistent=5",  # one stage's limit overridden
    }
    run("scripts/device-wheels.sh", "--gguf", str(gguf), "--skip-wheels", env=env)
    halves = (dev / "part1" / "smollm2.gguf.part1").read_bytes() + (dev / "part2" / "smollm2.gguf.part2").read_bytes()
    assert halves == gguf.read_bytes()
    assert (dev / "part2" / "smollm2.gguf.sha256").read_text().strip() == hashlib.sha256(halves).hexdigest()
    assert (dev / "shared" / "fixtures" / "smollm2_golden.json").is_file()

    run("scripts/device-check.sh", "--stage", "1", env=env)
    assert (stash / "smollm2.gguf.part1").is_file()
    result = run("scripts/device-check.sh", env=env)

    summary = json.loads((out / "summary.json").read_text())
    assert {s["stage"]: s["status"] for s in summary["stages"]} == dict.fromkeys(STAGES, "ok"), result.stdout[-4000:]
    assert summary["tests"]["passed"] == 2 and summary["tests"]["failed"] == 0
    for name in ("bench-llama-1b", "bench-smollm2"):
        bench = summary["bench"][name]
        assert bench["dtype"] == "bfloat16" and set(bench["hkserve_tok_s"]) == {"1", "2"}
        assert bench["bandwidth_gb_s"] > 0 and bench["batch1_pct_of_bandwidth_limit"] > 0
        report = json.loads((out / f"{name}.json").read_text())
        assert report["limits"]["bandwidth_method"] == "device"
    assert summary["bench"]["bench-llama-1b"]["model"] == "random:tiny-llama"
    environment = json.loads((out / "env.json").read_text())
    assert environment["failed_imports"] == {} and environment["jax_backend"] == "cpu"
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(
        ["device-check.log", "env.json", "tests.json", "summary.json", "profile.json", "perfetto_trace.json.gz"]
        + [f"{n}.json" for n in summary["bench"]]
    )
    assert len(files) <= 8  # what one device call brings back
    profile = summary["profile"]["slots"]
    assert set(profile) == {"1", "2"} and profile["1"]["ms_per_step"]["pipelined"] > 0
    assert "profile: random:tiny-llama" in result.stdout
    assert "== summary" in result.stdout and "batch-1 limit" in result.stdout
    assert "== golden-tests (at most 199 s)" in result.stdout and "== startup (at most 300 s)" in result.stdout
    order = [line.split(" (at most")[0][3:] for line in result.stdout.splitlines() if " (at most " in line]
    assert order == list(STAGES), order
    paged = summary["paged_attention"]  # the Pallas kernel interpreted on the CPU vs XLA's gather
    assert paged["kernel"] == "interpret" and paged["kernel_used"] and set(paged["rows"]) == {"1", "2"}
    assert all(r["greedy_equal"] and r["pallas_ms"] > 0 and r["xla_ms"] > 0 for r in paged["rows"].values())
    assert "paged decode step:" in result.stdout and "XLA / Pallas" in result.stdout
    quant = summary["quant"]  # int8 / int4 weights through XLA: each formulation, and the model per dtype
    assert [(d, b["dtype"]) for d, b in quant["engine"].items()] == [("bf16", "bfloat16"), ("int4-pallas", "int4")]
    assert all(set(b["hkserve_tok_s"]) == {"1", "2"} for b in quant["engine"].values())
    forms = quant["dot"]["forms"]
    assert len(forms) == 7 and all("error" not in f and set(f["rows"]) == {"1", "2"} for f in forms.values())
    assert all(f["error_vs_float32"] < 0.2 for f in forms.values()), forms  # a wrong nibble order gives ~1
    assert "quantized x·W on cpu" in result.stdout
    startup = summary["startup"]  # serve to /health 200, cold then warm
    assert [(r["weights"], r["start"]) for r in startup["runs"]] == [("f32", "cold"), ("f32", "warm")]
    assert startup["runs"][1]["compiles"]["cache_misses"] == 0

    # A fresh machine (part 1 gone) with almost no time left: every stage says why it did not run.
    run(
        "scripts/device-check.sh",
        env={**env, "DEVICE_CHECK_STASH": str(tmp_path / "cold"), "DEVICE_CHECK_BUDGET_S": "15"},
    )
    notes = {s["stage"]: (s["status"], s["note"]) for s in json.loads((out / "summary.json").read_text())["stages"]}
    assert notes["setup"] == notes["bench-llama-1b"] == notes["profile-llama-1b"] == ("skipped", "out of time")
    assert notes["convert-smollm2"][0] == "skipped" and "halves are not both here" in notes["convert-smollm2"][1]
    assert notes["quant-weights"] == ("skipped", "out of time")
    assert (
        notes["golden-tests"]
        == notes["bench-smollm2"]
        == notes["paged-attention"]
        == notes["startup"]
        == ("skipped", "no SmolLM2 store")
    )


def _names(path) -> set[str]:
    return {canonicalize_name(line) for line in path.read_text().split("\n") if line and not line.startswith("#")}


def test_the_carried_wheels_and_the_image_hold_everything_the_gpu_run_imports():
    """A dependency in neither list fails the GPU run at its first import (llguidance once did), and that
    is found only when a GPU is lent. Checked here through each distribution's own requirements, as
    installed in this environment, evaluated for the machine's Python 3.12."""
    carried = _names(REPO / "scripts" / "device-wheels.txt")
    image = _names(REPO / "scripts" / "device-image.txt")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    golden_tests = ("pytest", "pytest-timeout", "openai", "jsonschema", "httpx")  # tests/test_api_live.py's
    todo = [Requirement(r).name for r in project["dependencies"]] + list(golden_tests)
    seen, missing = set(), {}
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        if name not in carried | image:
            missing[name] = "neither carried nor in the image"
            continue
        if name not in carried:
            continue  # the image's own packages come with what they need; a carried one may need newer
        for spec in metadata.requires(name) or ():
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"python_version": "3.12", "extra": ""}):
                todo.append(req.name)
    assert not missing, missing
    assert "llguidance" in seen and "dm-haiku" in seen
