"""Run in a subprocess with 8 simulated CPU devices (XLA_FLAGS set by the caller before jax loads):
greedy tokens and logits of a model on several meshes, saved to an .npz for the test to compare."""

from __future__ import annotations

import sys
import threading

import jax
import numpy as np
from helpers import tiny_config

from hkserve.engine.engine import Engine
from hkserve.engine.kv_layout import block_bytes
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model, param_shapes
from hkserve.model.memory import init_memory
from hkserve.model.sampling import SamplingParams
from hkserve.model.sharding import memory_shardings, param_shardings, parse_mesh

MESHES = ["1x1", "1x8", "2x4", "8x1"]
# int8 adds its scales to the same sharding rules: one mesh that splits both axes checks them.
# "tiny", one process for tests/test_sharding.py's three checks: the paged KV layout (the default: each
# data shard its own blocks) on every mesh; "static-1x1" to compare with; "spec-small-2x4": speculating on
# 2x4 paged with a pool of one --max-len request per data shard (preempting); "loop-*": the layer loop (the
# GPU default) on 1x1 and two meshes, to compare with each other and with the scan's 1x1
MESHES_OF_KIND = {
    "tiny-int8": ["1x1", "2x4"],
    "tiny": [*MESHES, "static-1x1", "spec-small-2x4", "loop-1x1", "loop-1x8", "loop-2x4"],
}


def mesh_for(name: str):
    return parse_mesh(name, devices=jax.devices()[:1] if name == "1x1" else jax.devices())


def prompt_logits(model, params, prompts, mesh) -> np.ndarray:
    """Last-position logits of each prompt, computed with sharded params and memory. [N, V]"""
    n = len(prompts)
    prompts = prompts + prompts[: (-n) % mesh.shape["data"]]  # rows divide over the data axis
    width = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    memory = jax.device_put(init_memory(model.config, len(prompts), width), memory_shardings(model.config, mesh))
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    logits, _ = jax.jit(model.forward, static_argnums=(5, 6))(params, tokens, memory, lengths, None, width, True)
    return np.asarray(logits)[:n]


def greedy(runner, prompts, max_tokens, stop_ids=()) -> list[list[int]]:
    results = [None] * len(prompts)

    def run(i):
        results[i] = [
            t.id for t in runner.generate(Request(prompts[i], max_tokens, SamplingParams(), stop_ids, logprobs=5))
        ]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def main(kind: str, out: str, home: str | None = None) -> None:
    assert len(jax.devices()) == 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    if kind in ("tiny", "tiny-int8"):
        config = tiny_config(vocab_size=96, n_heads=8, n_kv_heads=8, head_dim=8)
        host_params = build_model(config).init(jax.random.PRNGKey(3))
        if kind == "tiny-int8":  # int8 values and their scales sharded by the same rules
            from hkserve.checkpoint.quantize import convert_params

            config, host_params = convert_params(jax.tree_util.tree_map(np.asarray, host_params), config, "int8")
        model = build_model(config, layers="scan")  # the reference; "loop-*" runs rebuild it as the loop
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, 96, n).tolist() for n in (3, 9, 17, 30, 5, 12, 21, 2)]
        max_tokens, stop_ids = 12, ()
    else:
        import json

        from hkserve.checkpoint.store import ModelStore

        store = ModelStore(home)
        info = store.info("smollm2-135m-instruct")
        config, model = info.config, build_model(info.config)
        with open(sys.argv[4]) as f:
            cases = json.load(f)["cases"]
        prompts = [c["prompt_ids"] for c in cases]
        max_tokens, stop_ids = 32, store.tokenizer(info.name).stop_ids
    results = {}
    for name in MESHES_OF_KIND.get(kind, MESHES):
        if name.startswith("loop-"):  # the scan's runs come first, then the loop's
            model = build_model(config, layers="loop")
        mesh = mesh_for(name.split("-")[-1])
        shardings = param_shardings(param_shapes(config), mesh, config)
        if kind != "smollm2":
            params = jax.device_put(host_params, shardings)
        else:
            params = store.params(info.name, shardings)  # restored straight onto the mesh
            for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(shardings)):
                assert got.sharding.is_equivalent_to(want, got.ndim), (name, got.sharding, want)
        static = name.startswith("static-")  # the paged runs' reference; every other run is paged (the default)
        kv = {"kv_layout": "static" if static else "paged", "max_len": 256}
        if name.startswith("spec-small-"):  # 8 blocks of 16: 64 positions per data shard, --max-len 64
            kv |= {"max_len": 64, "block_size": 16, "kv_cache_mb": 8 * block_bytes(config, 16) / 2**20}
        engine = Engine(model, params, EngineOptions(slots=8, prefill_buckets=(16, 32, 64), **kv), mesh=mesh)
        if name.startswith("spec-"):  # always drafting: the greedy tokens must not change
            engine = SpeculativeEngine(engine, SpecConfig(k=4, min_tokens=0.0))
        runner = InferenceRunner(engine).start(warmup=False)
        try:
            tokens = greedy(runner, prompts, max_tokens, stop_ids)
        finally:
            runner.stop()
        results[f"{name}/preemptions"] = np.asarray(runner.preemptions)
        results[f"{name}/logits"] = prompt_logits(model, params, prompts, mesh)
        results[f"{name}/tokens"] = np.asarray([t + [-1] * (max_tokens - len(t)) for t in tokens])
        print(name, "done", flush=True)
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *sys.argv[3:4])
