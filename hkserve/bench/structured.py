"""`hkserve bench structured`: decode throughput with every slot constrained by a realistic JSON schema
vs the same workload unconstrained, in the same run, through the InferenceRunner (so the constrained
side pays everything it costs: the split step, the host reading each step's tokens before sampling the
next, the matchers and the mask fills). Sides alternate per repeat; median and spread are reported,
with the host time per token of the mask fills. JSON last line:
{"unconstrained": {"1": tok_s, ...}, "constrained": {...}, "mask_us_p50": x, ...}.
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import sys
import time

import jax
import numpy as np

from hkserve.checkpoint.store import DEFAULT_MODEL, ModelStore
from hkserve.engine.constrained import GrammarCompiler, GrammarSpec
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.model.build import build_model
from hkserve.model.config import default_weights
from hkserve.model.sampling import SamplingParams

# A user directory export: nested objects, enums, bounded integers, a pattern, an array of records
# long enough (minItems) that no request ends before its token budget.
SCHEMA = {
    "type": "object",
    "properties": {
        "users": {
            "type": "array",
            "minItems": 200,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 32},
                    "email": {"type": "string", "pattern": "^[a-z0-9.]{1,16}@[a-z]{2,10}\\.(com|org|net)$"},
                    "role": {"enum": ["admin", "editor", "viewer"]},
                    "active": {"type": "boolean"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "name", "email", "role", "active", "address"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["users"],
    "additionalProperties": False,
}
PROMPT = [{"role": "user", "content": "Export the user directory as JSON."}]


def add_arguments(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--slots", type=_slot_list, default=[1, 16], help="comma list of slot counts (default 1,16)")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side and slot count (median reported)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument(
        "--split-masks",
        choices=("auto", "on", "off"),
        default="auto",
        help="a constrained step as two programs (on), one (off), or the backend's default (auto)",
    )
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")


def _slot_list(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected positive integers, got {text!r}")
    return values


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _run(runner: InferenceRunner, requests: list[Request]) -> tuple[int, float]:
    """(tokens, seconds) to generate all `requests` at once."""
    start = time.perf_counter()
    streams = [runner.submit(r) for r in requests]
    tokens = sum(1 for s in streams for e in s if e.token is not None)
    return tokens, time.perf_counter() - start


def _requests(prompt: list[int], slots: int, tokens: int, grammar) -> list[Request]:
    """One request per slot, sampled at temperature 1 with its own seed, no stop ids (a fixed length)."""
    return [Request(prompt, tokens, SamplingParams(temperature=1.0, seed=i), (), grammar=grammar) for i in range(slots)]


def run(args) -> int:
    store = ModelStore()
    weights = default_weights(jax.default_backend(), None)
    config = store.config(args.model, weights)
    params = store.params(args.model, None, weights)
    tokenizer = store.tokenizer(args.model)
    prompt = tokenizer.encode_chat(PROMPT)
    compiler = GrammarCompiler(tokenizer, config.vocab_size)
    grammar = compiler.compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    rates: dict[str, dict[str, list[float]]] = {"unconstrained": {}, "constrained": {}}
    per_token: list[float] = []
    for slots in args.slots:
        engine = Engine(
            build_model(config),
            params,
            EngineOptions(
                slots=slots,
                max_len=args.max_len,
                prefill_buckets=(64,),
                structured=True,
                split_masks={"auto": None, "on": True, "off": False}[args.split_masks],
            ),
        )
        runner = InferenceRunner(engine, max_queue=2 * slots)
        _log(f"{slots} slots: compiling")
        runner.start(warmup=True)
        try:
            _run(runner, _requests(prompt, slots, args.tokens, grammar))  # untimed: compiles, first matchers
            for repeat in range(args.repeats):
                for constrained in (repeat % 2 == 0, repeat % 2 == 1):  # alternate which side goes first
                    name = "constrained" if constrained else "unconstrained"
                    fills: list[tuple[float, int]] = []
                    runner.grammars.observe = (
                        (lambda s, rows, out=fills: out.append((s, rows))) if constrained else None
                    )
                    requests = _requests(prompt, slots, args.tokens, grammar if constrained else None)
                    tokens, seconds = _run(runner, requests)
                    rates[name].setdefault(str(slots), []).append(tokens / seconds)
                    per_token += [s / rows * 1e6 for s, rows in fills if rows]
                    _log(f"{slots} slots, {name}: {tokens / seconds:.1f} tok/s")
        finally:
            runner.stop()
    _report(args, rates, per_token)
    return 0


def _report(args, rates, per_token) -> None:
    median = {side: {k: statistics.median(v) for k, v in by.items()} for side, by in rates.items()}
    print(
        f"# hkserve bench structured: {args.model}, {args.tokens} tokens/request, {platform.processor() or 'cpu'},"
        f" split masks {args.split_masks}"
    )
    print(f"# {datetime.date.today()}, median of {args.repeats} (min..max)")
    print(f"{'slots':>5} {'unconstrained tok/s':>26} {'constrained tok/s':>26} {'ratio':>6}")
    for slots in (str(s) for s in args.slots):
        u, c = rates["unconstrained"][slots], rates["constrained"][slots]
        print(
            f"{slots:>5} {median['unconstrained'][slots]:>9.1f} ({min(u):.1f}..{max(u):.1f})"
            f" {median['constrained'][slots]:>9.1f} ({min(c):.1f}..{max(c):.1f})"
            f" {median['constrained'][slots] / median['unconstrained'][slots]:>6.2f}"
        )
    p50 = float(np.percentile(per_token, 50)) if per_token else 0.0
    p90 = float(np.percentile(per_token, 90)) if per_token else 0.0
    print(f"mask fill per constrained token: p50 {p50:.1f} us, p90 {p90:.1f} us ({len(per_token)} fills)")
    if args.json:
        print(
            json.dumps(
                {
                    **median,
                    "mask_us_p50": round(p50, 2),
                    "mask_us_p90": round(p90, 2),
                    "spread": rates,
                    "split_masks": args.split_masks,
                }
            )
        )
