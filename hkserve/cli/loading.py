"""Load a model from the store onto a device mesh: the Engine, or a started InferenceRunner."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from dataclasses import dataclass

import jax

from hkserve.checkpoint.convert import pull
from hkserve.checkpoint.store import DEFAULT_MODEL, ModelStore, serving_weights
from hkserve.cli import speculative
from hkserve.cli.startup import StartupTimeline, tree_bytes
from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import DEFAULT_BLOCK_SIZE, DEFAULT_LAYOUT, LAYOUTS
from hkserve.engine.options import EngineOptions
from hkserve.engine.prefix_cache import DEFAULT_MODE, MODES
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.kernels.dispatch import add_kernels_argument, resolve
from hkserve.model.build import build_model, param_shapes
from hkserve.model.config import KV_DTYPES, WEIGHTS, with_kv_dtype
from hkserve.model.packing import stored_packing
from hkserve.model.sharding import param_shardings, parse_mesh


@dataclass(frozen=True)
class LoadOptions:
    """How a command loads its model: the flags `serve`, `generate` and `sample` share. A command that
    has no such flag gets the default here (LoadOptions.from_args)."""

    model: str = DEFAULT_MODEL
    max_len: int = 2048
    mesh: str | None = None  # DATAxMODEL; None: parse_mesh's default for the model
    weights: str | None = None  # None: serving_weights' default
    kv_dtype: str = "auto"  # --kv-dtype: auto | f32 | bf16 (KV_DTYPES)
    kernels: str = "auto"
    layers: str = "auto"  # "scan" / "loop"; auto: build_model's choice
    prefix_cache: str | None = None  # None: prefix_cache_mode's default for the model's memory
    max_logprobs: int = 5
    prefill_rows: int = 4
    speculative: str = "off"
    num_speculative_tokens: int = SpecConfig.k
    kv_layout: str = DEFAULT_LAYOUT  # kv_layout.py
    kv_cache_mb: float | None = None  # None: kv_layout.py's default pool
    kv_block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        """The options from a command's parsed flags, read once: the fields it has no flag for keep their default."""
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given})


def add_variant_arguments(p) -> None:
    """--weights, --kv-dtype, --kernels and --layers: which weights a command serves and how it runs them."""
    p.add_argument(
        "--weights",
        default=None,
        choices=list(WEIGHTS),
        help="weight variant (default: bf16 on a GPU/TPU; on a CPU the one the model was converted to serve, a "
        "quantized GGUF's own int4/int8, else f32)",
    )
    add_kv_dtype_argument(p)
    add_kernels_argument(p)
    add_layers_argument(p)


def add_kv_dtype_argument(p) -> None:
    p.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPES),
        default="auto",
        help="the KV memory's dtype: auto = f32 for f32 weights, else bf16 (bf16, int8, int4); bf16 holds twice the "
        "tokens in the same bytes (--kv-cache-mb), each key and value rounded once (docs/benchmarks.md, KV dtype)",
    )


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
        help="paged (default): KV in blocks from one pool of --kv-cache-mb, given to requests as they grow; static: "
        "every slot reserves --max-len positions (Transformer-VQ models keep their fixed-size memory either way)",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=float,
        default=None,
        help="paged: the KV pool's size in MiB (default: on a GPU what its memory holds after the weights, "
        "on the CPU what --slots x --max-len static slots take)",
    )
    p.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="paged: tokens per KV block")


def prefix_cache_mode(requested: str | None, config) -> str:
    """--prefix-cache as given, else the default for a KV model and "off" for a Transformer-VQ one (whose
    compressed memory cannot be reused: asking for it explicitly is refused by the Engine)."""
    if requested is not None:
        return requested
    return "off" if config.memory == "vq" else DEFAULT_MODE


def load_engine(options: LoadOptions, slots: int, hosts=None, timeline: StartupTimeline | None = None):
    """Model from the store (pulling the default one if absent) onto the mesh → Engine. With `hosts`
    (a multi-host HostGroup) the mesh spans all hosts and each reads only its own shards. Wrapped in a
    SpeculativeEngine with `--speculative ngram`. `timeline` (serve's start-up record) times the load
    and the engine's build (weight packing, KV allocation) apart."""
    phase = timeline.phase if timeline else lambda _: contextlib.nullcontext()
    store, name = ModelStore(), options.model
    if name == DEFAULT_MODEL and not store.exists(name):
        pull(name, store)
    weights = serving_weights(store, name, options.weights)
    config = with_kv_dtype(store.config(name, weights), options.kv_dtype)
    mesh = hosts.mesh(options.mesh, config) if hosts else parse_mesh(options.mesh, config)
    data = mesh.shape["data"]
    slots = -(-slots // data) * data  # slots are split over the data axis: round up to fill it
    kernels = resolve(options.kernels, config.dtype, config.memory, mesh.size)
    with phase("build"):  # the model's functions (part of "pack" before the store kept weights packed)
        model = build_model(config, kernels, None if options.layers == "auto" else options.layers)
    with phase("load"):  # int8/int4 stored packed stay packed where the kernels read them so
        shardings = param_shardings(param_shapes(config), mesh, config)
        params = jax.block_until_ready(store.params(name, shardings, weights, stored_packing(model.prepare)))
    if timeline:
        timeline.stored_weights_bytes = tree_bytes(params)
    with phase("pack"):
        engine = _build_engine(options, slots, model, params, mesh)
    return speculative.wrap(engine, options.speculative, options.num_speculative_tokens, hosts)


def _build_engine(options: LoadOptions, slots: int, model, params, mesh) -> Engine:
    """The Engine, its params packed (or only fused, where the store kept them packed) and its memory
    allocated (waited for: the start-up timeline's "pack" is this work, not whatever later call would
    otherwise block on it)."""
    config = model.config
    engine = Engine(
        model,
        params,
        EngineOptions(
            slots=slots,
            max_len=options.max_len,
            n_top=options.max_logprobs,
            prefill_rows=options.prefill_rows,
            structured=True,  # structured outputs and tool calls: their split step compiles in warmup
            prefix_cache=prefix_cache_mode(options.prefix_cache, config),
            kv_layout=options.kv_layout,
            kv_cache_mb=options.kv_cache_mb,
            block_size=options.kv_block_size,
        ),
        mesh=mesh,
    )
    jax.block_until_ready((engine.params, engine.state))
    return engine


def load_runner(options: LoadOptions, slots: int, start: bool = True, max_queue: int = 64):
    """(tokenizer, runner, context length) of the model. The runner is started without warm-up when
    `start` (one-shot use), else left for the caller."""
    engine = load_engine(options, slots)
    runner = InferenceRunner(engine, max_queue=max_queue)
    if start:
        runner.start(warmup=False)
    return ModelStore().tokenizer(options.model), runner, engine.max_len
