"""`hkserve bench engine`: decode throughput of the Engine, next to a peer and to this machine's limits.

A throughput figure alone says little, so one run measures three things on the same weights:
  * hkserve: the Engine decoding with every slot active, read one step behind as the runner does;
  * the peer: Hugging Face transformers (torch, float32) greedy decoding with its KV cache;
  * the limits: memory read bandwidth (→ tok/s if every step must stream all weights) and float32
    matmul FLOP/s (→ tok/s if every token costs 2 FLOPs per weight).
Results go to stdout (a table; with --json the last line is one JSON object), progress to stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.bench import moe as bench_moe
from hkserve.bench import serve as bench_serve
from hkserve.bench import soak as bench_soak
from hkserve.bench import vq as bench_vq
from hkserve.checkpoint.hf_write import write_hf_checkpoint
from hkserve.checkpoint.store import DEFAULT_MODEL, ModelStore
from hkserve.engine.engine import Engine
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory
from hkserve.model.sampling import SamplingParams

WARMUP_STEPS = 2


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# -- limits -------------------------------------------------------------------------------------
def measure_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Best memory read bandwidth (bytes/s): numpy sums of an array far larger than the caches, one
    chunk per core (numpy releases the GIL), since the engine's step also runs on every core."""
    data = np.full(megabytes * 2**20 // 4, 1.0, np.float32)
    chunks = np.array_split(data, os.cpu_count() or 1)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(len(chunks)) as pool:
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, chunks))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def measure_matmul(n: int = 2048, repeats: int = 10) -> float:
    """Best float32 matmul FLOP/s of XLA on this backend (jit of an n×n dot, after its compile)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.float32)
    dot = jax.jit(jnp.dot)
    dot(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Fraction of the machine's CPU time used over `seconds` (Linux /proc/stat; None elsewhere):
    other work running beside the benchmark lowers every figure, so the report says how busy it was."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return round(1 - (idle1 - idle0) / max(total1 - total0, 1), 3)


def weights_per_token(config) -> int:
    """Weights one decode step reads and multiplies: all of them, except that an untied input
    embedding table is only indexed (one row per token). A tied table counts once, as the head."""
    return config.n_params - (0 if config.tie_embeddings else config.vocab_size * config.dim)


# -- hkserve ------------------------------------------------------------------------------------
def _decode(step, steps: int) -> float:
    """Seconds for `steps` dispatches of `step()` read one step behind (dispatch k, then read k-1),
    as server/runner.py does, so the host never makes the device wait."""
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
    engine = Engine(model, params, slots=slots, max_len=max_len)
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
        _decode(lambda: engine.step(active), WARMUP_STEPS)
        seconds = _decode(lambda: engine.step(active), steps)
        if repeat:
            times.append(seconds)
    return slots * steps / statistics.median(times)


# -- Hugging Face transformers peer -------------------------------------------------------------
def load_hf_peer(config, params):
    """The transformers model on our weights, loaded the way a user would: save an HF checkpoint
    (config.json + safetensors) and `from_pretrained` it, so transformers applies its own layout."""
    import torch  # the optional peer's heavy dependencies stay out of hkserve's import path
    import transformers

    with tempfile.TemporaryDirectory(prefix="hkserve-bench-") as tmp:
        write_hf_checkpoint(config, params, tmp)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp)
    return model.to(torch.float32).eval()


def peer_logits_error(hf_model, model, params, prompt: np.ndarray) -> float:
    """Max |logit difference| between the peer and our forward pass on one prompt [T]."""
    import torch

    ids = np.asarray(prompt, np.int32)[None]
    memory = init_memory(model.config, 1, ids.shape[1])
    ours, _ = jax.jit(model.forward)(params, ids, memory, np.asarray([ids.shape[1]], np.int32))
    with torch.inference_mode():
        theirs = hf_model(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.float().numpy()
    return float(np.max(np.abs(np.asarray(ours, np.float32) - theirs)))


def bench_hf(hf_model, prompts: np.ndarray, steps: int, repeats: int) -> float:
    """Greedy decode tok/s of the peer at batch len(prompts): a manual loop over its KV cache, so
    only decode steps are timed, not prefill or generate()'s bookkeeping."""
    import inspect

    import torch

    # transformers 5.2x renamed `past_key_values` to `cache` (argument and output); accept either.
    key = "cache" if "cache" in inspect.signature(hf_model.forward).parameters else "past_key_values"
    batch, prompt_len = prompts.shape
    times = []
    with torch.inference_mode():
        for repeat in range(repeats + 1):
            out = hf_model(input_ids=torch.from_numpy(prompts.astype(np.int64)), use_cache=True)
            for i in range(WARMUP_STEPS + steps):
                if i == WARMUP_STEPS:
                    start = time.perf_counter()
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                out = hf_model(input_ids=token, use_cache=True, **{key: out[key]})
            token = out.logits[:, -1].argmax(-1)  # the last step's tokens on the host, as hkserve reads them
            if repeat:
                times.append(time.perf_counter() - start)
            cached = out[key].get_seq_length()
            if cached != prompt_len + WARMUP_STEPS + steps:
                raise RuntimeError(
                    f"the peer's KV cache holds {cached} positions, expected "
                    f"{prompt_len + WARMUP_STEPS + steps}: it is not decoding incrementally"
                )
    return batch * steps / statistics.median(times)


