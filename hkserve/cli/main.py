"""`hkserve` command line: pull | convert | quantize | models | serve | sample | bench | eval-ppl | generate |
logits, and the training commands of train/cli.py (train | train-vocab | validation | test).

Results go to stdout, everything else (progress, timings, logs) to stderr, so output can be piped.
"""

from __future__ import annotations

import argparse
import gc
import sys

from hkserve.bench.cli import add_bench_parser
from hkserve.checkpoint.convert import convert, pull
from hkserve.checkpoint.store import DEFAULT_MODEL, ModelStore
from hkserve.cli import eval_ppl, logits, quantize
from hkserve.cli.compile_cache import enable_compile_cache
from hkserve.cli.generate import run_generate
from hkserve.cli.loading import add_kv_arguments, add_prefix_cache_argument, add_variant_arguments
from hkserve.cli.sample import add_arguments as add_sample_arguments
from hkserve.cli.sample import run
from hkserve.cli.serve import (
    add_compile_argument,
    add_limit_arguments,
    add_loaded_programs_argument,
    add_parser_arguments,
    add_step_tokens_argument,
    add_web_argument,
    run_server,
)
from hkserve.cli.speculative import add_arguments as add_speculative_arguments
from hkserve.cli.xla_flags import apply_gpu_defaults
from hkserve.model.config import WEIGHTS
from hkserve.train.cli import register as add_train_parsers

VARIANT_HELP = (
    "the weight variant to store, served by default on a CPU if int8/int4 (default: a quantized GGUF's own "
    "precision, int4 for 4-bit files from their blocks, int8 for Q8_0 and k-quant mixes, stored alone without a "
    "float32 master; float sources keep their float32 master beside it; f32 = the float32 master only)"
)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_pull(args) -> int:
    store = ModelStore()
    pull(args.name, store, progress=not args.quiet, weights=args.weights)
    if args.weights is not None:  # a model pulled before: its variant made from the stored params now
        store.variant_path(args.name, args.weights)
    return 0


def cmd_convert(args) -> int:
    store = ModelStore()
    path = convert(args.path, args.name, store, overwrite=args.overwrite, progress=not args.quiet, weights=args.weights)
    _log(f"{args.name} stored at {path}")
    return 0


def cmd_models(args) -> int:
    models, damaged = ModelStore().scan()
    for problem in damaged:
        _log(str(problem))
    if not models and not damaged:
        _log(f"no models in {ModelStore().models_dir}; run `hkserve pull`")
    for m in models:
        c = m.config
        sizes = ", ".join(f"{dtype} {size / 1e6:.1f} MB" for dtype, size in ModelStore().variant_sizes(m.name).items())
        print(
            f"{m.name}\t{c.n_params / 1e6:.0f}M params\t{c.dtype}\t{c.n_layers} layers\tctx {c.context_length}"
            f"\t{m.source.get('format', '?')}\t{sizes}\tCPU default {m.source.get('weights', 'f32')}\t{m.path}"
        )
    return 0


def cmd_sample(args) -> int:
    return run(args)


def cmd_serve(args) -> int:
    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hkserve", description="JAX + Haiku LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download and convert a known model into the store")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--weights", default=None, choices=list(WEIGHTS), help=VARIANT_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("convert", help="import a local GGUF file or Hugging Face directory")
    p.add_argument("path")
    p.add_argument("--name", required=True)
    p.add_argument("--weights", default=None, choices=list(WEIGHTS), help=VARIANT_HELP)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("quantize", help="make a stored float model's int4/int8 variant, its CPU default")
    quantize.add_arguments(p)
    p.set_defaults(func=quantize.run)

    p = sub.add_parser("models", help="list the model store")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together")
    p.add_argument("--mesh", default=None, help="DATAxMODEL device mesh, e.g. 1x8 or 2x4")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    add_step_tokens_argument(p)
    add_compile_argument(p)
    add_loaded_programs_argument(p)
    p.add_argument(
        "--max-len",
        type=int,
        default=2048,
        help="the longest a request may grow (prompt + reply); --kv-layout static: every slot reserves it",
    )
    p.add_argument(
        "--prefill-rows",
        type=int,
        default=4,
        help="short prompts prefilled together in one call (rows of the smallest bucket; 0 or 1: one per call)",
    )
    p.add_argument("--max-logprobs", type=int, default=20, help="most top_logprobs a request may ask for")
    add_variant_arguments(p)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env HKSERVE_API_KEY)")
    p.add_argument("--cors-origin", action="append", help="allowed CORS origin (repeatable)")
    add_web_argument(p)
    add_parser_arguments(p)
    add_prefix_cache_argument(p)
    add_kv_arguments(p)
    add_limit_arguments(p.add_argument_group("client limits (what one client may cost the server)"))
    add_speculative_arguments(p)
    g = p.add_argument_group("multi-host (see docs/deploy.md)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of host 0 (env HKSERVE_COORDINATOR)")
    g.add_argument("--num-hosts", type=int, default=None, help="hosts serving this model (env HKSERVE_NUM_HOSTS)")
    g.add_argument("--host-id", type=int, default=None, help="this host, 0..N-1; 0 serves HTTP (env HKSERVE_HOST_ID)")
    g.add_argument(
        "--hosts-mesh",
        default=None,
        help="DATAxMODEL tiling of the hosts, default Nx1 (env HKSERVE_HOSTS_MESH); --mesh tiles each host's devices",
    )
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sample", help="complete every prompt of a JSONL file (resumable)")

    add_sample_arguments(p)
    add_speculative_arguments(p)
    p.set_defaults(func=cmd_sample)

    add_bench_parser(sub)

    p = sub.add_parser("eval-ppl", help="perplexity of a model (weight variant) on a text file")
    eval_ppl.add_arguments(p)
    p.set_defaults(func=eval_ppl.run)

    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt", nargs="?", default=None, help="text; or --ids")
    p.add_argument("--ids", default=None, help="prompt as comma-separated token ids (no tokenizer needed)")
    p.add_argument("--output-ids", action="store_true", help="print the generated ids, comma-separated")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--chat", action="store_true", help="render PROMPT as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-len", type=int, default=2048, help="the longest the request may grow (prompt + reply)")
    p.add_argument(
        "--mesh",
        default=None,
        help="DATAxMODEL device mesh, e.g. 1x8 or 2x4 (default: all on model "
        "if that divides the heads, else all on data)",
    )
    add_variant_arguments(p)
    add_kv_arguments(p)
    add_speculative_arguments(p)
    p.set_defaults(func=run_generate)

    p = sub.add_parser("logits", help="float32 logits of a full forward pass at every position")
    logits.add_arguments(p)
    p.set_defaults(func=logits.run_logits)

    add_train_parsers(sub)  # train, train-vocab, validation, test
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        apply_gpu_defaults()  # before the first device use starts JAX's backend
        enable_compile_cache()
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        _log(f"hkserve {args.command}: error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        # Collect the command's engine (its arrays and executables sit in reference cycles) here, on the
        # main thread. Left to shutdown, jax 0.11 could collect them on one of XLA's own threads, which then
        # aborted the process ("terminate called without an active exception", 2 runs in 5 of
        # `hkserve generate` on the CPU) after the command had finished.
        gc.collect()


if __name__ == "__main__":
    sys.exit(main())
