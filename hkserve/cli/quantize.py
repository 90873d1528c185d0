"""`hkserve quantize`: the int4 or int8 variant of a stored float model (an HF safetensors checkpoint or a
float GGUF that `convert` imported), made from its float master, stored beside it and recorded as the
variant `serve` runs on a CPU; with --text, its perplexity cost against the master is measured on the spot."""

from __future__ import annotations

import sys
from pathlib import Path

from hkserve.checkpoint.store import ModelStore
from hkserve.cli.eval_ppl import perplexity
from hkserve.kernels.dispatch import add_kernels_argument, resolve

QUANTIZED = ("int8", "int4")


def add_arguments(p) -> None:
    p.add_argument("name", help="a model in the store with float (float32 | bfloat16) weights")
    p.add_argument("--weights", required=True, choices=QUANTIZED, help="the variant to make")
    p.add_argument("--text", default=None, help="a UTF-8 text file: report the variant's perplexity against float")
    p.add_argument("--window", type=int, default=512, help="tokens per forward of the perplexity (as eval-ppl's)")
    add_kernels_argument(p)  # the variant's perplexity as served: auto = the CPU kernels


def run(args) -> int:
    store = ModelStore()
    stored = store.info(args.name).config.dtype
    if stored not in ("float32", "bfloat16"):
        raise ValueError(
            f"model {args.name!r} stores {stored} weights, not a float master: quantizing them again would round "
            f"twice; convert its source with `--weights f32` first (or `--weights {args.weights}` directly)"
        )
    path = store.variant_path(args.name, args.weights)  # made from the master if missing
    store.set_cpu_default(args.name, args.weights)
    sizes = store.variant_sizes(args.name)
    print(
        f"{args.name}: {args.weights} {sizes[path.name.removeprefix('params-')] / 1e6:.1f} MB at {path} "
        f"({stored} {sizes[stored] / 1e6:.1f} MB); CPU default {args.weights}",
        flush=True,
    )
    if args.text:
        ids = store.tokenizer(args.name).encode(Path(args.text).read_text())
        base, count = perplexity(store.config(args.name), store.params(args.name), ids, args.window)
        config = store.config(args.name, args.weights)
        kernels = resolve(args.kernels, config.dtype, config.memory)
        ppl, _ = perplexity(config, store.params(args.name, weights=args.weights), ids, args.window, kernels)
        print(
            f"perplexity over {count} tokens: {stored} {base:.4f}, {args.weights} {ppl:.4f} "
            f"({100 * (ppl / base - 1):+.2f}%)",
            flush=True,
        )
    sys.stdout.flush()
    return 0