def run_peer(config, model, params, prompts: np.ndarray, batches: list[int], steps: int, repeats: int):
    """{batch: tok/s} for the transformers peer, or None (with the reason on stderr)."""
    try:
        import torch
        import transformers
    except ImportError as e:
        _log(f"peer skipped: torch/transformers not importable ({e}); `pip install -e '.[bench]'`")
        return None, {}
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    _log(
        f"peer: transformers {transformers.__version__}, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads, torch's default)"
    )
    hf_model = load_hf_peer(config, params)
    error = peer_logits_error(hf_model, model, params, prompts[0, :16])
    _log(f"peer: max |logit difference| vs hkserve = {error:.2e}")
    if not error <= 1e-3:
        _log(
            f"WARNING: the peer's logits differ from ours by {error:.2e} (> 1e-3): weight conversion is wrong; "
            f"peer skipped"
        )
        return None, versions
    results = {}
    for batch in batches:
        _log(f"peer: batch {batch} ...")
        results[batch] = bench_hf(hf_model, prompts[:batch], steps, repeats)
    return results, versions


# -- the command --------------------------------------------------------------------------------
def _pct(value, limit) -> str:
    return f"{100 * value / limit:.1f}%" if value is not None and limit else "-"


def _ratio(a, b):
    return a / b if a is not None and b else None


