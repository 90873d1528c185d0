"""`hkserve bench engine`: decode throughput of the Engine, next to a peer and to this machine's limits.

A throughput figure alone says little, so one run measures three things on the same weights:
  * hkserve: the Engine decoding with every slot active, read one step behind as the runner does;
  * the peer (bench/peer.py): Hugging Face transformers greedy decoding with its KV cache, in the same
    dtype, on the GPU when JAX runs on one;
  * the limits (bench/limits.py): memory bandwidth (→ tok/s if every step must stream all weights) and
    matmul FLOP/s in the weights' dtype (→ tok/s if every token costs 2 FLOPs per weight).
The weights are a stored model (--model) or random ones of real shapes made on the device (--random).
Results go to stdout (a table; with --json the last line is one JSON object), progress to stderr.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

import jax
import numpy as np

from hkserve.bench.kernels import bench_kernels, print_kernels
from hkserve.bench.limits import cpu_busy, measure_bandwidth, measure_matmul, weights_per_token
from hkserve.bench.peer import WARMUP_STEPS, run_peer
from hkserve.bench.random_models import random_config, random_params
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE, block_bytes
from hkserve.engine.options import EngineOptions
from hkserve.model import layer_loop
from hkserve.model.build import build_model
from hkserve.model.config import WEIGHTS, default_weights, with_kv_dtype
from hkserve.model.sampling import SamplingParams


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def decode_seconds(step, steps: int) -> float:
    """Seconds for `steps` dispatches of `step()` read one step behind (dispatch k, then read k-1),
    as hkserve/engine/runner.py does, so the host never makes the device wait."""
    start = time.perf_counter()
    previous = None
    for _ in range(steps):
        pending = step()
        if previous is not None:
            previous.read()
        previous = pending
    if previous is not None:
        previous.read()
    return time.perf_counter() - start


def bench_hkserve(model, params, slots: int, prompts: np.ndarray, steps: int, repeats: int, max_len: int) -> float:
    """Decode tok/s of an Engine with `slots` slots, all active, greedy; median over repeats.

    Each repeat prefills every slot afresh, so all repeats decode the same positions (and attention
    windows). A first untimed pass compiles the prefill and every window the timed steps reach."""
    # The pool the static layout would reserve (slots x max_len), on every backend: an accelerator's
    # default pool (what its free memory holds, ~87 GB on an H200) costs start-up and memory, not speed.
    blocks = slots * -(-max_len // DEFAULT_BLOCK_SIZE)
    kv_mb = blocks * block_bytes(model.config, DEFAULT_BLOCK_SIZE) / 2**20
    engine = Engine(model, params, EngineOptions(slots=slots, max_len=max_len, kv_cache_mb=kv_mb))
    if prompts.shape[1] + WARMUP_STEPS + steps >= engine.max_len:
        raise ValueError(
            f"prompt {prompts.shape[1]} + {WARMUP_STEPS + steps} steps do not fit max_len {engine.max_len}"
        )
    active = np.ones(slots, bool)
    times = []
    for repeat in range(repeats + 1):
        for slot in range(slots):
            first = engine.prefill(slot, prompts[slot].tolist(), SamplingParams())
        first.read()
        decode_seconds(lambda: engine.step(active), WARMUP_STEPS)
        seconds = decode_seconds(lambda: engine.step(active), steps)
        if repeat:
            times.append(seconds)
    return slots * steps / statistics.median(times)


def load_weights(args, weights: str):
    """(name, config, params) of the measured model: from the store, or random of a known shape."""
    if args.random:
        config = with_kv_dtype(random_config(args.random, WEIGHTS[weights]), args.kv_dtype)
        _log(f"random {args.random}: {config.n_params / 1e9:.2f}B params in {config.dtype}, made on the device")
        return f"random:{args.random}", config, random_params(config)
    store = ModelStore()
    config = with_kv_dtype(store.config(args.model, weights), args.kv_dtype)
    return args.model, config, store.params(args.model, weights=weights)


def _ratio(a, b):
    return a / b if a is not None and b else None


def cmd_bench_engine(args) -> int:
    backend = jax.default_backend()
    weights = default_weights(backend, args.dtype)
    name, config, params = load_weights(args, weights)
    model = build_model(config, layers=None if args.layers == "auto" else args.layers)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (max(args.slots + args.hf_batches), args.prompt_len), np.int32)

    busy = cpu_busy()
    if busy is not None and busy > 0.1:
        _log(
            f"WARNING: the CPUs were {100 * busy:.0f}% busy before the benchmark: other processes share them "
            f"and the figures may be low"
        )
    _log("limits: measuring memory bandwidth and matmul FLOP/s ...")
    bandwidth = measure_bandwidth(args.bandwidth_method, args.bandwidth_mb)
    matmul_dtype = "bfloat16" if config.dtype == "bfloat16" else "float32"
    matmul_n = args.matmul_n or (2048 if backend == "cpu" else 8192)
    flops = measure_matmul(matmul_n, matmul_dtype)
    # int4: a nibble and a float32 scale and min per 32 weights (0.75 bytes; its int8 embeddings counted so too)
    weight_bytes = weights_per_token(config) * (0.75 if config.dtype == "int4" else np.dtype(config.dtype).itemsize)
    bandwidth_tok_s = bandwidth / weight_bytes  # batch 1: every step streams all weights
    compute_tok_s = flops / (2 * weights_per_token(config))  # any batch: 2 FLOPs per weight per token

    ours = {}
    for slots in args.slots:
        _log(f"hkserve: {slots} slots ...")
        start = time.perf_counter()
        ours[slots] = bench_hkserve(model, params, slots, prompts[:slots], args.steps, args.repeats, args.max_len)
        _log(f"hkserve: {slots} slots: {ours[slots]:.1f} tok/s ({time.perf_counter() - start:.0f} s with compiling)")
    peer, versions = run_peer(config, params, prompts, args.hf_batches, args.steps, args.repeats)

    lo, hi = min(args.slots), max(args.slots)
    hf_lo, hf_hi = min(args.hf_batches), max(args.hf_batches)
    peer = peer or {}
    ratios = {
        f"hkserve_{lo}_over_hf_{hf_lo}": _ratio(ours[lo], peer.get(hf_lo)),
        f"hkserve_{hi}_over_hf_{hf_hi}": _ratio(ours[hi], peer.get(hf_hi)),
        f"hkserve_{lo}_over_bandwidth_limit": _ratio(ours[lo], lo * bandwidth_tok_s),
        f"hkserve_{hi}_over_compute_limit": _ratio(ours[hi], compute_tok_s),
    }
    env = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "backend": backend,
        "layers": layer_loop.default_mode() if args.layers == "auto" else args.layers,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "cpu_busy_before": busy,
        **versions,
    }

    def by_batch(d):
        return {str(k): v for k, v in d.items()} or None

    report = {
        "model": name,
        "dtype": config.dtype,
        "n_params": config.n_params,
        "hkserve": by_batch(ours),
        "hf_transformers": by_batch(peer),
        "limits": {
            "bandwidth_method": args.bandwidth_method,
            "bandwidth_gb_s": bandwidth / 1e9,
            "bandwidth_tok_s": bandwidth_tok_s,
            "matmul_dtype": matmul_dtype,
            "matmul_n": matmul_n,
            "matmul_gflop_s": flops / 1e9,
            "compute_tok_s": compute_tok_s,
            "weight_bytes_per_step": weight_bytes,
        },
        "ratios": ratios,
        "env": env,
        "settings": {
            "steps": args.steps,
            "prompt_len": args.prompt_len,
            "repeats": args.repeats,
            "max_len": args.max_len,
        },
    }
    if args.weights:
        if args.random:
            raise ValueError("--weights measures stored weight variants: it needs --model, not --random")
        if args.kernels:
            report["by_kernels"] = bench_kernels(ModelStore(), args, prompts, [lo, hi])
        else:
            report["by_weights"] = bench_weight_variants(ModelStore(), args, prompts, bandwidth, [lo, hi])
    print_table(report, config)
    if "by_kernels" in report:
        print_kernels(report["by_kernels"])
    if args.json:
        print(json.dumps(report))
    sys.stdout.flush()
    return 0


def bench_weight_variants(store, args, prompts, bandwidth: float, slot_counts: list[int]) -> dict:
    """Decode tok/s per weight variant (f32 | bf16 | int8), with each variant's bandwidth limit."""
    out = {}
    for weights in args.weights.split(","):
        config = with_kv_dtype(store.config(args.model, weights), args.kv_dtype)
        params = store.params(args.model, weights=weights)
        nbytes = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(params))
        figures = {
            str(n): bench_hkserve(build_model(config), params, n, prompts[:n], args.steps, args.repeats, args.max_len)
            for n in slot_counts
        }
        out[weights] = {**figures, "weight_bytes": nbytes, "bandwidth_tok_s": bandwidth / nbytes}
        _log(
            f"{weights}: {', '.join(f'{k} slots {v:.1f} tok/s' for k, v in figures.items())}; "
            f"bandwidth limit {bandwidth / nbytes:.1f} tok/s at batch 1"
        )
    return out


