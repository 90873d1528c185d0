"""Closed-loop load: client threads that each send their next request as soon as the last one ended,
the same way for the HTTP server (bench/serve.py) and the in-process runner (bench/serve_runner.py)."""

from __future__ import annotations

import threading
import time


def run_clients(concurrency: int, requests: int, one) -> tuple[list[dict], float]:
    """`concurrency` client threads share `requests` calls of one(i) → (the results, the wall time)."""
    results, lock, counter = [], threading.Lock(), iter(range(requests))

    def client():
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = one(i)
            with lock:
                results.append(r)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - started
