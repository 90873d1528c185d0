"""Run in a subprocess with 8 simulated CPU devices (XLA_FLAGS set by the caller before jax loads):
a Transformer-VQ decoder prefilled in chunks and decoded on meshes 1x1 and 2x4; every call's logits and
the final memory saved to an .npz for the test to compare."""

from __future__ import annotations

import sys

import jax
import numpy as np
from helpers import tiny_vq_config

from hkserve.model.build import build_model, param_shapes
from hkserve.model.memory import init_memory
from hkserve.model.sharding import memory_shardings, param_shardings, parse_mesh

MESHES = ["1x1", "2x4"]  # 2x4: slots split over "data", heads over "model"
CONFIG = tiny_vq_config(vocab_size=96, n_heads=4, n_kv_heads=4, head_dim=4, vq_value_dim=8)
PROMPT_LENS = [3, 9, 16, 12, 5, 0, 14, 7]  # slot 5 idle throughout
DECODE_STEPS = 3
CHUNK = 4  # one compiled shape: prompts go in chunks of 4, decode steps as chunks of 1 real token


def run(mesh_name: str, params, tokens) -> dict:
    mesh = parse_mesh(mesh_name, devices=jax.devices()[:1] if mesh_name == "1x1" else jax.devices())
    model = build_model(CONFIG)
    params = jax.device_put(params, param_shardings(param_shapes(CONFIG), mesh, CONFIG))
    memory = jax.device_put(init_memory(CONFIG, len(PROMPT_LENS), 0), memory_shardings(CONFIG, mesh))
    forward = jax.jit(model.forward, static_argnums=(5, 6))
    prompt_lens = np.asarray(PROMPT_LENS)
    schedule = [np.clip(prompt_lens - i, 0, CHUNK) for i in range(0, max(PROMPT_LENS), CHUNK)]
    schedule += [(prompt_lens > 0).astype(int)] * DECODE_STEPS
    done = np.zeros(len(PROMPT_LENS), int)
    out = {}
    for i, lengths in enumerate(schedule):
        chunk = np.zeros((len(PROMPT_LENS), CHUNK), np.int32)
        for row, n in enumerate(lengths):
            chunk[row, :n] = tokens[row, done[row] : done[row] + n]
        logits, memory = forward(params, chunk, memory, lengths.astype(np.int32), None, None, False)
        out[f"logits{i}"] = np.asarray(logits)
        done += lengths
    for name, value in zip(memory._fields, memory):
        out[name] = np.asarray(value)
    return {f"{mesh_name}/{k}": v for k, v in out.items()}


def main(out: str) -> None:
    assert len(jax.devices()) == 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    params = jax.jit(build_model(CONFIG).init)(jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CONFIG.vocab_size, (len(PROMPT_LENS), max(PROMPT_LENS) + DECODE_STEPS)).astype(np.int32)
    results = {}
    for name in MESHES:
        results.update(run(name, params, tokens))
        print(name, "done", flush=True)
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1])
