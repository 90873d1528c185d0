"""`hkserve bench spec`: tok/s with speculative decoding (n-gram lookup) on and off, same run.

Three workloads through the runner, as a server would run them (pipelining, policy, stop ids):
  * edit: batch 1, requests that copy most of a ~200-token input (fix spelling, rename a variable);
  * chat: batch 1, open-ended questions (little to copy: the policy must turn drafting off);
  * chat16: the chat prompts on 16 slots at once (above the crossover: every step is plain).
Each repeat runs both sides, alternating which goes first; the median over repeats and the spread
(min..max) are reported. Greedy, so both sides must produce the same tokens (checked). With --json
the last line is `{"edit": {"off": tok_s, "on": tok_s, "accepted_per_step": x}, "chat": ..., "chat16": ...}`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from hkserve.checkpoint.store import DEFAULT_MODEL, ModelStore
from hkserve.engine.engine import Engine
from hkserve.engine.options import EngineOptions
from hkserve.engine.requests import Request
from hkserve.engine.runner import InferenceRunner
from hkserve.engine.spec_policy import SpecConfig
from hkserve.engine.speculative import SpeculativeEngine
from hkserve.model.build import build_model

PARAGRAPH = (
    "Teh annual comunity garden meeting was held on Tuesday evening in the library. About thirty neighbours "
    "came, and most of them brought vegetables from there own plots to share. The chairman explained that "
    "the water bill had gone up alot this year, so members would be asked to pay a small fee. Several "
    "people suggested collecting rain water in barrels insted, which would save money and be better for the "
    "enviroment. Everyone agreed to try it for one season and to meet again in the autum to see how it went."
)
CODE = """def total_price(x, tax_rate):
    # x is the list of item prices in the basket
    subtotal = 0
    for price in x:
        subtotal += price
    if len(x) > 10:
        subtotal = subtotal * 0.95
    tax = subtotal * tax_rate
    print("items:", len(x), "subtotal:", subtotal)
    return subtotal + tax


def cheapest(x):
    if not x:
        return None
    return min(x)
"""
EDIT = [
    "Fix the spelling in this paragraph and write out the corrected paragraph in full:\n\n" + PARAGRAPH,
    "Rename the variable x to prices in this code and write out the whole code:\n\n" + CODE,
]
CHAT = [
    "What are some good hobbies for someone who likes being outdoors?",
    "Write a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain it to a ten year old.",
    "Give me some ideas for a healthy breakfast.",
]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_arguments(p) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model of the store")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3, help="measurements per side; the median is reported")
    p.add_argument("--k", type=int, default=SpecConfig.k, help="drafts per verify step")
    p.add_argument("--max-len", type=int, default=512, help="context length of each slot")
    p.add_argument(
        "--workloads", default="edit,chat,chat16", help="comma list of the workloads to run (edit, chat, chat16)"
    )
    p.add_argument("--chat-prompts", type=int, default=len(CHAT), help="open questions used (1..4)")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")


def _run(engine, prompts: list[list[int]], max_tokens: int, stop_ids, concurrent: bool):
    """(tokens generated, seconds, generated ids per prompt): sequentially, or all submitted at once."""
    runner = InferenceRunner(engine, max_queue=len(prompts)).start(warmup=False)
    try:
        started = time.perf_counter()
        if concurrent:
            streams = [runner.submit(Request(p, max_tokens, stop_ids=stop_ids)) for p in prompts]
            outs = [[e.token.id for e in s if e.token is not None] for s in streams]
        else:
            outs = [[t.id for t in runner.generate(Request(p, max_tokens, stop_ids=stop_ids))] for p in prompts]
        seconds = time.perf_counter() - started
    finally:
        runner.stop()
    return sum(map(len, outs)), seconds, outs


def measure(plain: Engine, spec: SpeculativeEngine, prompts, args, stop_ids, concurrent: bool) -> dict:
    rates: dict[str, list[float]] = {"off": [], "on": []}
    outputs: dict[str, list] = {}
    before = spec.counts.accepted, spec.counts.verify_rows
    for repeat in range(args.repeats):
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for side in order:
            tokens, seconds, outs = _run(
                plain if side == "off" else spec, prompts, args.max_tokens, stop_ids, concurrent
            )
            rates[side].append(tokens / seconds)
            outputs[side] = outs
            _log(f"  {side}: {tokens} tokens in {seconds:.1f}s = {tokens / seconds:.2f} tok/s")
    counts = spec.counts
    accepted, verified = counts.accepted - before[0], counts.verify_rows - before[1]
    med = {side: statistics.median(r) for side, r in rates.items()}
    return {
        "off": med["off"],
        "on": med["on"],
        "ratio": med["on"] / med["off"],
        "spread": {side: [min(r), max(r)] for side, r in rates.items()},
        "accepted_per_step": accepted / verified if verified else 0.0,
        "verify_steps": verified,
        "same_tokens": outputs["off"] == outputs["on"],
    }


def run(args) -> int:
    store = ModelStore()
    config = store.config(args.model, "f32")
    model, params, tokenizer = build_model(config), store.params(args.model, weights="f32"), store.tokenizer(args.model)
    chat = lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])
    edit_prompts, chat_prompts = [chat(t) for t in EDIT], [chat(t) for t in CHAT[: args.chat_prompts]]
    wanted = args.workloads.split(",")
    _log(f"edit prompts: {[len(p) for p in edit_prompts]} tokens; chat prompts: {[len(p) for p in chat_prompts]}")
    report = {}
    for name, slots, prompts, concurrent in (
        ("edit", 1, edit_prompts, False),
        ("chat", 1, chat_prompts, False),
        ("chat16", 16, (chat_prompts * 16)[:16], True),
    ):
        if name not in wanted:
            continue
        _log(f"{name}: {slots} slots, compiling ...")
        plain = Engine(model, params, EngineOptions(slots=slots, max_len=args.max_len, prefill_buckets=(64, 256)))
        spec = SpeculativeEngine(plain, SpecConfig(k=args.k))
        spec.warmup()
        report[name] = measure(plain, spec, prompts, args, tokenizer.stop_ids, concurrent)
        r = report[name]
        _log(
            f"{name}: off {r['off']:.2f} tok/s, on {r['on']:.2f} tok/s = {r['ratio']:.2f}x "
            f"(spread off {r['spread']['off']}, on {r['spread']['on']}), accepted per verify step "
            f"{r['accepted_per_step']:.2f}, same tokens: {r['same_tokens']}"
        )
    for name, r in report.items():
        print(
            f"{name:7s} off {r['off']:7.2f} tok/s  on {r['on']:7.2f} tok/s  {r['ratio']:.2f}x  "
            f"accepted/step {r['accepted_per_step']:.2f}  same tokens {r['same_tokens']}"
        )
    if args.json:
        print(json.dumps(report))
    return 0
