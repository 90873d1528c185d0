"""The paged decode step, Pallas kernel vs XLA's gather, in one run (scripts/device-check.sh, stage
paged-attention): the model's one-token forward over a paged KV memory whose rows hold `--context`
tokens or fewer (lengths drawn in [context/2, context], shuffled blocks), compiled once per path
(HKSERVE_PAGED_ATTENTION=xla | pallas, read when traced), timed alternately with the memory donated.
Also the first steps' logits of the two paths side by side: their largest difference and whether
their greedy tokens agree (the kernel's first run under Triton). On a CPU (dry run) the kernel runs
interpreted, at toy sizes.

usage: python scripts/device_paged_attention.py (--model NAME | --random NAME) --rows 16,64 --out JSON
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.bench.engine import load_weights
from hkserve.model.build import build_model
from hkserve.model.paged_memory import KERNEL_ENV, decode_kernel, init_paged_memory


def paged_memory(config, rows: int, context: int, max_len: int, block_size: int, rng):
    """A pool of random keys and values (the two paths' logits differ where they read differently), every
    row's table of distinct shuffled blocks, its step in [context/2, context]."""
    per_row = -(-max_len // block_size)
    memory = init_paged_memory(config, rows, rows * per_row, block_size, max_len)
    k, v = (jax.random.normal(jax.random.PRNGKey(i), memory.k.shape, memory.k.dtype) for i in range(2))
    table = rng.permutation(rows * per_row).reshape(rows, per_row).astype(np.int32)
    steps = rng.integers(context // 2, context + 1, rows).astype(np.int32)
    return memory._replace(k=k, v=v, table=jnp.asarray(table), step=jnp.asarray(steps))


def compiled_step(model, path: str, attend_len: int):
    """The decode forward traced with `path`'s paged attention (a function of its own: its own trace)."""
    os.environ[KERNEL_ENV] = path

    def step(params, tokens, memory, lengths):
        return model.forward(params, tokens, memory, lengths, attend_len=attend_len)

    return jax.jit(step, donate_argnums=(2,))


def main() -> int:
    parser = argparse.ArgumentParser()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model")
    source.add_argument("--random")
    parser.add_argument("--rows", default="16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    name, config, params = load_weights(
        types.SimpleNamespace(random=args.random, model=args.model, kv_dtype="auto"), "bf16"
    )
    model = build_model(config)
    params = model.prepare(params) if model.prepare is not None else params
    kernel = "pallas" if jax.default_backend() == "gpu" else "interpret"
    longest = args.context + 1 + 2 * args.repeats * args.steps  # a row's length after the last timed step
    if longest > args.max_len:
        parser.error(f"--context {args.context} and {2 * args.repeats * args.steps} steps outgrow --max-len")
    attend_len = min(args.max_len, 1 << (longest - 1).bit_length())  # what the XLA path reads, a power of two
    report = {"model": name, "device": str(jax.devices()[0].device_kind), "kernel": kernel, "rows": {}}
    rng = np.random.default_rng(0)
    for rows in [int(r) for r in args.rows.split(",")]:
        memory = paged_memory(config, rows, args.context, args.max_len, args.block_size, rng)
        os.environ[KERNEL_ENV] = kernel
        report["kernel_used"] = decode_kernel(config, memory) is not None  # else it logged why not
        steps = {p: compiled_step(model, p, attend_len) for p in ("xla", kernel)}
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (rows, 1)), jnp.int32)
        ones = jnp.ones((rows,), jnp.int32)
        first = {}
        for path, step in steps.items():  # compile, and the same first step on each path
            logits, after = step(params, tokens, jax.tree_util.tree_map(jnp.copy, memory), ones)
            first[path] = np.asarray(logits, np.float32)[:, 0]
            memory = after._replace(step=memory.step)
        times = {p: [] for p in steps}
        for _ in range(args.repeats):
            for path, step in steps.items():
                start = time.perf_counter()
                for _ in range(args.steps):
                    logits, memory = step(params, tokens, memory, ones)
                logits.block_until_ready()
                times[path].append(1e3 * (time.perf_counter() - start) / args.steps)
        ms = {p: statistics.median(t) for p, t in times.items()}
        report["rows"][str(rows)] = {
            "xla_ms": ms["xla"],
            "pallas_ms": ms[kernel],
            "xla_over_pallas": ms["xla"] / ms[kernel],
            "max_abs_logit_diff": float(np.abs(first["xla"] - first[kernel]).max()),
            "greedy_equal": bool((first["xla"].argmax(-1) == first[kernel].argmax(-1)).all()),
        }
        print(json.dumps({str(rows): report["rows"][str(rows)]}), flush=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
