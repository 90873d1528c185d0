"""`hkserve bench soak`: steady mixed traffic against the server for a while, and what it left behind in
the server process: resident memory (VmRSS) and open file descriptors before and after, from /proc.

Closed loop: --concurrency clients, each sending its next request as soon as the last one ended. The
requests cycle through KINDS — completions and chat, whole and streamed, a stream dropped by its
client after its first chunk, a scored prompt (echo + logprobs, max_tokens 0), and invalid requests —
so every kind is sent at least once whatever the duration. The memory figures are taken with the server
idle: after one request of each kind (compiles, first allocations) and after the traffic has drained.
"""

from __future__ import annotations

import collections
import http.client
import itertools
import json
import os
import sys
import threading
import time
from urllib.parse import urlsplit

from hkserve.bench.serve import serving

KINDS = ("completion", "completion_stream", "chat", "chat_stream", "abort", "score", "invalid")
EXPECTED = {"abort": {"aborted"}, "invalid": {"400", "404"}}  # every other kind: 200
INVALID = [  # (path, body): each a client mistake that must be a 4xx
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1}'),
    ("/v1/completions", b'{"prompt": "x", "model": "no-such-model"}'),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ("/v1/chat/completions", b'{"messages": []}'),
]
PROMPTS = ["Once upon a time,", "The capital of France is", "Explain how a bicycle works.", "def fibonacci(n):"]


def add_arguments(p) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long to send traffic")
    p.add_argument("--seconds", type=float, default=None, help="how long to send traffic, instead of --minutes")
    p.add_argument("--url", default=None, help="soak this running server instead of starting one")
    p.add_argument("--pid", type=int, default=None, help="with --url: the server's process id, for its RSS and fds")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    p.add_argument("--slots", type=int, default=8, help="slots of the server started")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")


def process_stats(pid: int | None) -> dict | None:
    """Resident memory (kB) and open file descriptors of a process, from /proc; None without a pid."""
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


class Client:
    """One keep-alive connection; requests of each kind, returning the status as counted ("200", "aborted")."""

    def __init__(self, url: str, model: str, max_tokens: int):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.model, self.max_tokens = model, max_tokens
        self.conn = self._connect()

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=600)

    def _body(self, kind: str, n: int) -> tuple[str, bytes]:
        if kind == "invalid":
            return INVALID[n % len(INVALID)]
        prompt = PROMPTS[n % len(PROMPTS)]
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0.8, "seed": n}
        if kind == "score":
            body.update(prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        elif kind.startswith("chat"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body["stream"] = kind.endswith("stream") or kind == "abort"
        path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
        return path, json.dumps(body).encode()

    def send(self, kind: str, n: int) -> str:
        path, body = self._body(kind, n)
        try:
            self.conn.request("POST", path, body, {"Content-Type": "application/json"})
            response = self.conn.getresponse()
            if kind == "abort" and response.status == 200:
                response.readline()  # the first chunk has come: leave mid-stream
                self.conn.close()
                self.conn = self._connect()
                return "aborted"
            response.read()  # the whole body (a stream up to its [DONE])
            if response.getheader("Connection", "").lower() == "close":
                self.conn.close()
            return str(response.status)
        except (OSError, http.client.HTTPException) as e:
            self.conn.close()
            self.conn = self._connect()
            return f"failed: {type(e).__name__}"


def _traffic(url: str, model: str, max_tokens: int, concurrency: int, seconds: float) -> dict:
    """Send requests until `seconds` have passed and every kind was sent; counts by kind and status."""
    counts: dict = collections.defaultdict(collections.Counter)
    lock, sent = threading.Lock(), itertools.count()
    deadline = time.monotonic() + seconds

    def client():
        c = Client(url, model, max_tokens)
        while True:
            with lock:
                n = next(sent)
            if n >= len(KINDS) and time.monotonic() >= deadline:
                break
            kind = KINDS[n % len(KINDS)]
            status = c.send(kind, n)
            with lock:
                counts[kind][status] += 1
        c.conn.close()

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {kind: dict(counts[kind]) for kind in KINDS}


def _busy(url: str) -> float | None:
    """Requests running or waiting in the server (its /metrics gauges); None if unreadable."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    gauges = ("hkserve_requests_running ", "hkserve_requests_waiting ")
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith(gauges))


def _wait_idle(url: str, within: float = 120) -> bool:
    """Poll until the server has nothing running or waiting (dropped streams end at the next step)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _busy(url) == 0:
            return True
        time.sleep(0.1)
    return False


def soak(url: str, pid: int | None, model: str, seconds: float, concurrency: int, max_tokens: int) -> dict:
    warm = Client(url, model, max_tokens)
    for n, kind in enumerate(KINDS):  # warm-up, not counted: compiles and first allocations
        warm.send(kind, n)
    warm.conn.close()
    _wait_idle(url)
    load_before, before = os.getloadavg()[0], process_stats(pid)
    started = time.monotonic()
    by_kind = _traffic(url, model, max_tokens, concurrency, seconds)
    elapsed = time.monotonic() - started
    idle = _wait_idle(url)
    after, load_after = process_stats(pid), os.getloadavg()[0]
    by_status = collections.Counter()
    for statuses in by_kind.values():
        by_status.update(statuses)
    unexpected = sum(
        n for kind, statuses in by_kind.items() for s, n in statuses.items() if s not in EXPECTED.get(kind, {"200"})
    )
    report = {
        "seconds": round(elapsed, 1),
        "requests": sum(by_status.values()),
        "by_status": dict(by_status),
        "by_kind": by_kind,
        "unexpected": unexpected,
        "idle_after": idle,
        "load_avg_1m": [load_before, load_after],
        "cpus": os.cpu_count(),
        "before": before,
        "after": after,
    }
    if before and after:
        report["rss_growth_pct"] = round(100 * (after["rss_kb"] - before["rss_kb"]) / before["rss_kb"], 2)
        report["fd_growth"] = after["fds"] - before["fds"]
    return report


def _print(report: dict) -> None:
    print(f"{report['requests']} requests in {report['seconds']:.0f} s; by status {report['by_status']}")
    for kind, statuses in report["by_kind"].items():
        print(f"  {kind:<18} {statuses}")
    print(f"unexpected statuses: {report['unexpected']}; server idle after: {report['idle_after']}")
    load = report["load_avg_1m"]
    print(f"load average (1 min) {load[0]:.1f} -> {load[1]:.1f} on {report['cpus']} CPUs")
    before, after = report["before"], report["after"]
    if before and after:
        print(
            f"server RSS {before['rss_kb'] / 1024:.1f} MiB -> {after['rss_kb'] / 1024:.1f} MiB "
            f"({report['rss_growth_pct']:+.2f}%), open fds {before['fds']} -> {after['fds']} ({report['fd_growth']:+d})"
        )
    else:
        print("server RSS and fds: unknown (give --pid with --url)")


def run(args) -> int:
    seconds = args.seconds if args.seconds is not None else 60 * args.minutes
    options = (args.model, seconds, args.concurrency, args.max_tokens)
    if args.url:
        report = soak(args.url, args.pid, *options)
    else:
        with serving(args.model, args.slots, max(64, 2 * args.concurrency)) as (url, server):
            report = soak(url, server.pid, *options)
    _print(report)
    if args.json:
        print(json.dumps(report))
    sys.stdout.flush()
    return 0 if report["unexpected"] == 0 and report["idle_after"] else 1
