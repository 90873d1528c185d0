"""What a loop pass costs with a prompt chunk beside its decode step (issue 34: the chunk sizes behind
--max-step-tokens' CPU default; docs/benchmarks.md, "Prefill chunks beside decode steps").

One process: for each `--rows` R, an engine like `hkserve serve`'s (paged, --kv-cache-mb 1440,
--max-len 4096) with R + 1 slots, R rows holding a 300-token chat each, and one more slot prefilling a
long prompt (the engines share one copy of the weights). Each round times, in an order that rotates from
round to round (the machine is shared: min and median of the rounds), every engine's pass of its R-row
decode step alone and its passes of the step after a continuation chunk of each of `--chunks` tokens at
`--at` (the chunk's attention window is that of a chunk starting there), as the runner dispatches them:
the chunk, then the step, then both read. A step computes all of its engine's slots (idle rows compute
but write nothing), so an engine's R is its step's row count.

    .venv/bin/python scripts/chunk_cost.py [--model smollm2-f32] [--rounds 7] [--at 2048]
        [--rows 16] [--chunks 32,64,128,256,512]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np

from hkserve.checkpoint.store import ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.model.build import build_model
from hkserve.model.config import default_weights
from hkserve.model.sampling import SamplingParams, make_settings

CHUNKS = (32, 64, 128, 256, 512)
ROWS = (16,)


def build(model: str, rows_list: tuple[int, ...]) -> dict[int, Engine]:
    """One engine of R + 1 slots per R, over one copy of the weights."""
    store, weights = ModelStore(), default_weights(jax.default_backend(), None)
    built, params = build_model(store.config(model, weights)), store.params(model, weights=weights)
    engines = {}
    for rows in rows_list:
        options = EngineOptions(slots=rows + 1, max_len=4096, n_top=5, kv_layout="paged", kv_cache_mb=1440)
        engines[rows] = Engine(built, params, options)
    return engines


def timed(engine: Engine, rows: int, chunk: int, at: int, row) -> float:
    """One pass: the prefilling slot's (slot `rows`) chunk of `chunk` tokens (0: none), then the decode step."""
    if chunk:  # the slot starts afresh (untimed), so the chunks never run past its memory
        jax.block_until_ready(engine._prefill_chunk(rows, [1] * 16, 0, 16, row))
    active = np.arange(rows + 1) < rows
    start = time.perf_counter()
    out = engine._prefill_chunk(rows, [1] * chunk, engine._window(at), chunk, row) if chunk else None
    step = engine.step(active)
    step.read()
    jax.block_until_ready(out)
    return time.perf_counter() - start


def fill(engine: Engine, rows: int) -> None:
    """R rows holding a 300-token chat each, and the long prompt's blocks in the last slot."""
    for slot in range(rows):
        engine.prefill(slot, [(7 * slot + i) % 1000 + 5 for i in range(300)]).read()
    engine.start_prefill(rows, [1] * 4000)


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-f32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--at", type=int, default=2048, help="prompt position of the timed chunks")
    p.add_argument("--rows", type=ints, default=ROWS, help="decode rows, comma-separated: one engine each")
    p.add_argument("--chunks", type=ints, default=CHUNKS, help="chunk tokens, comma-separated (prefill buckets)")
    args = p.parse_args()
    load = os.getloadavg()
    engines = build(args.model, args.rows)
    row = None
    for rows, engine in engines.items():
        fill(engine, rows)
        row = make_settings([SamplingParams()], engine.vocab_size)
    configs = [(r, c) for r in args.rows for c in (0, *args.chunks)]
    for rows, chunk in configs:  # compile
        timed(engines[rows], rows, chunk, args.at, row)
    times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for rows, chunk in order if r % 2 == 0 else order[::-1]:
            times[rows, chunk].append(timed(engines[rows], rows, chunk, args.at, row))
    table = {
        rows: {
            chunk: {
                "min_ms": round(1e3 * min(times[rows, chunk]), 1),
                "median_ms": round(1e3 * statistics.median(times[rows, chunk]), 1),
                "min_over_step": round(min(times[rows, chunk]) / min(times[rows, 0]), 2),
            }
            for chunk in (0, *args.chunks)
        }
        for rows in args.rows
    }
    out = {"backend": jax.default_backend(), "at": args.at, "rounds": args.rounds}
    if len(args.rows) == 1:  # the default run's shape: chunk -> times
        out["pass"] = table[args.rows[0]]
    else:
        out["pass_by_rows"] = table
    print(json.dumps({**out, "loadavg_start": load, "loadavg_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
