"""`hkserve bench prefix`: what prefix caching buys over HTTP, one `hkserve serve` per --prefix-cache
mode, all alive in the same run, driven in turn (the mode order alternates between repeats).

Workloads (issue 17):
  chat: 8 conversations x 4 turns sharing a ~400-token system prompt, each turn sent after the previous
        reply (32 greedy tokens) and appending it plus a new user message; the conversations run at once.
  unrelated: 64 prompts with no common prefix (nothing to reuse), 16 clients: the bookkeeping's cost.
  short: 16 one-line prompts one at a time: what the "exact" mode's fixed prefill chunk costs a short prompt.
Reports TTFT p50/p99, wall time and output tok/s per mode (median over repeats, with min-max), whether
the greedy chat replies were the same in every mode, and the prompt tokens served from the cache.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time

import numpy as np

from hkserve.bench.serve import _free_port, _health

WORDS = [
    "river",
    "mountain",
    "library",
    "engine",
    "garden",
    "silver",
    "market",
    "window",
    "harbor",
    "lantern",
    "orchard",
    "violin",
    "compass",
    "meadow",
    "thunder",
    "pepper",
    "castle",
    "rocket",
    "canyon",
    "puzzle",
    "anchor",
    "blanket",
    "cactus",
    "dolphin",
    "glacier",
    "hammock",
    "island",
    "jungle",
    "kettle",
    "lemon",
    "magnet",
    "needle",
    "oyster",
    "pillow",
    "quartz",
    "saddle",
    "tunnel",
    "umbrella",
    "velvet",
    "walnut",
    "yogurt",
    "zipper",
]

SYSTEM = (
    "You are Atlas, the support assistant of a company that sells garden tools, bicycles and camping gear. "
    "Answer in plain language, in at most three sentences, and never invent order numbers or prices. "
) + " ".join(
    f"Rule {i + 1}: when a customer mentions the {a} or the {b}, explain the {c} policy politely and point "
    f"them to the {d} page of the help centre before anything else."
    for i, (a, b, c, d) in enumerate(zip(WORDS[0::4], WORDS[1::4], WORDS[2::4], WORDS[3::4]))
)


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--modes", default="on,off", help="comma list of --prefix-cache modes to compare")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--seed", type=int, default=0, help="varies the questions and prompts (fresh ones for a warm server)"
    )
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--workloads", default="chat,unrelated,short", help="comma list of chat, unrelated, short")
    p.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="MODE=URL",
        help="drive an already running server of that mode instead of starting one (repeatable)",
    )
    p.add_argument("--json", action="store_true")


def _stream(url: str, path: str, body: dict) -> tuple[float, str, dict]:
    """(TTFT s, text, usage) of one streamed request."""
    import httpx  # the test extra's client, kept out of a server install's import path

    start, first, text, usage = time.perf_counter(), None, [], {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + path, json=body, timeout=900) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter()
                text.append(piece)
            usage = chunk.get("usage") or usage
    return (first or time.perf_counter()) - start, "".join(text), usage


def _threads(n: int, work) -> float:
    """Run work(i) for i < n on n threads → wall seconds."""
    started = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def _summary(ttft: list[float], wall: float, tokens: int, cached: int, prompt: int) -> dict:
    ms = np.asarray(ttft) * 1e3
    return {
        "ttft_p50_ms": float(np.percentile(ms, 50)),
        "ttft_p99_ms": float(np.percentile(ms, 99)),
        "wall_s": wall,
        "out_tok_s": tokens / wall,
        "cached_fraction": cached / max(prompt, 1),
    }


def chat(url: str, model: str, repeat: int) -> tuple[dict, list[str]]:
    ttft, replies, counts = [], [""] * 32, {"tokens": 0, "cached": 0, "prompt": 0}
    lock = threading.Lock()

    def conversation(c: int) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        for turn in range(4):
            words = random.Random(f"{repeat}.{c}.{turn}").sample(WORDS, 6)
            messages.append(
                {"role": "user", "content": f"Question {turn + 1}: what about the {' and the '.join(words)}?"}
            )
            body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            t, text, usage = _stream(url, "/v1/chat/completions", body)
            messages.append({"role": "assistant", "content": text})
            with lock:
                ttft.append(t)
                replies[c * 4 + turn] = text
                counts["tokens"] += usage.get("completion_tokens", 0)
                counts["prompt"] += usage.get("prompt_tokens", 0)
                counts["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    wall = _threads(8, conversation)
    return _summary(ttft, wall, counts["tokens"], counts["cached"], counts["prompt"]), replies


def unrelated(url: str, model: str, repeat: int) -> dict:
    ttft, counts, lock = [], {"tokens": 0, "cached": 0, "prompt": 0}, threading.Lock()
    queue = iter(range(64))

    def client(_: int) -> None:
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            rng = random.Random(f"u{repeat}.{i}")
            prompt = f"{i * 7919 + repeat} " + " ".join(rng.choice(WORDS) for _ in range(40))
            body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            t, _, usage = _stream(url, "/v1/completions", body)
            with lock:
                ttft.append(t)
                counts["tokens"] += usage.get("completion_tokens", 0)
                counts["prompt"] += usage.get("prompt_tokens", 0)
                counts["cached"] += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    wall = _threads(16, client)
    return _summary(ttft, wall, counts["tokens"], counts["cached"], counts["prompt"])


def short(url: str, model: str, repeat: int) -> dict:
    ttft, started = [], time.perf_counter()
    for i in range(16):
        prompt = f"{repeat}-{i}: the {WORDS[i]} and the {WORDS[-i - 1]}"
        ttft.append(_stream(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})[0])
    return _summary(ttft, time.perf_counter() - started, 16, 0, 1)


def _start(model: str, mode: str, slots: int, max_len: int) -> tuple[str, subprocess.Popen]:
    port = _free_port()
    cmd = [sys.executable, "-m", "hkserve.cli.main", "serve", "--model", model, "--port", str(port)]
    cmd += ["--slots", str(slots), "--max-len", str(max_len), "--max-queue", "128", "--prefix-cache", mode]
    print(f"starting: {' '.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    return f"http://127.0.0.1:{port}", proc


def _median(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = float(np.median(values))
        out[key + "_range"] = [float(min(values)), float(max(values))]
    return out


def run(args) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    attached = dict(u.split("=", 1) for u in args.url)
    servers = {
        m: (attached[m], None) if m in attached else _start(args.model, m, args.slots, args.max_len) for m in modes
    }
    try:
        deadline = time.time() + 1800
        for mode, (url, proc) in servers.items():  # they compile their programs at the same time
            while _health(int(url.rsplit(":", 1)[1])) != 200:
                if (proc is not None and proc.poll() is not None) or time.time() > deadline:
                    raise RuntimeError(f"the --prefix-cache {mode} server did not become ready")
                time.sleep(1)
        results = {w: {m: [] for m in modes} for w in workloads}
        same_replies = True
        for repeat in range(args.repeats):
            order = modes if repeat % 2 == 0 else modes[::-1]
            replies = {}
            for mode in order:
                url = servers[mode][0]
                for workload in workloads:
                    if workload == "chat":
                        summary, replies[mode] = chat(url, args.model, args.seed * 1000 + repeat)
                    else:
                        work = unrelated if workload == "unrelated" else short
                        summary = work(url, args.model, args.seed * 1000 + repeat)
                    results[workload][mode].append(summary)
                    print(f"repeat {repeat} {mode} {workload}: {json.dumps(summary)}", file=sys.stderr, flush=True)
            same_replies &= all(r == replies[modes[0]] for r in replies.values())
    finally:
        started = [proc for _, proc in servers.values() if proc is not None]
        for proc in started:
            proc.terminate()
        for proc in started:
            proc.wait(60)
    report = {w: {m: _median(results[w][m]) for m in modes} for w in results}
    report["chat_replies_identical"] = same_replies if "chat" in workloads else None
    for workload in workloads:
        for mode in modes:
            r = report[workload][mode]
            print(
                f"{workload:>9} {mode:>5}: TTFT p50 {r['ttft_p50_ms']:8.1f} ms  p99 {r['ttft_p99_ms']:8.1f} ms  "
                f"wall {r['wall_s']:6.1f} s  {r['out_tok_s']:6.1f} out tok/s  cached {r['cached_fraction']:.0%}"
            )
    if "off" in modes and {"chat", "unrelated"} <= set(workloads):
        for mode in (m for m in modes if m != "off"):
            chat_x = report["chat"]["off"]["ttft_p50_ms"] / report["chat"][mode]["ttft_p50_ms"]
            tput = report["unrelated"][mode]["out_tok_s"] / report["unrelated"]["off"]["out_tok_s"]
            print(f"{mode} vs off: chat TTFT p50 {chat_x:.2f}x lower; unrelated throughput {tput:.3f}x")
    print(f"greedy chat replies identical across modes: {same_replies}")
    if args.json:
        print(json.dumps(report))
    return 0
