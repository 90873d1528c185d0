"""`hkserve bench startup`: how long `hkserve serve` takes from its launch to /health 200, and what it holds
then, cold (an empty compile cache) and warm (the cache the cold start filled), per weight variant.

The split comes from the server's own `startup: {json}` log line (cli/startup.py): model load, weight
packing (with the KV allocation), compiles (programs compiled here vs loaded from the cache), warm-up
runs and the rest (imports, tokenizer, HTTP app; "other"); `compiled_s`, from its `compiled: {json}`
line: seconds until the programs left for after ready (`serve --compile background`) were compiled too.
Its resident memory is read from /proc here as well, with the server's breakdown (served params, KV
memory, other JAX arrays, not arrays).
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import psutil

from hkserve.bench import llama_rss
from hkserve.bench.soak import process_stats
from hkserve.checkpoint.store import ModelStore
from hkserve.engine.background_compile import COMPILED_LINE

STARTUP_LINE = "startup: "


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--weights", default="f32,int8", help="comma list of weight variants, each started cold then warm")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--serve-args", default="", help='more of serve\'s flags, e.g. "--kv-layout static"')
    p.add_argument("--warm-starts", type=int, default=1, help="warm starts after each cold one")
    p.add_argument("--ready-within", type=float, default=1800, help="seconds a start may take before it fails")
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
    p.add_argument("--server-log", action="store_true", help="echo each server's log lines to stderr as they come")
    p.add_argument(
        "--llama-gguf",
        metavar="FILE",
        help="also measure llama.cpp's RSS on this GGUF (llama-cpp-python, n_ctx = slots x max-len, one request) "
        "and print each start's RSS as a ratio of it",
    )


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:  # not listening yet, or reset while uvicorn starts
        return False
    finally:
        conn.close()


def _lines(stream, echo: bool = False) -> queue.SimpleQueue:
    """The server's log lines as they come (a reader thread keeps its pipe drained); `echo`: each also
    to stderr as it comes, prefixed "serve| " (--server-log: where a slow start spends its time)."""
    lines: queue.SimpleQueue = queue.SimpleQueue()

    def read():
        for line in stream:
            if echo:
                print(f"serve| {line}", end="", file=sys.stderr, flush=True)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _logged(lines: queue.SimpleQueue, marker: str, within: float) -> dict:
    """The JSON of the server's next log line holding `marker` (`startup: {json}`, logged as /health turns
    200; `compiled: {json}`, once the background compiles are done)."""
    deadline = time.monotonic() + within
    while True:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        if line is None:
            raise RuntimeError(f"the server exited before logging {marker.strip()!r}")
        if marker in line:
            return json.loads(line.split(marker, 1)[1])


def _post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _one_chat(port: int, model: str) -> str:
    """One short greedy chat request (16 tokens), as llama_rss.py's probe sends llama.cpp; a model without
    a chat template (a base model) gets the same prompt as a completion. Its text: a warm start's must be
    the cold start's (programs loaded through the program index run the same executables)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16, "temperature": 0}
    status, reply = _post(port, "/v1/chat/completions", body)
    if status == 400 and b"no chat template" in reply:
        del body["messages"]
        status, reply = _post(port, "/v1/completions", {**body, "prompt": "Say hello."})
    if status != 200:
        raise RuntimeError(f"the request failed: {status} {reply[:500]!r}")
    choice = json.loads(reply)["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def start_once(args, weights: str, cache: str) -> dict:
    """One start of `serve` with this compile cache: seconds to /health 200 seen from here, the server's
    split and memory, its VmRSS then, and its VmRSS after one chat request once every program is
    compiled (a request's run allocates its programs' temp memory), and that request's seconds with
    those of the same request sent again."""
    port = _port()
    cmd = [sys.executable, "-m", "hkserve.cli.main", "serve", "--model", args.model, "--port", str(port)]
    cmd += ["--slots", str(args.slots), "--max-len", str(args.max_len), "--weights", weights]
    cmd += shlex.split(args.serve_args)
    env = {**os.environ, "HKSERVE_COMPILE_CACHE": cache}
    launched = time.perf_counter()
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        lines = _lines(server.stderr, echo=args.server_log)
        deadline = launched + args.ready_within
        while not _healthy(port):
            if server.poll() is not None or time.perf_counter() > deadline:
                raise RuntimeError(f"serve --weights {weights} was not ready (exit code {server.poll()})")
            time.sleep(0.05)
        ready_s = time.perf_counter() - launched
        record = _logged(lines, STARTUP_LINE, within=60)
        record["ready_s_client"] = round(ready_s, 3)
        record["rss_mib_client"] = round(process_stats(server.pid)["rss_kb"] / 1024, 1)
        record["cpu_s_client"] = _cpu_seconds(server.pid)
        split = ", ".join(f"{k} {v:.1f}" for k, v in record["seconds"].items())
        print(
            f"{weights}: ready after {ready_s:.1f} s ({split}); waiting for the programs left for after ready",
            flush=True,
        )
        record["compiled"] = _logged(lines, COMPILED_LINE, within=args.ready_within)  # the programs, all loaded
        record["compiled_s"] = record["compiled"]["finished_s"]
        record["rss_mib_compiled"] = round(process_stats(server.pid)["rss_kb"] / 1024, 1)
        record["cpu_s_compiled"] = _cpu_seconds(server.pid)
        sent = time.perf_counter()
        record["reply"] = _one_chat(port, args.model)
        record["first_request_s"] = round(time.perf_counter() - sent, 3)
        record["rss_mib_after_request"] = round(process_stats(server.pid)["rss_kb"] / 1024, 1)
        sent = time.perf_counter()
        _one_chat(port, args.model)  # the same again: what the first paid for being first (pages, caches)
        record["second_request_s"] = round(time.perf_counter() - sent, 3)
        return record
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all its threads) the server has used so far: unlike its wall-clock
    seconds, what a start costs whatever else runs on the machine."""
    times = psutil.Process(pid).cpu_times()
    return round(times.user + times.system, 1)


def _summary(weights: str, start: str, r: dict) -> str:
    s, c, m, index = r["seconds"], r["compiles"], r["memory"], r["compiled"]
    mib = {k: round(v / 2**20) for k, v in m.items()}
    parts = ", ".join(f"{k} {v:.1f}" for k, v in s.items())
    return (
        f"{weights:>5} {start:>4}: ready {r['ready_s_client']:.1f} s ({parts}), all compiled {r['compiled_s']:.1f} s; "
        f"CPU {r['cpu_s_client']:.1f} s to ready, {r['cpu_s_compiled']:.1f} s to all compiled; "
        f"programs {c['programs']}, "
        f"cache hits {c['cache_hits']}, misses {c['cache_misses']}; "
        f"program index hits {index.get('index_hits', 0)}, misses {index.get('index_misses', 0)}; "
        f"RSS {r['rss_mib_client']:.0f} MiB, all compiled "
        f"{r['rss_mib_compiled']:.0f}, after a request {r['rss_mib_after_request']:.0f} "
        f"(served params {mib['served_params']}, KV {mib['kv']}, other arrays {mib['other_arrays']}, "
        f"not arrays {mib['not_arrays']}); first request {r['first_request_s']:.2f} s, "
        f"again {r['second_request_s']:.2f} s"
        + (
            f"; {r['rss_vs_llama']:.2f}x llama.cpp's ({r['rss_after_request_vs_llama']:.2f}x after a request)"
            if "rss_vs_llama" in r
            else ""
        )
    )


def _llama(args) -> dict | None:
    """llama.cpp's RSS for the same KV capacity (bench/llama_rss.py), or None without --llama-gguf."""
    if not args.llama_gguf:
        return None
    llama = llama_rss.llama_rss(args.llama_gguf, n_ctx=args.slots * args.max_len)
    print(
        f"llama.cpp n_ctx {llama['n_ctx']}: RSS {llama['rss_mib_after_request']:.0f} MiB after one request", flush=True
    )
    return llama


