"""The reports of scripts/device-check.sh.

env OUT_JSON: the machine, the versions that matter, and whether every distribution of
    scripts/device-wheels.txt is installed with its requirements met (a carried wheel that needs a
    newer package than the machine has shows up here, not as an ImportError three stages later).
summary STAGES_TSV TESTS_XML RESULTS_DIR [WORK_DIR]: tests.json from pytest's JUnit XML, summary.json
    from the stages, the benchmark JSONs in RESULTS_DIR and those the check keeps in WORK_DIR (one call
    brings back 8 files): scripts/device_paged_attention.py's (Pallas vs XLA's gather), stage
    quant-weights' (scripts/device_quant_dot.py's and `bench engine` in bf16, int8 and int4) and stage
    startup's (`bench startup`); and a summary on stdout. Exits 1 if a stage failed.
"""

from __future__ import annotations

import importlib
import importlib.metadata as metadata
import json
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jax
from packaging.requirements import Requirement

WHEELS = Path(__file__).with_name("device-wheels.txt")
MODULES = ("haiku", "gguf", "fastapi", "uvicorn", "openai", "jsonschema", "hkserve.api.app", "hkserve.bench.cli")
BENCHES = ("bench-llama-1b", "bench-smollm2")
QUANT_DTYPES = ("bf16", "int8", "int4", "int4-pallas")


def wanted_distributions() -> list[str]:
    return [line.strip() for line in WHEELS.read_text().splitlines() if line.strip() and not line.startswith("#")]


def unmet_requirements(names: list[str]) -> list[str]:
    """'dist: requirement (have version)' for each requirement of `names` this environment does not meet."""
    problems = []
    for name in names:
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            problems.append(f"{name}: not installed")
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{name}: {text} (not installed)")
                continue
            if not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name}: {text} (have {have})")
    return problems


def version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gpu_names() -> list[str]:
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return result.stdout.strip().splitlines()


def torch_cuda() -> str:
    try:
        import torch  # optional here, as for the bench peer
    except ImportError as e:
        return f"torch not importable: {e}"
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device for torch"


def env(out: Path) -> int:
    names = wanted_distributions()
    failed_imports = {}
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as e:  # any failure to import is the finding
            failed_imports[module] = f"{type(e).__name__}: {e}"
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "gpus": gpu_names(),
        "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
        "torch_cuda": torch_cuda(),
        "versions": {n: version(n) for n in ("jax", "jaxlib", "torch", "transformers", "orbax-checkpoint", *names)},
        "unmet_requirements": unmet_requirements(names),
        "failed_imports": failed_imports,
    }
    out.write_text(json.dumps(report, indent=2))
    versions = report["versions"]
    print(f"python {report['python']}, jax {versions['jax']} on {report['jax_backend']}: {report['jax_devices']}")
    print(f"GPUs: {report['gpus'] or 'none'}; torch: {report['torch_cuda']}")
    for problem in report["unmet_requirements"]:
        print(f"UNMET: {problem}")
    for module, error in failed_imports.items():
        print(f"IMPORT FAILED: {module}: {error}")
    return 1 if failed_imports else 0


def read_stages(path: Path) -> list[dict]:
    stages = []
    for line in path.read_text().splitlines():
        name, rc, seconds, note = (line.split("\t") + [""] * 4)[:4]
        status = "skipped" if rc == "skipped" else "ok" if rc == "0" else "timed out" if rc == "124" else "failed"
        stages.append({"stage": name, "status": status, "exit": rc, "seconds": int(seconds), "note": note})
    return stages


