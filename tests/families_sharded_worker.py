"""Run in a subprocess with 8 simulated CPU devices (XLA_FLAGS set by the caller): an HF fixture's logits
of the reference inputs and its greedy continuation on meshes 1x1, 1x8 and 2x4, saved to an .npz."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
from sharded_worker import greedy, mesh_for, prompt_logits

from hkserve.checkpoint.hf import load_hf
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model, param_shapes
from hkserve.model.sharding import param_shardings

MESHES = ["1x1", "1x8", "2x4"]


def main(directory: str, out: str) -> None:
    assert len(jax.devices()) == 8, "needs XLA_FLAGS=--xla_force_host_platform_device_count=8"
    ref = json.loads((Path(directory) / "reference.json").read_text())
    config, host_params = load_hf(directory)
    model = build_model(config)
    # every prefix of both reference rows: last-position logits = the logits at every position
    prompts = [row[:n] for row in ref["input_ids"] for n in range(1, len(row) + 1)]
    results = {}
    for name in MESHES:
        mesh = mesh_for(name)
        params = jax.device_put(host_params, param_shardings(param_shapes(config), mesh, config))
        engine = Engine(model, params, EngineOptions(slots=2, max_len=32, prefill_buckets=(8,)), mesh=mesh)
        runner = InferenceRunner(engine).start(warmup=False)
        try:
            tokens = greedy(runner, [ref["greedy_prompt"]], len(ref["greedy_ids"]))
        finally:
            runner.stop()
        results[f"{name}/logits"] = prompt_logits(model, params, prompts, mesh)
        results[f"{name}/tokens"] = np.asarray(tokens)
        print(name, "done", flush=True)
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
