"""Where one decode step's time goes, by part, for a stored model's weight variants (issue 36: int4 at 16
slots >= 1.2x int8 at 16 slots, and the parts the two share dilute the int4 kernel's gain).

Each variant is an Engine as `hkserve bench engine --kernels auto` builds it (all slots active, greedy).
Per round, every variant in turn: a wall-clock run of `--steps` steps read one behind (as the bench), then
the same steps under jax.profiler. The trace's leaf events (XLA thunks on the executing threads) are summed
per step and sorted into parts by what they run, read from the compiled step's HLO (an XLA dump):
  layers     the decoder's matrix products (a kernel custom call run once per layer),
  head       the output head's product (a matmul kernel called once a step),
  attention  hk_decode_attention*,
  sampling   hk_logit_stats and the sampler's XLA ops after it,
  xla        every other XLA op (norms, residual adds, rotary, KV writes, glue),
  host       the wall step minus the parts: dispatch, the host's bookkeeping, waits between thunks.
Alternating rounds make background load hit every variant alike; each part's minimum over the rounds is
reported (the least disturbed; on a loaded machine a thunk's wall time also holds the time its thread
waited for a core), and host as the minimum step less those parts.
Usage (ISA: HKSERVE_KERNEL_ISA=avx2 forces the AVX2 paths):
  python scripts/int4_step_profile.py [--model M] [--weights int8,int4] [--kernels auto] [--slots 16]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

DUMP = tempfile.mkdtemp(prefix="hk-step-profile-")
# The step's HLO (after optimizations) says which custom call each traced thunk is; set before jax loads.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={DUMP} --xla_dump_hlo_module_re=.*_step_impl.*"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hkserve.bench.kernels import _one_run  # noqa: E402
from hkserve.checkpoint.store import ModelStore  # noqa: E402
from hkserve.engine.engine import Engine  # noqa: E402
from hkserve.engine.options import EngineOptions  # noqa: E402
from hkserve.kernels.dispatch import resolve  # noqa: E402
from hkserve.model.build import build_model  # noqa: E402

DETAIL: collections.Counter = collections.Counter()  # (variant, part, op or kernel) → ms a step, summed over rounds
PARTS = ("layers", "head", "attention", "sampling", "xla", "host")
WRAPPERS = re.compile(r"^(while|conditional|call|ThunkExecutor|\$|PjitFunction|CommonPjRt)")


def custom_calls() -> dict[tuple[int, str], str]:
    """(program id, instruction name) → custom call target, from every dumped step module."""
    out = {}
    for path in glob.glob(f"{DUMP}/module_*after_optimizations.txt"):
        program = int(os.path.basename(path).split(".")[0].split("_")[1])
        for name, target in re.findall(r"%?(\S+) = .*custom_call_target=\"(\w+)\"", Path(path).read_text()):
            out[(program, name)] = target
    return out


def leaf_events(data) -> list:
    """The trace's XLA thunks that contain no other event of their line (loops and calls are containers)."""
    leaves = []
    for plane in data.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_XLA"):
                continue
            # "end: X" marks lie inside X; the thread pool's marks have no duration.
            events = [e for e in line.events if e.duration_ns > 0 and not e.name.startswith("end: ")]
            events.sort(key=lambda e: (e.start_ns, -e.duration_ns))
            for i, ev in enumerate(events):
                inner = i + 1 < len(events) and events[i + 1].start_ns < ev.start_ns + ev.duration_ns
                if not inner and not WRAPPERS.match(ev.name):
                    leaves.append(ev)
    return leaves


def part_of(target: str | None, per_step: float, after_logits: bool) -> str:
    if target is None or not target.startswith("hk_"):
        return "sampling" if after_logits else "xla"
    if target.startswith("hk_decode_attention"):
        return "attention"
    if target == "hk_logit_stats":
        return "sampling"
    return "layers" if per_step > 1 else "head"


def profile(label: str, engine: Engine, prompts: np.ndarray, steps: int, calls: dict) -> dict[str, float]:
    """ms per step by part of `steps` traced steps (the wall clock of an untraced run for the total)."""
    wall_ms = 1e3 * engine.slots / _one_run(engine, prompts, steps)
    with tempfile.TemporaryDirectory() as trace:
        jax.profiler.start_trace(trace)
        active = np.ones(engine.slots, bool)
        for _ in range(steps):
            engine.step(active).read()
        jax.profiler.stop_trace()
        data = jax.profiler.ProfileData.from_file(glob.glob(f"{trace}/**/*.xplane.pb", recursive=True)[0])
    events = leaf_events(data)
    stats = [dict(ev.stats) for ev in events]
    counts = collections.Counter((s.get("program_id"), ev.name) for ev, s in zip(events, stats))
    # The sampler's XLA ops run after the head's product: events of a step later than its head call.
    ms = dict.fromkeys(PARTS, 0.0)
    head_end = {}
    for ev, s in zip(events, stats):
        target = calls.get((s.get("program_id"), ev.name))
        if target and target.startswith("hk_w") and counts[(s.get("program_id"), ev.name)] <= steps:
            head_end[s.get("run_id")] = ev.start_ns + ev.duration_ns
    for ev, s in zip(events, stats):
        key = (s.get("program_id"), ev.name)
        after = ev.start_ns >= head_end.get(s.get("run_id"), float("inf"))
        part = part_of(calls.get(key), counts[key] / steps, after)
        ms[part] += ev.duration_ns / 1e6 / steps
        DETAIL[(label, part, calls.get(key) or ev.name)] += ev.duration_ns / 1e6 / steps
    ms["host"] = wall_ms - sum(ms.values())
    ms["step"] = wall_ms
    return ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="int8,int4")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--detail", type=int, default=0, help="also list the N costliest ops (per variant)")
    args = ap.parse_args()
    store = ModelStore()
    engines = {}
    for weights in args.weights.split(","):
        config = store.config(args.model, weights)
        params = store.params(args.model, weights=weights)
        for requested in args.kernels.split(","):
            spec = resolve(requested, config.dtype, config.memory)
            engine = Engine(build_model(config, spec), params, EngineOptions(slots=args.slots, max_len=args.max_len))
            engines[f"{weights}/{requested}"] = engine
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (args.slots, args.prompt_len), np.int32)
    for engine in engines.values():
        _one_run(engine, prompts, args.steps)  # compiles every window the timed steps reach
    calls = custom_calls()
    shutil.rmtree(DUMP)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    runs: dict = {label: [] for label in engines}
    start = time.time()
    for round_ in range(args.rounds):
        for label, engine in engines.items():
            ms = profile(label, engine, prompts, args.steps, calls)
            runs[label].append(ms)
            print(f"round {round_ + 1} {label}: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()), file=sys.stderr)
    print(f"load average after: {os.getloadavg()} ({time.time() - start:.0f} s)", file=sys.stderr)
    if args.detail:
        for (label, part, op), total in DETAIL.most_common(args.detail):
            print(f"{label:12} {part:10} {op:40} {total / args.rounds:.3f} ms a step", file=sys.stderr)
    print(f"| {args.model}, {args.slots} slots | " + " | ".join(PARTS) + " | step (wall) |")
    print("|---|" + "---:|" * (len(PARTS) + 1))
    for label, rounds in runs.items():
        ms = {k: min(r[k] for r in rounds) for k in (*PARTS, "step")}
        ms["host"] = ms["step"] - sum(ms[k] for k in PARTS if k != "host")
        print(f"| {label} | " + " | ".join(f"{ms[k]:.2f}" for k in (*PARTS, "step")) + " |")


if __name__ == "__main__":
    main()