def read_tests(junit: Path) -> dict | None:
    """pytest's JUnit XML → {passed, failed, skipped, cases: [{name, outcome, seconds, message}]}."""
    if not junit.is_file():
        return None
    cases = []
    for case in ET.parse(junit).iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        outcome = "passed" if problem is None else {"failure": "failed", "error": "failed"}.get(problem.tag, "skipped")
        cases.append(
            {
                "name": f"{case.get('classname')}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": None if problem is None else (problem.get("message") or "")[:500],
            }
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {**counts, "cases": cases}


def bench_summary(report: dict) -> dict:
    """The figures the GPU section of docs/benchmarks.md records, from one `bench engine --json` line."""
    limits = report["limits"]
    ours, peer = report["hkserve"], report["hf_transformers"] or {}
    return {
        "model": report["model"],
        "dtype": report["dtype"],
        "device": report["env"]["device"],
        "bandwidth_gb_s": limits["bandwidth_gb_s"],
        "batch1_limit_tok_s": limits["bandwidth_tok_s"],
        "hkserve_tok_s": ours,
        "transformers_tok_s": peer or None,
        "batch1_pct_of_bandwidth_limit": 100 * ours["1"] / limits["bandwidth_tok_s"] if "1" in ours else None,
        "hkserve_over_transformers": {n: ours[n] / peer[n] for n in ours if n in peer},
    }


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def summary(stages_tsv: Path, junit: Path, results: Path, work: Path | None = None) -> int:
    stages = read_stages(stages_tsv)
    tests = read_tests(junit)
    if tests is not None:
        (results / "tests.json").write_text(json.dumps(tests, indent=2))
    benches = {
        name: bench_summary(json.loads((results / f"{name}.json").read_text()))
        for name in BENCHES
        if (results / f"{name}.json").is_file()
    }
    profile = _json(results / "profile.json")
    work = work or Path("/nonexistent")
    paged = _json(work / "paged-attention.json")
    quant_engine = {d: bench_summary(r) for d in QUANT_DTYPES if (r := _json(work / f"quant-{d}.json")) is not None}
    quant = (
        {"dot": _json(work / "quant-dot.json"), "engine": quant_engine}
        if quant_engine or (work / "quant-dot.json").is_file()
        else None
    )
    startup = _json(work / "startup.json")
    (results / "summary.json").write_text(
        json.dumps(
            {
                "stages": stages,
                "tests": tests,
                "bench": benches,
                "profile": profile,
                "paged_attention": paged,
                "quant": quant,
                "startup": startup,
            },
            indent=2,
        )
    )

    print("== summary")
    for s in stages:
        print(f"{s['stage']:<18}{s['status']:<11}{s['seconds']:>5} s  {s['note']}")
    if tests is not None:
        print(f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped")
        for case in tests["cases"]:
            if case["outcome"] == "failed":
                print(f"  FAILED {case['name']}: {case['message']}")
    for name, b in benches.items():
        print(
            f"{name}: {b['model']} in {b['dtype']} on {b['device']}: memory bandwidth {b['bandwidth_gb_s']:.0f} GB/s "
            f"(device copy, read + written) → batch-1 limit {b['batch1_limit_tok_s']:.0f} tok/s; hkserve batch 1 "
            f"reaches {b['batch1_pct_of_bandwidth_limit'] or 0:.1f}% of it"
        )
        peer = b["transformers_tok_s"] or {}
        for n, tok_s in b["hkserve_tok_s"].items():
            theirs = f"transformers {peer[n]:.1f} tok/s ({tok_s / peer[n]:.2f}x)" if n in peer else "transformers -"
            print(f"  {n:>3} slots: hkserve {tok_s:.1f} tok/s, {theirs}")
    if profile is not None:
        print_profile(profile)
    if paged is not None:
        print_paged(paged)
    if quant is not None:
        print_quant(quant)
    if startup is not None:
        print_startup(startup)
    return 1 if any(s["status"] in ("failed", "timed out") for s in stages) else 0


def print_profile(profile: dict) -> None:
    """scripts/device_profile.py's figures: ms per step three ways, and the trace's device work."""
    print(f"profile: {profile['model']} on {profile['device']}, ms per decode step")
    for slots, entry in profile["slots"].items():
        ms = entry["ms_per_step"]
        print(
            f"  {slots:>3} slots: pipelined {ms['pipelined']:.2f}, unread {ms['unread']:.2f}, "
            f"host dispatch {ms['dispatch']:.2f}"
        )
        trace = entry.get("trace") or {}
        if trace.get("device_events"):
            print(
                f"       trace: {trace['kernels_per_step']:.0f} kernels, {trace['kernel_ms_per_step']:.2f} ms "
                f"in kernels, {trace['span_ms_per_step']:.2f} ms from first start to last end (per step)"
            )
            for k in trace["top"][:8]:
                print(f"         {k['ms_per_step']:.3f} ms  x{k['calls_per_step']:.0f}  {k['name'][:90]}")


def print_paged(paged: dict) -> None:
    """scripts/device_paged_attention.py's figures: ms per paged decode step on either path, and the ratio."""
    print(f"paged decode step: {paged['model']} on {paged['device']}, {paged['kernel']} kernel vs XLA's gather")
    if not paged["kernel_used"]:
        print("  the kernel did not take this model (the log says why): both columns are XLA's gather")
    for rows, r in paged["rows"].items():
        print(
            f"  {rows:>3} rows: XLA gather {r['xla_ms']:.3f} ms, Pallas {r['pallas_ms']:.3f} ms, "
            f"XLA / Pallas {r['xla_over_pallas']:.2f}x; first step's logits differ by {r['max_abs_logit_diff']:.3g}, "
            f"greedy tokens {'equal' if r['greedy_equal'] else 'DIFFER'}"
        )


def print_quant(quant: dict) -> None:
    """Stage quant-weights: each formulation's ms per matrix, then the random model's tok/s per dtype."""
    dot = quant["dot"]
    if dot is not None:
        print(f"quantized x·W on {dot['device']}: {dot['layers']} matrices [{dot['k']}, {dot['n']}], ms a matrix")
        for name, f in dot["forms"].items():
            if "error" in f:
                print(f"  {name}: FAILED {f['error']}")
                continue
            rows = ", ".join(f"{n} rows {r['ms_per_matrix']:.4f} ({r['gb_s']:.0f} GB/s)" for n, r in f["rows"].items())
            print(f"  {name:<30} {rows}; error {f['error_vs_float32']:.1e}")
    for name, b in quant["engine"].items():
        tok_s = ", ".join(f"{n} slots {t:.1f}" for n, t in b["hkserve_tok_s"].items())
        print(f"  {b['model']} {name}: {tok_s} tok/s")


def print_startup(startup: dict) -> None:
    print(f"startup: {startup['model']}, {startup['slots']} slots, max-len {startup['max_len']}")
    for r in startup["runs"]:
        c = r["compiles"]
        print(
            f"  {r['weights']} {r['start']}: ready {r['ready_s_client']:.1f} s, all compiled {r['compiled_s']:.1f} s, "
            f"programs {c['programs']}, cache hits {c['cache_hits']}, misses {c['cache_misses']}; "
            f"RSS {r['rss_mib_client']:.0f} MiB"
        )


def main(argv: list[str]) -> int:
    if argv[:1] == ["env"] and len(argv) == 2:
        return env(Path(argv[1]))
    if argv[:1] == ["summary"] and len(argv) in (4, 5):
        return summary(*(Path(a) for a in argv[1:]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
