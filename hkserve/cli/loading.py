"""Load a model from the store onto a device mesh: the Engine, or a started InferenceRunner."""

from __future__ import annotations

import jax

from hkserve.checkpoint.convert import pull
from hkserve.checkpoint.store import DEFAULT_MODEL, ModelStore
from hkserve.cli import speculative
from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUTS
from hkserve.engine.prefix_cache import DEFAULT_MODE, MODES
from hkserve.engine.runner import InferenceRunner
from hkserve.kernels.dispatch import resolve
from hkserve.model.build import build_model, param_shapes
from hkserve.model.config import default_weights
from hkserve.model.sharding import param_shardings, parse_mesh


def serving_weights(store: ModelStore, name: str, requested: str | None) -> str | None:
    """--weights as given; else bf16 on an accelerator and f32 on a CPU (`default_weights`), for a KV
    model. A Transformer-VQ model keeps its stored weights unless asked (it has no variants)."""
    if requested is None and store.info(name).config.memory == "vq":
        return None
    return default_weights(jax.default_backend(), requested)


def add_layers_argument(p) -> None:
    p.add_argument(
        "--layers",
        choices=("auto", "scan", "loop"),
        default="auto",
        help="the decoder's blocks as a scan over stacked weights or a loop over per-layer ones (auto: loop on "
        "GPUs, faster there; scan compiles quicker for models of many layers)",
    )


def add_prefix_cache_argument(p) -> None:
    p.add_argument(
        "--prefix-cache",
        choices=MODES,
        default=None,
        help=f"reuse earlier prompts' KV (docs/prefix-caching.md); default {DEFAULT_MODE}, off for Transformer-VQ",
    )


def add_kv_arguments(p) -> None:
    """--kv-layout, --kv-cache-mb, --kv-block-size on every command that serves a model (kv_layout.py)."""
    p.add_argument(
        "--kv-layout",
        choices=LAYOUTS,
        default=DEFAULT_LAYOUT,
        help="static: every slot reserves --max-len positions of KV; paged: blocks from one pool of --kv-cache-mb, "
        "given to requests as they grow (Transformer-VQ models keep their fixed-size memory either way)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=float,
        default=None,
        help="paged: the KV pool's size in MiB (default: on a GPU what its memory holds after the weights, "
        "on the CPU what --slots x --max-len static slots take)",
    )
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="paged: tokens per KV block")


def prefix_cache_mode(args, config) -> str:
    """--prefix-cache as given, else the default for a KV model and "off" for a Transformer-VQ one (whose
    compressed memory cannot be reused: asking for it explicitly is refused by the Engine)."""
    requested = getattr(args, "prefix_cache", None)
    if requested is not None:
        return requested
    return "off" if config.memory == "vq" else DEFAULT_MODE


def load_engine(args, slots: int, hosts=None):
    """Model from the store (pulling the default one if absent) onto the mesh → Engine. With `hosts`
    (a multi-host HostGroup) the mesh spans all hosts and each reads only its own shards. Wrapped in a
    SpeculativeEngine with `--speculative ngram`."""
    store = ModelStore()
    if args.model == DEFAULT_MODEL and not store.exists(args.model):
        pull(args.model, store)
    weights = serving_weights(store, args.model, getattr(args, "weights", None))
    config = store.config(args.model, weights)
    mesh = hosts.mesh(args.mesh, config) if hosts else parse_mesh(args.mesh, config)
    data = mesh.shape["data"]
    slots = -(-slots // data) * data  # slots are split over the data axis: round up to fill it
    params = store.params(args.model, param_shardings(param_shapes(config), mesh, config), weights)
    kernels = resolve(getattr(args, "kernels", "auto"), config.dtype, config.memory, mesh.size)
    layers = getattr(args, "layers", "auto")
    kv_layout = getattr(args, "kv_layout", DEFAULT_LAYOUT)
    if hosts and kv_layout == "paged":  # the followers would need the block pool's calls broadcast too
        raise ValueError("--kv-layout paged runs on one host for now: use --kv-layout static with --num-hosts")
    engine = Engine(
        build_model(config, kernels, None if layers == "auto" else layers),
        params,
        slots=slots,
        max_len=args.max_len,
        mesh=mesh,
        n_top=getattr(args, "max_logprobs", 5),
        prefill_rows=getattr(args, "prefill_rows", 4),
        structured=True,  # structured outputs and tool calls: their split step compiles in warmup
        prefix_cache=prefix_cache_mode(args, config),
        kv_layout=kv_layout,
        kv_cache_mb=getattr(args, "kv_cache_mb", None),
        block_size=getattr(args, "kv_block_size", DEFAULT_BLOCK_SIZE),
    )
    return speculative.wrap(engine, args, hosts)


def load_runner(args, slots: int, start: bool = True, max_queue: int = 64):
    """(tokenizer, runner, context length) of the model. The runner is started without warm-up when
    `start` (one-shot use), else left for the caller."""
    engine = load_engine(args, slots)
    runner = InferenceRunner(engine, max_queue=max_queue)
    if start:
        runner.start(warmup=False)
    return ModelStore().tokenizer(args.model), runner, engine.max_len
