"""The three engines of gemma3_real_compare.py, each → {prompt: Run}: hkserve (its store, its forward for the
logits, its InferenceRunner for the greedy tokens), llama.cpp (llama-cpp-python) and transformers' GGUF
loading. All take the same prompt ids; greedy is never stopped early (no stop ids) so lengths match."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
from gemma3_real_compare import NEW_TOKENS, Run, positions

from hkserve.checkpoint.convert import convert
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.kernels.dispatch import resolve
from hkserve.model.build import build_model
from hkserve.model.memory import init_memory

NAME = "gemma3-270m-q4-k-m"
WIDTH = 1024  # one forward width and one prefill bucket for every prompt (the long one is ~730 tokens)


def hkserve_runs(
    gguf: Path, cache: Path, prompts: dict[str, str], weights: str, name: str = NAME, kernels: str = "xla"
) -> dict[str, Run]:
    """hkserve's float32 expansion of the file (`convert --weights f32`), or its int8 / int4 variant as
    `convert --weights V` stores it (the int4 one from the file's own blocks, no float32 master), stored
    as `{name}-{weights}` under `cache`/home. `kernels` as `--kernels`: "auto" runs int8/int4 through the
    CPU kernels as `serve` does on a CPU; "xla" (the default) through XLA's dots."""
    store = ModelStore(cache / "home")
    name = f"{name}-{weights}"
    if not store.exists(name):
        convert(gguf, name, store, progress=False, weights="f32" if weights == "float32" else weights)
    config, params = store.config(name), store.params(name)
    model = build_model(config, resolve(kernels, config.dtype, config.memory))
    tokenizer = store.tokenizer(name)
    ids = {k: tokenizer.encode(text) for k, text in prompts.items()}
    opts = EngineOptions(slots=1, max_len=WIDTH + NEW_TOKENS, prefill_buckets=(WIDTH,), prefill_rows=0)
    engine = Engine(model, params, opts)
    forward = jax.jit(model.forward)
    runs = {}
    runner = InferenceRunner(engine).start(warmup=False)
    try:
        for key, prompt in ids.items():
            tokens = np.zeros((1, WIDTH), np.int32)
            tokens[0, : len(prompt)] = prompt
            memory = init_memory(config, 1, WIDTH)
            logits, _ = forward(engine.params, tokens, memory, np.asarray([len(prompt)], np.int32))
            rows = np.asarray(logits[0, np.asarray(positions(len(prompt)))], np.float32)
            greedy = [t.id for t in runner.generate(Request(prompt, NEW_TOKENS))]
            runs[key] = Run(prompt, rows, greedy)
    finally:
        runner.stop()
    return runs


def llama_runs(gguf: Path, ids: dict[str, list[int]]) -> dict[str, Run]:
    """llama.cpp on the CPU: all-position logits of the prompt, then its own greedy sampler (top_k 1)."""
    from llama_cpp import Llama

    llm = Llama(str(gguf), n_ctx=WIDTH + NEW_TOKENS, logits_all=True, n_threads=2, verbose=False, seed=0)
    runs = {}
    for key, prompt in ids.items():
        llm.reset()
        llm.eval(prompt)
        rows = np.array(llm.scores[np.asarray(positions(len(prompt)))], np.float32)
        llm.reset()
        gen = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
        greedy = [t for t, _ in zip(gen, range(NEW_TOKENS))]
        runs[key] = Run(prompt, rows, greedy)
    return runs


def hf_runs(gguf: Path, ids: dict[str, list[int]]) -> dict[str, Run]:
    """transformers dequantizes the file to float32 itself (its own GGUF reader and tensor mapping)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    model.eval()
    runs = {}
    with torch.no_grad():
        for key, prompt in ids.items():
            x = torch.tensor([prompt])
            logits = model(x).logits[0, positions(len(prompt))].float().numpy()
            out = model.generate(x, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            runs[key] = Run(prompt, logits, out[0, len(prompt) :].tolist())
    return runs
