"""`hkserve bench engine --background-load`: batch-1 decode tok/s quiet vs with one core kept busy by
another process, per XLA CPU threading setting.

Why: on a 2-core machine batch-1 decode swung 2x between runs when other processes were busy. XLA's
CPU runtime splits each op of the step over an intra-op thread pool of one thread per core; a step
is some hundreds of small ops, each one waiting for its slowest thread, so when another process holds
a core every op can wait for the scheduler to hand that core back. A single intra-op thread never
waits for a second one. Each setting is measured in its own child process (XLA reads its flags once
per process), quiet and loaded alternating, the median and spread of --repeats runs reported.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

# XLA_FLAGS of each setting: "pool" is XLA's default (one intra-op thread per core), "1" one thread.
THREAD_SETTINGS = {
    "pool": "",
    "1": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}


# The load is steady: measured after the kernels' contention monitor (kernels/contention.py), which
# samples every 0.25 s and moves its cap on two agreeing samples, has seen it.
SETTLE_S = 1.0


@contextlib.contextmanager
def busy_core():
    """One core kept busy by another process (a Python spin loop) while inside."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(SETTLE_S)
        yield
    finally:
        hog.kill()
        hog.wait()


def _measure(args) -> dict:
    """In this process: {"quiet": [tok/s ...], "loaded": [...]} of batch-1 greedy decode."""
    import jax

    from hkserve.bench.engine import decode_seconds, load_weights
    from hkserve.bench.peer import WARMUP_STEPS
    from hkserve.engine.engine import Engine
    from hkserve.engine.options import EngineOptions
    from hkserve.kernels.dispatch import resolve
    from hkserve.model.build import build_model
    from hkserve.model.config import default_weights
    from hkserve.model.sampling import SamplingParams

    _, config, params = load_weights(args, default_weights(jax.default_backend(), args.dtype))
    model = build_model(config, resolve(args.kernels, config.dtype, config.memory))
    engine = Engine(model, params, EngineOptions(slots=1, max_len=args.max_len))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, args.prompt_len).tolist()
    active = np.ones(1, bool)

    def once() -> float:
        engine.prefill(0, prompt, SamplingParams()).read()
        decode_seconds(lambda: engine.step(active), WARMUP_STEPS)
        return args.steps / decode_seconds(lambda: engine.step(active), args.steps)

    once()  # compiles
    out = {"quiet": [], "loaded": []}
    for repeat in range(args.repeats):
        for side in ("quiet", "loaded")[:: -1 if repeat % 2 else 1]:
            with busy_core() if side == "loaded" else contextlib.nullcontext():
                out[side].append(once())
    return out


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def run(args) -> dict:
    """Each setting of --xla-threads (x each of --kernels, for int8 weights) in a child process →
    {label: {quiet, loaded, loaded_over_quiet}}; the label is the setting, plus "/kernels" when given."""
    report = {}
    kernel_choices = (args.kernels or "auto").split(",")
    for setting, kernels in [(s, k) for s in args.xla_threads.split(",") for k in kernel_choices]:
        if setting not in THREAD_SETTINGS:
            raise ValueError(f"unknown --xla-threads setting {setting!r} (known: {', '.join(THREAD_SETTINGS)})")
        label = f"{setting}/{kernels}" if args.kernels else setting
        env = {
            **os.environ,
            "XLA_FLAGS": " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), THREAD_SETTINGS[setting]])),
        }
        cmd = [sys.executable, "-m", "hkserve.bench.steady", "--steps", str(args.steps), "--repeats", str(args.repeats)]
        cmd += ["--prompt-len", str(args.prompt_len), "--max-len", str(args.max_len), "--kernels", kernels]
        cmd += ["--random", args.random] if args.random else ["--model", args.model]
        cmd += ["--dtype", args.dtype] if args.dtype else []
        print(f"background load, {label}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        child = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=True)
        runs = json.loads(child.stdout.strip().splitlines()[-1])
        quiet, loaded = _summary(runs["quiet"]), _summary(runs["loaded"])
        report[label] = {"quiet": quiet, "loaded": loaded, "loaded_over_quiet": loaded["median"] / quiet["median"]}
    return report


def cmd_background_load(args) -> int:
    report = run(args)
    print_report(report)
    if args.json:
        print(json.dumps({"background_load": report, "settings": {"steps": args.steps, "repeats": args.repeats}}))
    return 0


def print_report(report: dict) -> None:
    print(f"{'XLA threads':<16}{'quiet tok/s (min-max)':>26}{'loaded tok/s (min-max)':>26}{'loaded/quiet':>14}")
    for setting, r in report.items():
        q, ld = r["quiet"], r["loaded"]
        print(
            f"{setting:<16}{q['median']:>10.1f} ({q['min']:.1f}-{q['max']:.1f}){'':>4}"
            f"{ld['median']:>10.1f} ({ld['min']:.1f}-{ld['max']:.1f}){'':>4}{r['loaded_over_quiet']:>12.3f}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description="child of bench engine --background-load: one XLA setting")
    p.add_argument("--model", default=None)
    p.add_argument("--random", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=2048)
    print(json.dumps(_measure(p.parse_args())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
