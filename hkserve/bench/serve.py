"""`hkserve bench serve`: start the real server, drive it over HTTP with concurrent streaming clients,
report TTFT, inter-token latency and output tokens/s per concurrency.

Every request generates exactly --max-tokens (`ignore_eos`), so figures compare with the engine
benchmark's fixed-length decode.

The clients are threads with their own HTTP connections, in this process; the server is a separate
process, as in deployment, so client overhead does not steal the engine's interpreter.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

PROMPTS = [
    "Once upon a time, in a small village,",
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works.",
    "The history of the printing press begins",
]


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", default="1,8,16", help="comma list of simultaneous streaming clients")
    p.add_argument("--requests", type=int, default=0, help="requests per concurrency (default: 3 x concurrency, >= 4)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--json", action="store_true")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(port: int) -> int | None:
    """/health's status code, or None while nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    except OSError:
        return None
    finally:
        conn.close()


@contextlib.contextmanager
def serving(model: str, slots: int, max_queue: int, ready_within: float = 900, extra: tuple[str, ...] = ()):
    """`hkserve serve` (with `extra` flags) in a separate process on a free port, once /health says ready:
    yields (url, process)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "hkserve.cli.main", "serve", "--model", model, "--port", str(port)]
    cmd += ["--slots", str(slots), "--max-queue", str(max_queue), *extra]
    print(f"starting: {' '.join(cmd)}", file=sys.stderr, flush=True)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    try:
        deadline = time.time() + ready_within
        while _health(port) != 200:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
            if time.time() > deadline:
                raise RuntimeError(f"the server was not ready within {ready_within:.0f} s")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.terminate()
        server.wait(60)


def _one_request(url: str, model: str, prompt: str, max_tokens: int, seed: int) -> dict:
    import httpx  # the HTTP client of the test extra, kept out of the import path of a server install

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    start = time.perf_counter()
    arrivals, tokens = [], 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": arrivals[0] - start if arrivals else float("nan"), "itl": list(np.diff(arrivals)), "tokens": tokens}


def _phase(url: str, model: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    results, lock, counter = [], threading.Lock(), iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = _one_request(url, model, PROMPTS[i % len(PROMPTS)], max_tokens, seed=i)
            with lock:
                results.append(r)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ttft = [r["ttft"] * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r["itl"]] or [float("nan")]
    return {
        "ttft_p50_ms": float(np.nanpercentile(ttft, 50)),
        "ttft_p99_ms": float(np.nanpercentile(ttft, 99)),
        "itl_p50_ms": float(np.percentile(itl, 50)),
        "itl_p99_ms": float(np.percentile(itl, 99)),
        "out_tok_s": sum(r["tokens"] for r in results) / wall,
    }


def run(args) -> int:
    levels = [int(x) for x in args.concurrency.split(",")]
    with serving(args.model, max(args.slots, max(levels)), 4 * max(levels) + 8) as (url, _):
        _phase(url, args.model, 1, 2, args.max_tokens)  # warm the HTTP path
        report = {}
        for c in levels:
            n = args.requests or max(4, 3 * c)
            report[str(c)] = _phase(url, args.model, c, n, args.max_tokens)
            r = report[str(c)]
            print(
                f"concurrency {c:>3}: {r['out_tok_s']:8.1f} out tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms "
                f"p99 {r['ttft_p99_ms']:7.1f} ms  ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms",
                flush=True,
            )
    if args.json:
        print(json.dumps(report))
    return 0
