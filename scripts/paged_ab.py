"""Same-process A/B of decode steps (issue 34): static vs paged KV, or the CPU kernels vs `--kernels xla`.

`--compare layouts` (the default): for each path (SmolLM2 int8 with the CPU kernels; SmolLM2 float32 on
XLA) a static and a paged engine. `--compare kernels`: SmolLM2 float32 (`--model`, `--weights`) on the
paged layout with `--kernels auto` (decode attention through the C++ kernel, each row over its own
blocks) and with `--kernels xla` (XLA's gather of every row up to the longest row's window).
Each side's slots are filled with the same prompts (`--lengths`: token counts cycled over the rows, or
"chat": fixed-seed chat-like lengths with one ~3,000-token row first), then `Engine.step` over all rows
is timed in alternating rounds (A, B, A, B, ...) of a few steps each, so a loaded machine's swings hit
both alike. Prints min and median ms per step of each side, and the ratio of the medians, per `--rows`.

    .venv/bin/python scripts/paged_ab.py [--rounds 8] [--steps 5]
    .venv/bin/python scripts/paged_ab.py --compare kernels --rows 64,16 --max-len 4096 --kv-cache-mb 1440 \\
        --lengths chat --rounds 3 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from hkserve.cli.compile_cache import enable_compile_cache
from hkserve.cli.loading import LoadOptions, load_engine

LAYOUT_PATHS = (
    ("int8 + CPU kernels", "smollm2-135m-instruct", "int8", "auto"),
    ("float32, XLA", "smollm2-f32", "f32", "xla"),
)
LONG_ROW = 3000  # "chat": the one long conversation that sets XLA's gather window


def chat_lengths(rows: int, seed: int = 34) -> list[int]:
    """A long row, then chat-like prompt lengths (log-normal, median ~150 tokens, 16..1,500)."""
    rng = np.random.default_rng(seed)
    rest = np.clip(rng.lognormal(np.log(150), 0.8, rows - 1), 16, 1500).astype(int)
    return [LONG_ROW, *rest.tolist()]


def row_lengths(spec: str, rows: int) -> list[int]:
    if spec == "chat":
        return chat_lengths(rows)
    given = [int(n) for n in spec.split(",")]
    return [given[i % len(given)] for i in range(rows)]


def engine(options: LoadOptions, lengths: list[int]):
    """An engine with one slot per length, each holding a prompt of that many tokens, its step compiled."""
    e = load_engine(options, len(lengths))
    for slot, n in enumerate(lengths):
        e.prefill(slot, [(37 * i + 11 * slot) % 1000 + 100 for i in range(n)]).read()
    e.step(np.ones(len(lengths), bool)).read()  # compiles the step
    return e


def timed(e, rows: int, steps: int) -> list[float]:
    """ms of each of `steps` decode steps over all rows, each waited for."""
    out = []
    for _ in range(steps):
        start = time.perf_counter()
        e.step(np.ones(rows, bool)).read()
        out.append((time.perf_counter() - start) * 1e3)
    return out


def compare(label: str, sides: dict[str, LoadOptions], lengths: list[int], args) -> None:
    """Build each side, then time them in alternating rounds; one line of results."""
    engines = {name: engine(options, lengths) for name, options in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, e in engines.items():
            times[name] += timed(e, len(lengths), args.steps)
    medians = {name: statistics.median(t) for name, t in times.items()}
    cells = [f"{name} {min(t):.1f} / {medians[name]:.1f}" for name, t in times.items()]
    first, second = list(medians)
    ratio = medians[second] / medians[first]
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"{label}, {len(lengths)} rows: min / median ms per step: {', '.join(cells)}; "
        f"{second}/{first} {ratio:.2f}x (load average {load})",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare", choices=("layouts", "kernels"), default="layouts")
    p.add_argument("--rows", default="16", help="comma list of row counts (the engines' slots), each compared")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--kv-cache-mb", type=float, default=None, help="paged pool size (default: the engine's)")
    p.add_argument("--lengths", default="200", help='prompt tokens per row, cycled ("200" or "50,900"), or "chat"')
    p.add_argument("--model", default="smollm2-f32", help="--compare kernels: the model")
    p.add_argument("--weights", default="f32", help="--compare kernels: its weights")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    enable_compile_cache()  # the sides' prefill programs are the same: compiled once
    common = {"max_len": args.max_len, "prefill_rows": 0, "kv_cache_mb": args.kv_cache_mb}
    for rows in (int(n) for n in args.rows.split(",")):
        lengths = row_lengths(args.lengths, rows)
        if args.compare == "kernels":
            sides = {
                k: LoadOptions(model=args.model, weights=args.weights, kernels=k, kv_layout="paged", **common)
                for k in ("auto", "xla")
            }
            compare(f"{args.model} paged, kernel vs xla", sides, lengths, args)
            continue
        for name, model, weights, kernels in LAYOUT_PATHS:
            sides = {
                layout: LoadOptions(model=model, weights=weights, kernels=kernels, kv_layout=layout, **common)
                for layout in ("static", "paged")
            }
            compare(name, sides, lengths, args)


if __name__ == "__main__":
    main()
