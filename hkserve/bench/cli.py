"""The `bench` subcommand and its benchmarks: engine, serve, soak, startup, moe, structured, spec, vq."""

from __future__ import annotations

import argparse

from hkserve.bench import engine as bench_engine
from hkserve.bench import moe as bench_moe
from hkserve.bench import prefix as bench_prefix
from hkserve.bench import serve as bench_serve
from hkserve.bench import soak as bench_soak
from hkserve.bench import spec as bench_spec
from hkserve.bench import startup as bench_startup
from hkserve.bench import steady as bench_steady
from hkserve.bench import structured as bench_structured
from hkserve.bench import vq as bench_vq
from hkserve.bench.random_models import RANDOM_CONFIGS
from hkserve.checkpoint.store import DEFAULT_MODEL
from hkserve.model.config import KV_DTYPES, WEIGHTS


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", default=DEFAULT_MODEL, help="a model of the store")
    source.add_argument(
        "--random",
        default=None,
        choices=list(RANDOM_CONFIGS),
        help="instead of a stored model: random weights of these shapes, made on the device in --dtype",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(WEIGHTS),
        help="weights of the measured engine and of the peer (default: bf16 on a GPU/TPU, f32 on a CPU)",
    )
    p.add_argument("--slots", type=_int_list, default=[1, 4, 16], help="comma list of slot counts (default 1,4,16)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed measurements per figure; the median is reported")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens prefilled into every slot")
    p.add_argument("--max-len", type=int, default=2048, help="context length of the KV memory")
    p.add_argument(
        "--hf-batches", type=_int_list, default=[1, 8], help="batch sizes of the transformers peer (default 1,8)"
    )
    p.add_argument(
        "--bandwidth-method",
        default="auto",
        choices=["auto", "host", "device"],
        help="host: numpy sums in host memory; device: a jitted copy in device memory (HBM); auto: device "
        "on an accelerator, host on a CPU",
    )
    p.add_argument("--bandwidth-mb", type=int, default=1024, help="array size of the bandwidth measurement")
    p.add_argument("--matmul-n", type=int, default=None, help="n of the n×n matmul (default 2048 on CPU, else 8192)")
    p.add_argument("--weights", default=None, help="also measure these stored weight variants, e.g. f32,bf16,int8")
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto", help="the KV memory's dtype (as serve's)")
    p.add_argument(
        "--background-load",
        action="store_true",
        help="instead: batch-1 decode quiet vs with one core busy, per --xla-threads setting (bench/steady.py)",
    )
    p.add_argument(
        "--xla-threads",
        default="pool,1",
        help="XLA CPU intra-op threading settings for --background-load: pool (XLA's default), 1",
    )
    p.add_argument(
        "--kernels",
        default=None,
        help="with --weights: measure each variant with these kernel paths instead (auto,xla), sides alternated; "
        "with --background-load: each XLA setting with each of these (for --dtype int8)",
    )
    p.add_argument(
        "--layers",
        choices=("auto", "scan", "loop"),
        default="auto",
        help="the decoder's blocks as a scan over stacked weights or a loop over per-layer ones (auto: loop on GPUs)",
    )
    p.add_argument("--llama-gguf", default=None, help="with --kernels: a GGUF file for the llama.cpp peer")
    p.add_argument("--llama-threads", type=int, default=2, help="threads of the llama.cpp peer")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """`bench` with its benchmarks as sub-subcommands: engine, serve, soak, moe, vq."""
    bench = subparsers.add_parser("bench", help="measure throughput (see docs/benchmarks.md)")
    kinds = bench.add_subparsers(dest="bench_command", required=True)

    p = kinds.add_parser("engine", help="decode tok/s of the Engine vs transformers and this machine's limits")
    add_engine_arguments(p)
    p.set_defaults(
        func=lambda args: (bench_steady.cmd_background_load if args.background_load else bench_engine.cmd_bench_engine)(
            args
        )
    )

    p = kinds.add_parser("serve", help="TTFT, inter-token latency and tok/s of the HTTP server under load")
    bench_serve.add_arguments(p)
    p.set_defaults(func=bench_serve.run)

    p = kinds.add_parser("prefix", help="prefix caching over HTTP: chat TTFT, unrelated-prompt throughput, by mode")
    bench_prefix.add_arguments(p)
    p.set_defaults(func=bench_prefix.run)

    p = kinds.add_parser("soak", help="steady mixed HTTP traffic for a while: the server's RSS and fds before/after")
    bench_soak.add_arguments(p)
    p.set_defaults(func=bench_soak.run)

    p = kinds.add_parser("startup", help="seconds and memory of `serve` to /health 200, cold and warm compile cache")
    bench_startup.add_arguments(p)
    p.set_defaults(func=bench_startup.run)

    p = kinds.add_parser("moe", help="decode tok/s of a random grok-style MoE: used experts only vs all experts")
    bench_moe.add_arguments(p)
    p.set_defaults(func=bench_moe.run)

    p = kinds.add_parser("structured", help="decode tok/s with every slot constrained by a JSON schema vs none")
    bench_structured.add_arguments(p)
    p.set_defaults(func=bench_structured.run)
    p = kinds.add_parser("spec", help="tok/s with speculative decoding (n-gram lookup) on vs off: edit and chat")
    bench_spec.add_arguments(p)
    p.set_defaults(func=bench_spec.run)

    p = kinds.add_parser("vq", help="per-token decode time and memory per slot: Transformer-VQ vs KV by context")
    bench_vq.add_arguments(p)
    p.set_defaults(func=bench_vq.run)
    return bench
