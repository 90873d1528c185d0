"""`hkserve bench vq`: per-token decode time and memory per slot of a Transformer-VQ model vs a KV
(softmax) model of the same width, at growing context lengths.

Both are random-weight models of ~1M parameters per layer (d=256, 4 layers, vocab 4096). The VQ state
is brought to each context by real prefills (chunks of 1024 tokens), since what a decode step reads from
it has a fixed size whatever it holds. The KV cache is filled with random keys and values up to the
context: a step's cost depends only on how many positions it reads, which is the context.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from hkserve.model.build import build_model
from hkserve.model.config import ModelConfig
from hkserve.model.memory import KVMemory, init_memory

CHUNK = 1024


def add_arguments(p) -> None:
    p.add_argument("--contexts", default="1024,4096,16384,32768", help="comma list of context lengths")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="measurements per figure; the median is reported")
    p.add_argument("--slots", type=int, default=1, help="sequences decoded together")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")


def bench_configs(context: int) -> tuple[ModelConfig, ModelConfig]:
    """(VQ, KV) of the same width: d=256, 4 layers. VQ: 2 GAUs a layer, 1 head, d_k 128, d_v 512,
    512 codes, window 256. KV: 4 heads of 64, SwiGLU 1024."""
    common = dict(vocab_size=4096, dim=256, n_layers=4, tie_embeddings=True, context_length=context)
    vq = ModelConfig(
        **common,
        n_heads=1,
        n_kv_heads=1,
        head_dim=128,
        ffn_dim=0,
        norm_eps=1e-6,
        memory="vq",
        vq_value_dim=512,
        vq_codes=512,
        vq_block_len=256,
        vq_mem_len=256,
    )
    kv = ModelConfig(**common, n_heads=4, n_kv_heads=4, head_dim=64, ffn_dim=1024)
    return vq, kv


def _time_steps(step, params, memory, batch: int, steps: int, repeats: int) -> tuple[float, object]:
    """Median over `repeats` of the mean time of one decode step (ms); returns the memory for reuse."""
    tokens = jnp.zeros((batch, 1), jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)
    logits, memory = step(params, tokens, memory, ones)  # compile
    logits.block_until_ready()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(steps):
            logits, memory = step(params, tokens, memory, ones)
        logits.block_until_ready()
        times.append((time.perf_counter() - started) / steps * 1e3)
    return float(np.median(times)), memory


def bench_vq_model(config: ModelConfig, contexts: list[int], args) -> tuple[dict, int]:
    model = build_model(config)
    params = jax.jit(model.prepare)(model.init(jax.random.PRNGKey(0)))  # as the Engine serves it
    memory = init_memory(config, args.slots, None)
    bytes_per_slot = sum(x.nbytes for x in jax.tree_util.tree_leaves(memory)) // args.slots
    prefill = jax.jit(lambda p, t, m, n: model.forward(p, t, m, n, last_only=True), donate_argnums=(2,))
    step = jax.jit(lambda p, t, m, n: model.forward(p, t, m, n), donate_argnums=(2,))
    rng = np.random.default_rng(0)
    report, position = {}, 0
    for context in contexts:
        while position < context:  # real tokens up to the context, in fixed-shape chunks
            tokens = jnp.asarray(rng.integers(0, config.vocab_size, (args.slots, CHUNK)), jnp.int32)
            lengths = jnp.full((args.slots,), min(CHUNK, context - position), jnp.int32)
            _, memory = prefill(params, tokens, memory, lengths)
            position = int(memory.step[0])
        report[str(context)], memory = _time_steps(step, params, memory, args.slots, args.steps, args.repeats)
        print(
            f"vq  context {context:>6}: {report[str(context)]:7.2f} ms/token  state {bytes_per_slot / 2**20:7.2f} "
            f"MiB/slot (timed from step {position})",
            flush=True,
        )
        position = int(memory.step[0])
    return report, bytes_per_slot


def bench_kv_model(config: ModelConfig, contexts: list[int], args) -> tuple[dict, dict]:
    model = build_model(config)
    params = model.init(jax.random.PRNGKey(0))
    report, sizes = {}, {}
    for context in contexts:
        max_len = context + (args.repeats + 1) * args.steps
        shape = (config.n_layers, args.slots, max_len, config.n_kv_heads, config.head_dim)
        key_k, key_v = jax.random.split(jax.random.PRNGKey(context))
        memory = KVMemory(
            jax.random.normal(key_k, shape),
            jax.random.normal(key_v, shape),
            jnp.full((args.slots,), context, jnp.int32),
        )
        step = jax.jit(lambda p, t, m, n, w=max_len: model.forward(p, t, m, n, attend_len=w), donate_argnums=(2,))
        report[str(context)], memory = _time_steps(step, params, memory, args.slots, args.steps, args.repeats)
        # k and v of `context` positions, float32
        sizes[str(context)] = 2 * config.n_layers * context * config.n_kv_heads * config.head_dim * 4
        print(
            f"kv  context {context:>6}: {report[str(context)]:7.2f} ms/token  cache {sizes[str(context)] / 2**20:7.2f} "
            f"MiB/slot",
            flush=True,
        )
        del memory
    return report, sizes


def run(args) -> int:
    contexts = sorted(int(x) for x in args.contexts.split(","))
    vq_config, kv_config = bench_configs(max(contexts) * 2)
    print(
        f"VQ model {vq_config.n_params / 1e6:.1f}M params vs KV model {kv_config.n_params / 1e6:.1f}M params, "
        f"{args.slots} slot(s), {jax.devices()[0].platform}",
        flush=True,
    )
    vq, vq_bytes = bench_vq_model(vq_config, contexts, args)
    kv, kv_bytes = bench_kv_model(kv_config, contexts, args)
    first, last = str(contexts[0]), str(contexts[-1])
    print(f"per-token time at {last} / at {first}: VQ {vq[last] / vq[first]:.2f}x, KV {kv[last] / kv[first]:.2f}x")
    if args.json:
        print(json.dumps({"vq": vq, "kv": kv, "vq_bytes_per_slot": vq_bytes, "kv_bytes_per_slot": kv_bytes}))
    return 0