def cmd_bench_engine(args) -> int:
    store = ModelStore()
    info = store.info(args.model)
    config = info.config
    params = store.params(args.model)
    model = build_model(config)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, config.vocab_size, (max(args.slots + args.hf_batches), args.prompt_len), np.int32)

    busy = cpu_busy()
    if busy is not None and busy > 0.1:
        _log(
            f"WARNING: the CPUs were {100 * busy:.0f}% busy before the benchmark: other processes share them "
            f"and the figures may be low"
        )
    _log("limits: measuring memory bandwidth and matmul FLOP/s ...")
    bandwidth = measure_bandwidth(args.bandwidth_mb)
    flops = measure_matmul()
    weights = weights_per_token(config)
    weight_bytes = weights * np.dtype(jax.numpy.dtype(config.dtype)).itemsize
    bandwidth_tok_s = bandwidth / weight_bytes  # batch 1: every step streams all weights
    compute_tok_s = flops / (2 * weights)  # any batch: 2 FLOPs per weight per token

    ours = {}
    for slots in args.slots:
        _log(f"hkserve: {slots} slots ...")
        ours[slots] = bench_hkserve(model, params, slots, prompts[:slots], args.steps, args.repeats, args.max_len)
    peer, versions = run_peer(config, model, params, prompts, args.hf_batches, args.steps, args.repeats)

    lo, hi = min(args.slots), max(args.slots)
    hf_lo, hf_hi = min(args.hf_batches), max(args.hf_batches)
    ratios = {
        f"hkserve_{lo}_over_hf_{hf_lo}": _ratio(ours[lo], (peer or {}).get(hf_lo)),
        f"hkserve_{hi}_over_hf_{hf_hi}": _ratio(ours[hi], (peer or {}).get(hf_hi)),
        f"hkserve_{lo}_over_bandwidth_limit": _ratio(ours[lo], lo * bandwidth_tok_s),
        f"hkserve_{hi}_over_compute_limit": _ratio(ours[hi], compute_tok_s),
    }
    env = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "cpu_busy_before": busy,
        **versions,
    }

    def by_batch(d):
        return None if d is None else {str(k): v for k, v in d.items()}

    report = {
        "model": args.model,
        "hkserve": by_batch(ours),
        "hf_transformers": by_batch(peer),
        "limits": {
            "bandwidth_gb_s": bandwidth / 1e9,
            "bandwidth_tok_s": bandwidth_tok_s,
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
        report["by_weights"] = bench_weight_variants(store, args, prompts, bandwidth, [lo, hi])
    print_table(report, config)
    if args.json:
        print(json.dumps(report))
    sys.stdout.flush()
    return 0


def bench_weight_variants(store, args, prompts, bandwidth: float, slot_counts: list[int]) -> dict:
    """Decode tok/s per weight variant (f32 | bf16 | int8), with each variant's bandwidth limit."""
    out = {}
    for weights in args.weights.split(","):
        config = store.config(args.model, weights)
        params = store.params(args.model, weights=weights)
        nbytes = sum(leaf.nbytes for leaf in jax_leaves(params))
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


def jax_leaves(tree) -> list:
    return jax.tree_util.tree_leaves(tree)


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
        f", torch {env['torch']} ({env['torch_threads']} threads), transformers {env['transformers']}"
        if "torch" in env
        else ""
    )
    busy = "" if env["cpu_busy_before"] is None else f", CPUs {100 * env['cpu_busy_before']:.0f}% busy before the run"
    print(
        f"machine: {env['cpus']} CPUs ({env['machine']}), jax {env['jax']} on {env['backend']}{peer_env}, "
        f"{env['date']}{busy}"
    )
    print(
        f"limits: memory read {limits['bandwidth_gb_s']:.1f} GB/s / {limits['weight_bytes_per_step'] / 1e6:.0f} MB "
        f"of weights per step = {bw_tok_s:.1f} tok/s at batch 1 (N x that at batch N); float32 matmul "
        f"{limits['matmul_gflop_s']:.1f} GFLOP/s / {2 * weights_per_token(config) / 1e6:.0f} MFLOP per token "
        f"= {compute_tok_s:.1f} tok/s"
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


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """`bench` with its benchmarks as sub-subcommands: engine, serve, soak, moe, vq."""
    bench = subparsers.add_parser("bench", help="measure throughput (see docs/benchmarks.md)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    p = kinds.add_parser("engine", help="decode tok/s of the Engine vs transformers and this machine's limits")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--slots", type=_int_list, default=[1, 4, 16], help="comma list of slot counts (default 1,4,16)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed measurements per figure; the median is reported")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens prefilled into every slot")
    p.add_argument("--max-len", type=int, default=2048, help="context length of the KV memory")
    p.add_argument(
        "--hf-batches", type=_int_list, default=[1, 8], help="batch sizes of the transformers peer (default 1,8)"
    )
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="array size of the bandwidth measurement")
    p.add_argument("--weights", default=None, help="also measure these weight variants, e.g. f32,bf16,int8")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    p.set_defaults(func=cmd_bench_engine)

    p = kinds.add_parser("serve", help="TTFT, inter-token latency and tok/s of the HTTP server under load")
    bench_serve.add_arguments(p)
    p.set_defaults(func=bench_serve.run)

    p = kinds.add_parser("soak", help="steady mixed HTTP traffic for a while: the server's RSS and fds before/after")
    bench_soak.add_arguments(p)
    p.set_defaults(func=bench_soak.run)

    p = kinds.add_parser("moe", help="decode tok/s of a random grok-style MoE: used experts only vs all experts")
    bench_moe.add_arguments(p)
    p.set_defaults(func=bench_moe.run)

    p = kinds.add_parser("vq", help="per-token decode time and memory per slot: Transformer-VQ vs KV by context")
    bench_vq.add_arguments(p)
    p.set_defaults(func=bench_vq.run)
    return bench
