"""`hkserve bench moe`: decode tok/s of a random ~100M-parameter grok-style MoE (8 experts, top-2),
computing only the experts tokens use vs every expert for every token (grok-1's released code)."""

from __future__ import annotations

import json
import time

import jax
import numpy as np

from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.model.build import build_model
from hkserve.model.config import grok_config
from hkserve.model.sampling import SamplingParams


def add_arguments(p) -> None:
    p.add_argument("--slots", default="1,16", help="comma list of slot counts")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--json", action="store_true")


def bench_config(**changes):
    """~110M parameters: 8 layers of d=512, 8 query / 2 kv heads, 8 experts of ffn 896, vocab 32768."""
    return grok_config(
        vocab_size=32768,
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=2,
        head_dim=64,
        ffn_dim=896,
        attn_multiplier=64**-0.5,
        embedding_multiplier=512**0.5,
        **changes,
    )


def decode_tok_s(config, params, slots: int, steps: int) -> float:
    engine = Engine(build_model(config), params, EngineOptions(slots=slots, max_len=256, prefill_buckets=(32,)))
    rng = np.random.default_rng(0)
    for slot in range(slots):  # random prompts spread the routing like real text would
        engine.prefill(
            slot, rng.integers(0, config.vocab_size, 24).tolist(), SamplingParams(temperature=1.0, seed=slot)
        )
    active = np.ones(slots, bool)
    for _ in range(3):
        engine.step(active).read()
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        pending = [engine.step(active) for _ in range(steps)]
        pending[-1].read()
        best = min(best, time.perf_counter() - started)
        engine.positions[:] = 24  # stay in the same attention window
    return slots * steps / best


def run(args) -> int:
    slot_counts = [int(x) for x in args.slots.split(",")]
    config = bench_config()
    params = build_model(config).init(jax.random.PRNGKey(0))
    print(
        f"random grok-style MoE: {config.n_params / 1e6:.0f}M params, {config.n_experts} experts top-"
        f"{config.n_experts_per_token}, {config.n_layers} layers, d={config.dim}",
        flush=True,
    )
    report = {}
    for mode, dense in (("used_experts", False), ("all_experts", True)):
        report[mode] = {}
        for slots in slot_counts:
            tok_s = decode_tok_s(config.replace(moe_dense=dense), params, slots, args.steps)
            report[mode][str(slots)] = tok_s
            print(f"{mode:13s} slots {slots:>3}: {tok_s:8.1f} tok/s", flush=True)
    for slots in slot_counts:
        s = str(slots)
        print(f"speed-up at {slots} slots: {report['used_experts'][s] / report['all_experts'][s]:.2f}x")
    if args.json:
        print(json.dumps(report))
    return 0