def _pct(value, limit) -> str:
    return f"{100 * value / limit:.1f}%" if value is not None and limit else "-"


def print_table(report: dict, config) -> None:
    """The human-readable report: settings, machine, limits, one row per measurement, ratios."""
    env, limits, settings = report["env"], report["limits"], report["settings"]
    bw_tok_s, compute_tok_s = limits["bandwidth_tok_s"], limits["compute_tok_s"]
    print(
        f"hkserve bench engine: {report['model']} ({config.n_params / 1e6:.1f}M params, {config.dtype}, "
        f"{config.n_layers} layers), prompt {settings['prompt_len']} tokens, {settings['steps']} timed greedy "
        f"decode steps, median of {settings['repeats']}"
    )
    peer_env = (
        f", torch {env['torch']} ({env['torch_threads']} threads, peer on {env['peer_device']}), "
        f"transformers {env['transformers']}"
        if "torch" in env
        else ""
    )
    busy = "" if env["cpu_busy_before"] is None else f", CPUs {100 * env['cpu_busy_before']:.0f}% busy before the run"
    print(
        f"machine: {env['cpus']} CPUs ({env['machine']}), jax {env['jax']} on {env['backend']} ({env['device']})"
        f"{peer_env}, {env['date']}{busy}"
    )
    print(
        f"limits: {limits['bandwidth_method']} memory bandwidth {limits['bandwidth_gb_s']:.1f} GB/s / "
        f"{limits['weight_bytes_per_step'] / 1e6:.0f} MB of weights per step = {bw_tok_s:.1f} tok/s at batch 1 "
        f"(N x that at batch N); {limits['matmul_dtype']} matmul {limits['matmul_gflop_s']:.1f} GFLOP/s / "
        f"{2 * weights_per_token(config) / 1e6:.0f} MFLOP per token = {compute_tok_s:.1f} tok/s"
    )
    print(f"{'engine':<14}{'batch':>6}{'tok/s':>10}{'ms/step':>10}{'% bandwidth limit':>19}{'% compute limit':>17}")
    for name, key in (("hkserve", "hkserve"), ("transformers", "hf_transformers")):
        for n, tok_s in (report[key] or {}).items():
            n = int(n)
            print(
                f"{name:<14}{n:>6}{tok_s:>10.1f}{1e3 * n / tok_s:>10.1f}{_pct(tok_s, n * bw_tok_s):>19}"
                f"{_pct(tok_s, compute_tok_s):>17}"
            )
    if report["hf_transformers"] is None:
        print("transformers: skipped (see stderr)")
    for key, value in report["ratios"].items():
        print(f"{key}: {'-' if value is None else f'{value:.3f}'}")
