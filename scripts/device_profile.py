"""Where a decode step's time goes (scripts/device-check.sh, stage profile-llama-1b): the engine's step
timed three ways, and a JAX profiler trace of a few steps summed per kind of device work.

- pipelined: step k dispatched, then step k-1 read (as the runner and `bench engine` do);
- unread: every step dispatched back to back, one wait at the end (the device's own pace: if it is
  no faster than pipelined, the host is not what holds a step up);
- dispatch: the host's time inside those unread `step()` calls alone.
The trace (perfetto_trace.json.gz, copied beside the JSON) gives, per step, the number of device
kernels, their summed time, and the gaps between them (launch latency, host waits).

usage: python scripts/device_profile.py --random NAME --slots 1,64 --max-len N --steps N --out DIR
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from hkserve.bench.engine import decode_seconds
from hkserve.bench.random_models import random_config, random_params
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.model.build import build_model
from hkserve.model.config import WEIGHTS
from hkserve.model.sampling import SamplingParams


def step_times(engine: Engine, prompts: np.ndarray, steps: int) -> dict:
    """ms per step: pipelined, unread, and the host's dispatch time of the unread steps. Each mode starts
    from a fresh prefill of every slot, so both decode the same positions (and attention windows)."""
    slots = len(prompts)
    active = np.ones(slots, bool)

    def prefill():
        for slot in range(slots):
            first = engine.prefill(slot, prompts[slot].tolist(), SamplingParams())
        first.read()

    prefill()
    pipelined = decode_seconds(lambda: engine.step(active), steps)

    prefill()
    dispatch = 0.0
    start = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        pending = engine.step(active)
        dispatch += time.perf_counter() - t
    pending.read()
    unread = time.perf_counter() - start
    return {k: 1e3 * v / steps for k, v in (("pipelined", pipelined), ("unread", unread), ("dispatch", dispatch))}


def summarize_trace(path: Path, steps: int) -> dict:
    """Per step: device kernels, their summed ms, the span from first start to last end, top kernels."""
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = [e for e in events if e.get("ph") == "X" and "GPU" in names.get(e.get("pid"), "") and "dur" in e]
    if not device:
        return {"device_events": 0, "processes": sorted(set(names.values()))}
    busy = collections.Counter()
    count = collections.Counter()
    for e in device:
        busy[e["name"]] += e["dur"]
        count[e["name"]] += 1
    span = max(e["ts"] + e["dur"] for e in device) - min(e["ts"] for e in device)
    return {
        "device_events": len(device),
        "kernels_per_step": len(device) / steps,
        "kernel_ms_per_step": sum(busy.values()) / 1e3 / steps,
        "span_ms_per_step": span / 1e3 / steps,
        "top": [
            {"name": n[:120], "ms_per_step": us / 1e3 / steps, "calls_per_step": count[n] / steps}
            for n, us in busy.most_common(15)
        ],
        "processes": sorted(set(names.values())),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--random", required=True)
    parser.add_argument("--slots", default="1,64")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--trace-steps", type=int, default=8, help="0: no trace")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", choices=("auto", "scan", "loop"), default="auto")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = random_config(args.random, WEIGHTS["bf16"])
    model, params = build_model(config, layers=None if args.layers == "auto" else args.layers), random_params(config)
    rng = np.random.default_rng(0)
    report = {"model": f"random:{args.random}", "device": str(jax.devices()[0].device_kind), "slots": {}}
    for slots in [int(s) for s in args.slots.split(",")]:
        engine = Engine(model, params, EngineOptions(slots=slots, max_len=args.max_len))
        prompts = rng.integers(0, config.vocab_size, (slots, 32))
        step_times(engine, prompts, args.steps)  # compiles the prefill and the windows the steps reach
        entry = {"ms_per_step": step_times(engine, prompts, args.steps)}
        if slots == 1 and args.trace_steps:  # one trace comes back (the device tool returns at most 8 files)
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp, create_perfetto_trace=True):
                    step_times(engine, prompts, args.trace_steps)
                (trace,) = glob.glob(f"{tmp}/**/perfetto_trace.json.gz", recursive=True)
                shutil.copy(trace, args.out / "perfetto_trace.json.gz")
            # the traced run is pipelined then unread: 2 x trace_steps steps
            entry["trace"] = summarize_trace(args.out / "perfetto_trace.json.gz", 2 * args.trace_steps)
        report["slots"][str(slots)] = entry
        print(json.dumps({str(slots): entry["ms_per_step"]}), flush=True)
        del engine
    (args.out / "profile.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