def run(args) -> int:
    if args.llama_gguf:
        try:
            llama_rss.check_available(args.llama_gguf)
        except llama_rss.LlamaUnavailable as e:
            print(f"hkserve bench startup: {e}", file=sys.stderr)
            return 2
    llama = _llama(args)
    runs = []
    for weights in [w.strip() for w in args.weights.split(",") if w.strip()]:
        # The variant made (and packed) once here, as `hkserve pull --weights` makes it: a conversion's
        # cost, not a start's, and the cold start then compiles the programs of a start only.
        ModelStore().variant_path(args.model, weights)
        cache = tempfile.mkdtemp(prefix="hkserve-startup-cache-")  # empty: the first start is cold
        try:
            for n in range(1 + args.warm_starts):
                start = "warm" if n else "cold"
                record = start_once(args, weights, cache)
                if llama:
                    for mine, ratio in (
                        ("rss_mib_client", "rss_vs_llama"),
                        ("rss_mib_after_request", "rss_after_request_vs_llama"),
                    ):
                        record[ratio] = round(record[mine] / llama["rss_mib_after_request"], 2)
                runs.append({"weights": weights, "start": start, **record})
                print(_summary(weights, start, record), flush=True)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
    if args.json:
        setup = {"model": args.model, "slots": args.slots, "max_len": args.max_len, "serve_args": args.serve_args}
        print(json.dumps({**setup, "runs": runs, **({"llama": llama} if llama else {})}))
    return 0
