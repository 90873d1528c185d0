"""Run in a subprocess with 8 simulated CPU devices: grok fixture logits (full and prefill+decode)
on several meshes, saved to an .npz for tests/test_grok.py."""

from __future__ import annotations

import sys

import jax
import numpy as np
from helpers import load_grok_npz

from hkserve.model.build import build_model, param_shapes
from hkserve.model.memory import init_memory
from hkserve.model.sharding import memory_shardings, param_shardings, parse_mesh


def grok_logits(model, params, tokens, prefill: int, shardings=None):
    """(full [B,T,V], cached [B,T,V]): one forward, and prefill of `prefill` tokens + one-token steps."""
    b, t = tokens.shape
    forward = jax.jit(model.forward, static_argnums=(5, 6))

    def memory(length):
        m = init_memory(model.config, b, length)
        return jax.device_put(m, shardings) if shardings is not None else m

    full, _ = forward(params, tokens, memory(t), np.full(b, t, np.int32), None, t, False)
    padded = np.zeros((b, 16), np.int32)
    padded[:, :prefill] = tokens[:, :prefill]
    first, mem = forward(params, padded, memory(16), np.full(b, prefill, np.int32), None, 0, False)
    steps = [np.asarray(first[:, :prefill])]
    for i in range(prefill, t):
        logits, mem = forward(params, tokens[:, i : i + 1], mem, np.ones(b, np.int32), None, 16, False)
        steps.append(np.asarray(logits))
    return np.asarray(full), np.concatenate(steps, axis=1)


def main(fixture: str, out: str) -> None:
    config, host_params = load_grok_npz(fixture)
    tokens = np.load(fixture)["tokens"]
    model = build_model(config)
    results = {}
    for name in ["1x1", "1x8", "2x4"]:
        mesh = parse_mesh(name, devices=jax.devices()[:1] if name == "1x1" else jax.devices())
        params = jax.device_put(host_params, param_shardings(param_shapes(config), mesh, config))
        full, cached = grok_logits(model, params, tokens, 7, memory_shardings(config, mesh))
        results[f"{name}/full"], results[f"{name}/cached"] = full, cached
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
