"""`hkserve` command line: pull | convert | models | serve | sample | bench | eval-ppl | generate, and the
training commands of train/cli.py (train | train-vocab | validation | test).

Results go to stdout, everything else (progress, timings, logs) to stderr, so output can be piped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from checkpoint.store import DEFAULT_MODEL, ModelStore
from model.config import WEIGHTS


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_pull(args) -> int:
    from checkpoint.convert import pull

    store = ModelStore()
    pull(args.name, store, progress=not args.quiet)
    if args.weights != "f32":
        store.params(args.name, weights=args.weights)  # makes and stores the variant once
    return 0


def cmd_convert(args) -> int:
    from checkpoint.convert import convert

    store = ModelStore()
    path = convert(args.path, args.name, store, overwrite=args.overwrite, progress=not args.quiet)
    if args.weights != "f32":
        store.params(args.name, weights=args.weights)
    _log(f"{args.name} stored at {path}")
    return 0


def cmd_models(args) -> int:
    models = ModelStore().list()
    if not models:
        _log(f"no models in {ModelStore().models_dir}; run `hkserve pull`")
    for m in models:
        c = m.config
        print(f"{m.name}\t{c.n_params / 1e6:.0f}M params\t{c.dtype}\t{c.n_layers} layers\tctx {c.context_length}"
              f"\t{m.source.get('format', '?')}\t{m.path}")
    return 0


def load_engine(args, slots: int, hosts=None):
    """Model from the store (pulling the default one if absent) onto the mesh → Engine. With `hosts`
    (a multi-host HostGroup) the mesh spans all hosts and each reads only its own shards."""
    from model.sharding import param_shardings, parse_mesh
    from model.transformer import build_model, param_shapes
    from server.engine import Engine

    store = ModelStore()
    if args.model == DEFAULT_MODEL and not store.exists(args.model):
        from checkpoint.convert import pull

        pull(args.model, store)
    weights = getattr(args, "weights", None)
    config = store.config(args.model, weights)
    mesh = hosts.mesh(args.mesh, config) if hosts else parse_mesh(args.mesh, config)
    data = mesh.shape["data"]
    slots = -(-slots // data) * data  # slots are split over the data axis: round up to fill it
    params = store.params(args.model, param_shardings(param_shapes(config), mesh, config), weights)
    return Engine(build_model(config), params, slots=slots, max_len=args.max_len, mesh=mesh,
                  n_top=getattr(args, "max_logprobs", 5))


def load_runner(args, slots: int, start: bool = True, max_queue: int = 64):
    """(tokenizer, runner, context length) of the model. The runner is started without warm-up when
    `start` (one-shot use), else left for the caller."""
    from server.runner import InferenceRunner

    engine = load_engine(args, slots)
    runner = InferenceRunner(engine, max_queue=max_queue)
    if start:
        runner.start(warmup=False)
    return ModelStore().tokenizer(args.model), runner, engine.max_len


def cmd_generate(args) -> int:
    from server.detokenize import IncrementalDetokenizer
    from server.runner import Request

    started = time.perf_counter()
    tokenizer, runner, _ = load_runner(args, slots=1)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        prompt_ids = tokenizer.encode_chat(messages + [{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = tokenizer.encode(args.prompt)
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": seed}
    loaded = time.perf_counter()

    detok = IncrementalDetokenizer(tokenizer)
    arrivals = []  # token arrival times; the first includes the prefill and step compiles
    try:
        for event in runner.submit(Request(prompt_ids, args.max_tokens, sampling, tokenizer.stop_ids)):
            if event.error:
                raise RuntimeError(event.error)
            if event.token is None:
                break
            arrivals.append(time.perf_counter())
            sys.stdout.write(detok.add(event.token.id))
            sys.stdout.flush()
    finally:
        runner.stop()
    sys.stdout.write(detok.flush() + "\n")
    sys.stdout.flush()
    timing = (f"load {loaded - started:.2f}s, first token {arrivals[0] - loaded:.2f}s (prefill of "
              f"{len(prompt_ids)} tokens and the compiles)")
    if len(arrivals) > 2:  # steady decode, from the second step on
        rate = (len(arrivals) - 2) / (arrivals[-1] - arrivals[1])
        timing += f", then {rate:.1f} tok/s"
    _log(f"{timing} ({len(arrivals)} tokens)")
    return 0


def cmd_sample(args) -> int:
    from server.sample import run

    return run(args)


def cmd_serve(args) -> int:
    from server.serve import run_server

    return run_server(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hkserve", description="JAX + Haiku LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pull", help="download and convert a known model into the store")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--weights", default="f32", choices=list(WEIGHTS), help="also store this weight variant")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("convert", help="import a local GGUF file or Hugging Face directory")
    p.add_argument("path")
    p.add_argument("--name", required=True)
    p.add_argument("--weights", default="f32", choices=list(WEIGHTS), help="also store this weight variant")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("models", help="list the model store")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--slots", type=int, default=16, help="sequences decoded together")
    p.add_argument("--mesh", default=None, help="DATAxMODEL device mesh, e.g. 1x8 or 2x4")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429")
    p.add_argument("--max-len", type=int, default=2048, help="context length of each slot")
    p.add_argument("--max-logprobs", type=int, default=20, help="most top_logprobs a request may ask for")
    p.add_argument("--weights", default=None, choices=list(WEIGHTS), help="weight variant (default: as stored)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env HKSERVE_API_KEY)")
    p.add_argument("--cors-origin", action="append", help="allowed CORS origin (repeatable)")
    g = p.add_argument_group("multi-host (see docs/deploy.md)")
    g.add_argument("--coordinator", default=None, help="HOST:PORT of host 0 (env HKSERVE_COORDINATOR)")
    g.add_argument("--num-hosts", type=int, default=None, help="hosts serving this model (env HKSERVE_NUM_HOSTS)")
    g.add_argument("--host-id", type=int, default=None, help="this host, 0..N-1; 0 serves HTTP (env HKSERVE_HOST_ID)")
    g.add_argument("--hosts-mesh", default=None, help="DATAxMODEL tiling of the hosts, default Nx1 "
                                                       "(env HKSERVE_HOSTS_MESH); --mesh tiles each host's devices")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("sample", help="complete every prompt of a JSONL file (resumable)")
    from server.sample import add_arguments as add_sample_arguments

    add_sample_arguments(p)
    p.set_defaults(func=cmd_sample)

    from server.bench import add_bench_parser

    add_bench_parser(sub)

    from server import eval_ppl

    p = sub.add_parser("eval-ppl", help="perplexity of a model (weight variant) on a text file")
    eval_ppl.add_arguments(p)
    p.set_defaults(func=eval_ppl.run)

    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--chat", action="store_true", help="render PROMPT as a user message with the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-len", type=int, default=2048, help="context length of the KV memory")
    p.add_argument("--mesh", default=None, help="DATAxMODEL device mesh, e.g. 1x8 or 2x4 (default: all on model "
                                                "if that divides the heads, else all on data)")
    p.add_argument("--weights", default=None, choices=list(WEIGHTS), help="weight variant (default: as stored)")
    p.set_defaults(func=cmd_generate)

    from train.cli import register as add_train_parsers

    add_train_parsers(sub)  # train, train-vocab, validation, test
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        _log(f"hkserve {args.command}: error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
