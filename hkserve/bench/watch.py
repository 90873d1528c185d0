"""The server's side of a `bench serve` phase: the most requests running at once (sampled) and the
preemptions it counted, read from its /metrics (`hkserve_requests_running`, `hkserve_preemptions_total`)
or, for the in-process runner, from the runner itself.

`peak_running` is the largest of the samples taken every INTERVAL seconds from the phase's start to its
end, so it can miss a peak shorter than that. `preemptions` is the counter's growth over the phase, None
where the server exports no such counter (a server without preemption): never a made-up 0.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from typing import NamedTuple
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families

INTERVAL = 0.2  # seconds between samples: requests run for many 10-100 ms steps; few scrapes, little load
RUNNING = "hkserve_requests_running"
PREEMPTIONS = "hkserve_preemptions_total"


class Sample(NamedTuple):
    running: int
    preemptions: float | None  # the counter's value; None: not exported


class Figures(NamedTuple):
    peak_running: int
    preemptions: int | None  # over the phase; None: not exported


def parse(text: str) -> Sample:
    """A Prometheus text exposition's running requests and preemptions counter (summed over its labels,
    should it have any)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    if RUNNING not in values:
        raise ValueError(f"the server's /metrics has no {RUNNING}")
    return Sample(int(values[RUNNING]), values.get(PREEMPTIONS))


def scrape(url: str) -> Sample:
    """GET url/metrics → its Sample (one short connection: the phase's clients keep theirs)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read().decode()
        if response.status != 200:
            raise RuntimeError(f"/metrics answered {response.status}: {body[:200]}")
        return parse(body)
    finally:
        conn.close()


def watch(read: Callable[[], Sample], stopped: Callable[[float], bool], interval: float = INTERVAL) -> Figures:
    """read() now, then after each `stopped(interval)` that returns False, and once more when it returns
    True → the phase's Figures."""
    first = last = read()
    peak = first.running
    while True:
        done = stopped(interval)
        last = read()
        peak = max(peak, last.running)
        if done:
            break
    if first.preemptions is None or last.preemptions is None:
        return Figures(peak, None)
    return Figures(peak, int(last.preemptions - first.preemptions))


class Watcher:
    """watch() in a thread for the length of a `with` block; `figures` once the block has ended."""

    def __init__(self, read: Callable[[], Sample], interval: float = INTERVAL):
        self.read, self.interval = read, interval
        self.figures: Figures | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._started = threading.Event()

    def _run(self) -> None:
        def read() -> Sample:
            sample = self.read()
            self._started.set()  # the phase starts after the first sample
            return sample

        try:
            self.figures = watch(read, self._stop.wait, self.interval)
        except BaseException as e:  # re-raised in the caller's thread
            self._error = e
            self._started.set()

    def __enter__(self) -> Watcher:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error:
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._error and exc[0] is None:
            raise self._error
