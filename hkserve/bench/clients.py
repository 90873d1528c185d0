"""Closed-loop load: client threads that each send their next request as soon as the last one ended,
the same way for the HTTP server (bench/serve_http.py) and the in-process runner (bench/serve_runner.py)."""

from __future__ import annotations

import itertools
import threading
import time


def run_clients(concurrency: int, requests: int | None, one, stop: threading.Event | None = None) -> tuple[list, float]:
    """`concurrency` client threads share `requests` calls of one(i) (None: no count) until `stop` is set
    (no call begins after it; those under way finish) → (the results, the wall time). A call's exception
    stops the others from beginning more and is raised here, never lost with its thread."""
    stop = stop or threading.Event()
    results, errors, lock, counter = [], [], threading.Lock(), itertools.count()

    def client():
        while True:
            with lock:
                i = next(counter)
                if stop.is_set() or errors or (requests is not None and i >= requests):
                    return
            try:
                r = one(i)
            except BaseException as e:  # re-raised in the caller's thread below
                with lock:
                    errors.append(e)
                return
            with lock:
                results.append(r)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, time.perf_counter() - started
