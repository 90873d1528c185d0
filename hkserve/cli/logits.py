"""`hkserve logits`: the float32 logits of one full forward pass at every position, for comparing an
import against a reference implementation (transformers, llama.cpp)."""

from __future__ import annotations

import json

import jax
import numpy as np

from hkserve.checkpoint.store import ModelStore
from hkserve.cli.token_ids import prompt_ids
from hkserve.model.build import build_model
from hkserve.model.config import WEIGHTS
from hkserve.model.memory import init_memory


def add_arguments(p) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="text (needs the model's tokenizer); or --ids")
    p.add_argument("--model", required=True)
    p.add_argument("--ids", default=None, help="comma-separated token ids, e.g. 5,17,3")
    p.add_argument("--json", action="store_true", help='print {"logits": [[...], ...]} ([positions, vocab])')
    p.add_argument("--weights", default=None, choices=list(WEIGHTS), help="weight variant (default: as stored)")


def run_logits(args) -> int:
    """--json: all logits as JSON; else one line per position: id, most likely next id, its logit."""
    store = ModelStore()
    ids = prompt_ids(args, store)
    config = store.config(args.model, args.weights)
    params = store.params(args.model, weights=args.weights)
    model = build_model(config)
    tokens = np.asarray([ids], np.int32)
    memory = init_memory(config, 1, len(ids))
    logits, _ = jax.jit(model.forward)(params, tokens, memory, np.asarray([len(ids)], np.int32))
    logits = np.asarray(logits[0], np.float32)  # [T, V]
    if args.json:
        print(json.dumps({"logits": logits.tolist()}))
    else:
        for pos, (token, row) in enumerate(zip(ids, logits)):
            print(f"{pos}\t{token}\t{int(row.argmax())}\t{float(row.max()):.6f}")
    return 0
