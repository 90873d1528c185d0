"""Same-process A/B of one 16-row decode step, static vs paged KV (issue 34: is the default no slower?).

For each path (SmolLM2 int8 with the CPU kernels; SmolLM2 float32 on XLA) it builds a static and a
paged engine from the store, prefills each slot of both with the same 200-token prompt, then times
`Engine.step` over all 16 rows in alternating rounds (static, paged, static, ...) of a few steps each,
so a loaded machine's swings hit both alike. Prints min and median ms per step of each layout.

    .venv/bin/python scripts/paged_ab.py [--rounds 8] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hkserve.cli.loading import LoadOptions, load_engine

PATHS = (("int8 + CPU kernels", "smollm2-135m-instruct", "int8", "auto"), ("float32, XLA", "smollm2-f32", "f32", "xla"))
SLOTS, MAX_LEN, PROMPT = 16, 512, 200


def engine(model: str, weights: str, kernels: str, layout: str):
    """An engine of `layout` whose 16 slots each hold the same 200-token prompt, its step compiled."""
    options = LoadOptions(
        model=model, weights=weights, kernels=kernels, max_len=MAX_LEN, prefill_rows=0, kv_layout=layout
    )
    e = load_engine(options, SLOTS)
    prompt = [(37 * i + 11) % 1000 + 100 for i in range(PROMPT)]
    for slot in range(SLOTS):
        e.prefill(slot, prompt).read()
    e.step(np.ones(SLOTS, bool)).read()  # compiles the step
    return e


def timed(e, steps: int) -> list[float]:
    """ms of each of `steps` decode steps over all rows, each waited for."""
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        e.step(np.ones(SLOTS, bool)).read()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    for name, model, weights, kernels in PATHS:
        engines = {layout: engine(model, weights, kernels, layout) for layout in ("static", "paged")}
        times: dict[str, list[float]] = {layout: [] for layout in engines}
        for _ in range(args.rounds):
            for layout, e in engines.items():
                times[layout] += timed(e, args.steps)
        cells = [f"{layout} {min(t):.1f} / {statistics.median(t):.1f}" for layout, t in times.items()]
        print(f"{name}: min / median ms per 16-row step: {', '.join(cells)}", flush=True)
        del engines


if __name__ == "__main__":
    main()
