"""What a loop pass costs with a prompt chunk beside its decode step (issue 34: the chunk size behind
--max-step-tokens' CPU default; docs/benchmarks.md, "Prefill chunks beside decode steps").

One process: an engine like `hkserve serve`'s (paged, --kv-cache-mb 1440, --max-len 4096), 16 rows
holding a 300-token chat each, and one more slot prefilling a long prompt. Each round times, in an
order that rotates from round to round (the machine is shared: min and median of the rounds), a pass
of the 16-row decode step alone and passes of the step after a continuation chunk of 32 .. 512 tokens
at `--at` (the chunk's attention window is that of a chunk starting there), as the runner dispatches
them: the chunk, then the step, then both read.

    .venv/bin/python scripts/chunk_cost.py [--model smollm2-f32] [--rounds 7] [--at 2048]
"""

from __future__ import annotations

import argparse
import json
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
ROWS = 16


def build(model: str) -> Engine:
    store, weights = ModelStore(), default_weights(jax.default_backend(), None)
    options = EngineOptions(slots=ROWS + 1, max_len=4096, n_top=5, kv_layout="paged", kv_cache_mb=1440)
    return Engine(build_model(store.config(model, weights)), store.params(model, weights=weights), options)


def timed(engine: Engine, active: np.ndarray, chunk: int, at: int, row) -> float:
    """One pass: the prefilling slot's chunk of `chunk` tokens (0: none), then the decode step."""
    if chunk:  # the slot starts afresh (untimed), so the chunks never run past its memory
        jax.block_until_ready(engine._prefill_chunk(ROWS, [1] * 16, 0, 16, row))
    start = time.perf_counter()
    out = engine._prefill_chunk(ROWS, [1] * chunk, engine._window(at), chunk, row) if chunk else None
    step = engine.step(active)
    step.read()
    jax.block_until_ready(out)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-f32")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--at", type=int, default=2048, help="prompt position of the timed chunks")
    args = p.parse_args()
    engine = build(args.model)
    for slot in range(ROWS):
        engine.prefill(slot, [(7 * slot + i) % 1000 + 5 for i in range(300)]).read()
    engine.start_prefill(ROWS, [1] * 4000)  # the long prompt's blocks
    row = make_settings([SamplingParams()], engine.vocab_size)
    active = np.arange(ROWS + 1) < ROWS
    configs = (0, *CHUNKS)
    for chunk in configs:  # compile
        timed(engine, active, chunk, args.at, row)
    times: dict[int, list[float]] = {c: [] for c in configs}
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for chunk in order if r % 2 == 0 else order[::-1]:
            times[chunk].append(timed(engine, active, chunk, args.at, row))
    table = {
        c: {"min_ms": round(1e3 * min(t), 1), "median_ms": round(1e3 * statistics.median(t), 1)}
        for c, t in times.items()
    }
    print(json.dumps({"backend": jax.default_backend(), "at": args.at, "rounds": args.rounds, "pass": table}))


if __name__ == "__main__":
    main()
