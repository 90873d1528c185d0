"""Same-process A/B of the decode step's window (issue 37): SmolLM2 int8 on the CPU kernels' paged path,
its one step program (window max_len, what the engine now runs there) against the windowed engine's
program of the window the rows' longest context picks (128 for short contexts), on one engine and one
state: every slot prefilled with `--prompt` tokens, then rounds of `--steps` steps over all rows through
each program in turn (A, B, A, B, ...), so the load and the growing context hit both alike. Prints each
round's wall ms and process CPU ms (all threads) per step, and the medians.

    nice -n 5 .venv/bin/python scripts/step_window_ab.py [--slots 16] [--rounds 6] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from hkserve.cli.compile_cache import enable_compile_cache
from hkserve.cli.loading import LoadOptions, load_engine


def timed_round(e, program, steps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per step of `steps` steps over every row through `program`, each waited for."""
    active = np.ones(e.slots, bool)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        e._grow(active)
        e.state, out = program(e.params, e.state, active)
        e.positions += active
        np.asarray(out)
    return (time.perf_counter() - wall) * 1e3 / steps, (time.process_time() - cpu) * 1e3 / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--prompt", type=int, default=20)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    enable_compile_cache()
    options = LoadOptions(model="smollm2-135m-instruct", weights="int8", max_len=args.max_len, prefill_rows=0)
    e = load_engine(options, args.slots)
    assert e.step_windows == (e.max_len,), e.step_windows  # the kernels' path: one window
    for slot in range(args.slots):
        e.prefill(slot, [(37 * i + 11 * slot) % 1000 + 100 for i in range(args.prompt)]).read()
    longest = args.prompt + 2 * args.rounds * args.steps
    small = e._window(longest)  # the windowed engine's window for every step of this run
    sides = {f"window {w} ({name})": e._compiled_fn("step", w) for name, w in (("windowed", small), ("one", e.max_len))}
    for program in sides.values():
        timed_round(e, program, 1)  # compiled (or loaded) and run once before timing
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, program in sides.items():
            results[name].append(timed_round(e, program, args.steps))
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    for name, rounds in results.items():
        cells = " ".join(f"{w:.1f}/{c:.1f}" for w, c in rounds)
        wall, cpu = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        print(f"{name}: wall/CPU ms per step by round {cells}; median {wall:.1f} / {cpu:.1f}", flush=True)
    print(f"{args.slots} slots, context {args.prompt}..{longest + 2}, load average {load}", flush=True)


if __name__ == "__main__":
    main()
