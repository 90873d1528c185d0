"""`hkserve bench serve`: start the real server, drive it over HTTP with concurrent streaming clients,
report TTFT, inter-token latency and output tokens/s per concurrency; beside them, the same workload
submitted to an in-process InferenceRunner (bench/serve_runner.py), so the HTTP layer's cost is a
same-run ratio. Each figure is the median of --repeats runs, the sides alternating order; with
--compare-prefill-rows, also a runner prefilling one prompt per call (batched prefill's effect).

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
import time

import numpy as np

from hkserve.bench.clients import run_clients
from hkserve.engine.kv_layout import DEFAULT_LAYOUT, LAYOUTS

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
    p.add_argument("--max-len", type=int, default=2048, help="context length (fewer programs to compile when small)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side per concurrency; medians are reported")
    p.add_argument("--prefill-rows", type=int, default=4, help="the server's and runner's batched prefill rows")
    p.add_argument(
        "--compare-prefill-rows",
        action="store_true",
        help="also measure an in-process runner with --prefill-rows 0 (one prompt per prefill call)",
    )
    p.add_argument("--kv-layout", choices=LAYOUTS, default=DEFAULT_LAYOUT, help="the server's KV layout")
    p.add_argument("--kv-cache-mb", type=float, default=None, help="the server's paged KV pool (MiB)")
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
def serving(
    model: str,
    slots: int,
    max_queue: int,
    prefill_rows: int = 4,
    max_len: int = 2048,
    ready_within=1800,
    extra: tuple[str, ...] = (),
):
    """`hkserve serve` in a separate process on a free port, once /health says ready: yields (url, process).
    `extra`: more of serve's flags."""
    port = _free_port()
    cmd = [sys.executable, "-m", "hkserve.cli.main", "serve", "--model", model, "--port", str(port)]
    cmd += ["--slots", str(slots), "--max-queue", str(max_queue), "--prefill-rows", str(prefill_rows)]
    cmd += ["--max-len", str(max_len), *extra]
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


def _one_request(client, url: str, model: str, prompt: str, max_tokens: int, seed: int) -> dict:
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
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
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
    """One client object for the phase, as an OpenAI SDK client holds one: a fresh `httpx.Client` per
    request costs ~35 ms of CPU (its SSL context), which 16 clients starting at once took from the
    server's first prefill and counted as TTFT."""
    import httpx  # the HTTP client of the test extra, kept out of the import path of a server install

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    with httpx.Client(timeout=600, limits=limits) as client:
        results, wall = run_clients(
            concurrency,
            requests,
            lambda i: _one_request(client, url, model, PROMPTS[i % len(PROMPTS)], max_tokens, seed=i),
        )
    return summarize(results, wall)


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] * 1e3 for r in results]
    itl = [x * 1e3 for r in results for x in r["itl"]] or [float("nan")]
    return {
        "ttft_p50_ms": float(np.nanpercentile(ttft, 50)),
        "ttft_p99_ms": float(np.nanpercentile(ttft, 99)),
        "itl_p50_ms": float(np.percentile(itl, 50)),
        "itl_p99_ms": float(np.percentile(itl, 99)),
        "out_tok_s": sum(r["tokens"] for r in results) / wall,
    }


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the runs, with out_tok_s and ttft_p50_ms's spread (min, max)."""
    out = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    for k in ("out_tok_s", "ttft_p50_ms"):
        out[k + "_spread"] = [min(r[k] for r in runs), max(r[k] for r in runs)]
    return out


def _line(name: str, c: int, r: dict) -> str:
    return (
        f"{name:<16} concurrency {c:>3}: {r['out_tok_s']:8.1f} out tok/s  TTFT p50 {r['ttft_p50_ms']:7.1f} ms "
        f"p99 {r['ttft_p99_ms']:7.1f} ms  ITL p50 {r['itl_p50_ms']:6.1f} ms p99 {r['itl_p99_ms']:6.1f} ms"
    )


def run(args) -> int:
    from hkserve.bench.serve_runner import prompt_ids, runner_phase, start_runner

    levels = [int(x) for x in args.concurrency.split(",")]
    slots, max_queue = max(args.slots, max(levels)), 4 * max(levels) + 8
    kv = ["--kv-layout", args.kv_layout] + (["--kv-cache-mb", str(args.kv_cache_mb)] if args.kv_cache_mb else [])
    with serving(args.model, slots, max_queue, args.prefill_rows, args.max_len, extra=tuple(kv)) as (url, _):
        _phase(url, args.model, 1, 2, args.max_tokens)  # warm the HTTP path
        print("starting the in-process runner(s) ...", file=sys.stderr, flush=True)
        runners = {"runner": start_runner(args.model, slots, max_queue, args.prefill_rows, args.max_len)}
        if args.compare_prefill_rows:
            runners["runner_prefill_rows_0"] = start_runner(args.model, slots, max_queue, 0, args.max_len)
        ids = prompt_ids(args.model, PROMPTS)
        for runner in runners.values():  # untimed: compiles what the workload uses
            runner_phase(runner, ids, max(levels), max(levels), args.max_tokens)
        report: dict = {name: {} for name in runners}
        try:
            for c in levels:
                n = args.requests or max(4, 3 * c)
                sides: dict[str, list] = {"http": [], **{name: [] for name in runners}}
                for repeat in range(args.repeats):
                    for side in list(sides)[:: -1 if repeat % 2 else 1]:  # alternate the order
                        if side == "http":
                            sides[side].append(_phase(url, args.model, c, n, args.max_tokens))
                        else:
                            sides[side].append(summarize(*runner_phase(runners[side], ids, c, n, args.max_tokens)))
                report[str(c)] = _median(sides.pop("http"))
                print(_line("http", c, report[str(c)]), flush=True)
                for name, runs in sides.items():
                    report[name][str(c)] = _median(runs)
                    print(_line(name, c, report[name][str(c)]), flush=True)
        finally:
            for runner in runners.values():
                runner.stop()
    report["ratios"] = {
        f"http_over_runner_out_tok_s_{c}": report[str(c)]["out_tok_s"] / report["runner"][str(c)]["out_tok_s"]
        for c in levels
    }
    if args.compare_prefill_rows:
        for c in levels:
            before, after = report["runner_prefill_rows_0"][str(c)], report["runner"][str(c)]
            report["ratios"][f"ttft_p50_rows_{args.prefill_rows}_over_rows_0_{c}"] = (
                after["ttft_p50_ms"] / before["ttft_p50_ms"]
            )
    for key, value in report["ratios"].items():
        print(f"{key}: {value:.3f}")
    report["settings"] = {
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "slots": slots,
        "prefill_rows": args.prefill_rows,
        "max_len": args.max_len,
        "kv_layout": args.kv_layout,
        "kv_cache_mb": args.kv_cache_mb,
        "cpus": os.cpu_count(),
    }
    if args.json:
        print(json.dumps(report))
    return 0
