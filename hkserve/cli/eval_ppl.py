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
from hkserve.model.config import WEIGHTS
from hkserve.model.memory import init_memory


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default=None, choices=list(WEIGHTS))
    p.add_argument("--text", required=True, help="a UTF-8 text file")
    p.add_argument("--window", type=int, default=512, help="tokens per forward (non-overlapping windows)")
    add_kernels_argument(p)


def perplexity(config, params, ids: list[int], window: int, kernels: KernelSpec | None = None) -> tuple[float, int]:
    """exp(mean next-token NLL) over `ids`, scored in windows of `window` tokens (each window starts
    with no context). → (perplexity, tokens scored)."""
    model = build_model(config, kernels)
    if model.prepare is not None:
        params = jax.jit(model.prepare)(params)
    forward = jax.jit(model.forward)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window + 1]
        if len(chunk) < 2:
            break
        tokens = np.zeros((1, window), np.int32)
        tokens[0, : len(chunk) - 1] = chunk[:-1]
        logits, _ = forward(params, tokens, init_memory(config, 1, window), np.asarray([len(chunk) - 1], np.int32))
        logprobs = np.asarray(jax.nn.log_softmax(logits[0, : len(chunk) - 1]))
        nll -= float(logprobs[np.arange(len(chunk) - 1), chunk[1:]].sum())
        count += len(chunk) - 1
    return math.exp(nll / count), count


def run(args) -> int:
    store = ModelStore()
    config = store.config(args.model, args.weights)
    ids = store.tokenizer(args.model).encode(Path(args.text).read_text())
    kernels = resolve(args.kernels, config.dtype, config.memory, devices=1)
    ppl, count = perplexity(config, store.params(args.model, weights=args.weights), ids, args.window, kernels)
    print(f"{args.model} {config.dtype}: perplexity {ppl:.4f} over {count} tokens", flush=True)
    sys.stdout.flush()
    return 0
