"""`bench engine --kernels auto,xla`: decode tok/s by weights x kernels, sides alternated, and
llama.cpp (llama-cpp-python, optional) as a peer in the same run.

Every side is built once (one Engine each, compiled before timing); then each round measures every
side once, in turn, so background load on a shared machine hits all sides alike. Reported per side
and slot count: median tok/s, and the spread (max / min over the rounds).
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from hkserve.bench.peer import WARMUP_STEPS
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.kernels.dispatch import resolve
from hkserve.model.build import build_model
from hkserve.model.sampling import SamplingParams


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _one_run(engine: Engine, prompts: np.ndarray, steps: int) -> float:
    """tok/s of one timed run: prefill every slot, a few untimed steps, then `steps` read one behind."""
    active = np.ones(engine.slots, bool)
    for slot in range(engine.slots):
        first = engine.prefill(slot, prompts[slot].tolist(), SamplingParams())
    first.read()
    for _ in range(WARMUP_STEPS):
        engine.step(active).read()
    start, previous = time.perf_counter(), None
    for _ in range(steps):
        pending = engine.step(active)
        if previous is not None:
            previous.read()
        previous = pending
    previous.read()
    return engine.slots * steps / (time.perf_counter() - start)


def _llama_cpp_side(gguf: str | None, prompt: list[int], steps: int, threads: int):
    """→ (callable giving tok/s at batch 1, None) or (None, why it is skipped)."""
    try:
        import llama_cpp  # optional: pip install -e '.[llama]'
    except ImportError:
        return None, "llama-cpp-python is not installed (pip install -e '.[llama]')"
    if not gguf:
        return None, "no --llama-gguf file given"
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=threads, n_batch=64, verbose=False)

    def run() -> float:
        llm.reset()
        llm.eval(prompt)
        for _ in range(WARMUP_STEPS):
            llm.eval([llm.sample(temp=0.0)])
        start = time.perf_counter()
        for _ in range(steps):
            llm.eval([llm.sample(temp=0.0)])
        return steps / (time.perf_counter() - start)

    return run, None


def bench_kernels(store, args, prompts: np.ndarray, slot_counts: list[int]) -> dict:
    """{"weights/kernels": {slots: {"tok_s", "spread", "runs"}}, ..., "llama.cpp": ...}."""
    sides: dict = {}
    for weights in args.weights.split(","):
        config = store.config(args.model, weights)
        params = store.params(args.model, weights=weights)
        measured = set()
        for requested in args.kernels.split(","):
            spec = resolve(requested, config.dtype, config.memory)
            if spec in measured:  # e.g. int8 auto and w8a16, or f32 auto and w8a8 (attention only): one spec
                _log(f"{weights}/{requested}: the same kernels as a side already measured: measured once")
                continue
            measured.add(spec)
            label = f"{weights}/{requested if spec is not None else 'xla'}"
            model = build_model(config, spec)
            for n in slot_counts:
                engine = Engine(model, params, EngineOptions(slots=n, max_len=args.max_len))
                _one_run(engine, prompts, args.steps)  # compiles the prefill and every window the steps reach
                sides[(label, n)] = engine
    peer, note = _llama_cpp_side(args.llama_gguf, prompts[0].tolist(), args.steps, args.llama_threads)
    if peer is not None:
        sides[("llama.cpp", 1)] = peer
    runs: dict = {key: [] for key in sides}
    for round_ in range(args.repeats):
        for key, side in sides.items():  # every side once per round, in turn
            runs[key].append(side() if callable(side) else _one_run(side, prompts, args.steps))
        _log(f"round {round_ + 1}/{args.repeats}: " + ", ".join(f"{k[0]}@{k[1]} {v[-1]:.1f}" for k, v in runs.items()))
    out: dict = {}
    for (label, n), values in runs.items():
        out.setdefault(label, {})[str(n)] = {
            "tok_s": statistics.median(values),
            "spread": max(values) / min(values),
            "runs": values,
        }
    if note:
        out["llama.cpp"] = {"skipped": note}
    return out


def print_kernels(by_kernels: dict) -> None:
    print(f"{'weights/kernels':<18}{'slots':>6}{'tok/s':>10}{'ms/step':>10}{'spread':>8}")
    for label, figures in by_kernels.items():
        if "skipped" in figures:
            print(f"{label:<18}skipped: {figures['skipped']}")
            continue
        for n, f in figures.items():
            print(f"{label:<18}{n:>6}{f['tok_s']:>10.1f}{1e3 * int(n) / f['tok_s']:>10.2f}{f['spread']:>8.2f}")
