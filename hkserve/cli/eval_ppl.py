"""`hkserve eval-ppl`: perplexity of a model (and weight variant) on a text file, so the quality cost
of bf16 or int8 weights is a number, not a guess."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import jax
import numpy as np

from hkserve.checkpoint.store import ModelStore
from hkserve.kernels.dispatch import KernelSpec, add_kernels_argument, resolve
from hkserve.model.build import build_model
from hkserve.model.config import KV_DTYPES, WEIGHTS, with_kv_dtype
from hkserve.model.memory import cache_dtype, init_memory


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default=None, choices=list(WEIGHTS))
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="tokens per forward (non-overlapping windows)")
    p.add_argument(
        "--step",
        type=int,
        default=0,
        help="feed each window in forwards of this many tokens, each reading the earlier ones from the KV memory "
        "(1: decode steps, the CPU kernels' in-place attention); 0: the whole window in one forward. A --kv-dtype "
        "shows only here: one forward's tokens attend to each other before the memory rounds them",
    )
    p.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto", help="the KV memory's dtype (as serve's)")
    add_kernels_argument(p)


def perplexity(
    config, params, ids: list[int], window: int, kernels: KernelSpec | None = None, step: int = 0
) -> tuple[float, int]:
    """exp(mean next-token NLL) over `ids`, scored in windows of `window` tokens (each window starts
    with no context), each window in forwards of `step` tokens (0: one). → (perplexity, tokens scored)."""
    model = build_model(config, kernels)
    if model.prepare is not None:
        params = jax.jit(model.prepare)(params)
    forward = jax.jit(model.forward, static_argnames=("attend_len",))
    step = step or window
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        memory = init_memory(config, 1, window)
        for at in range(0, len(chunk) - 1, step):
            n = min(step, len(chunk) - 1 - at)
            tokens = np.zeros((1, step), np.int32)
            tokens[0, :n] = chunk[at : at + n]
            logits, memory = forward(params, tokens, memory, np.asarray([n], np.int32), attend_len=window)
            logprobs = np.asarray(jax.nn.log_softmax(logits[0, :n]))
            nll -= float(logprobs[np.arange(n), chunk[at + 1 : at + n + 1]].sum())
        count += len(chunk) - 1
    return math.exp(nll / count), count


def run(args) -> int:
    store = ModelStore()
    config = with_kv_dtype(store.config(args.model, args.weights), args.kv_dtype)
    ids = store.tokenizer(args.model).encode(Path(args.text).read_text())
    kernels = resolve(args.kernels, config.dtype, config.memory, devices=1)
    params = store.params(args.model, weights=args.weights)
    ppl, count = perplexity(config, params, ids, args.window, kernels, args.step)
    kv = np.dtype(cache_dtype(config)).name
    print(f"{args.model} {config.dtype}, KV {kv}: perplexity {ppl:.4f} over {count} tokens", flush=True)
    sys.stdout.flush()
    return 0
