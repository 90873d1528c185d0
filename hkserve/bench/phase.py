"""One measured phase of `hkserve bench serve`, the same for the HTTP side (bench/serve_http.py) and the
in-process runner's (bench/serve_runner.py): closed-loop clients while a Watcher samples the server and
long prompts arrive beside them, until the requests are sent or --duration-s has passed → the phase's
figures; and a side's figures over its repeated phases.

Only served requests give latencies and tokens; refused attempts (bench/refusals.py) are counted apart,
so an overloaded server's phase reports what it served and how often it said no.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from typing import NamedTuple

import numpy as np

from hkserve.bench.arrivals import long_prompts
from hkserve.bench.refusals import REJECTED, RETRIES, Outcome
from hkserve.bench.watch import Figures, Watcher


class Load(NamedTuple):
    """What one phase sends."""

    concurrency: int  # closed-loop clients
    requests: int | None  # requests in all; None: as many as begin within `duration`
    duration: float | None = None  # seconds after which no request or retry begins; None: no bound
    every: float | None = None  # a long prompt arrives every `every` seconds beside them; None: none
    retries: int = RETRIES  # of a request refused with 429 (bench/refusals.py)


def measure(clients, read, every: float | None, long_one, duration: float | None = None) -> dict:
    """clients(stop) → (their Outcomes, wall) while a Watcher samples read() and long_one(k, stop) arrives
    every `every` seconds → summarize's figures. `stop`, a threading.Event, is set `duration` seconds in
    (None: never) and once the clients end, so the long prompts still waiting to retry give up."""
    stop = threading.Event()
    with Watcher(read) as watcher, long_prompts(every, lambda k: long_one(k, stop)) as longs, _stopping(stop, duration):
        results, wall = clients(stop)
    return summarize(results, wall, watcher.figures, longs)


@contextlib.contextmanager
def _stopping(stop: threading.Event, duration: float | None):
    """Sets `stop` after `duration` seconds (None: never) or when the block ends, whichever comes first."""
    timer = threading.Timer(duration, stop.set) if duration is not None else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        stop.set()


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(results: list[Outcome], wall: float, figures: Figures, longs: list[Outcome] = ()) -> dict:
    """The measured clients' figures over their served requests (the long prompts' `longs` only counted,
    never mixed in); a latency is None when no request gave one. `errors_by_status` counts every refused
    attempt by status, the 429s (`rejected`) included."""
    served = [r for r in results if r.served]
    ttft = [r.ttft * 1e3 for r in served if not np.isnan(r.ttft)]
    itl = [x * 1e3 for r in served for x in r.itl]
    refusals = Counter(status for r in results for status in r.refusals)
    return {
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "itl_p50_ms": _percentile(itl, 50),
        "itl_p99_ms": _percentile(itl, 99),
        "out_tok_s": sum(r.tokens for r in served) / wall,
        "peak_running": figures.peak_running,
        "preemptions": figures.preemptions,
        "long_prompts": len(longs),
        "served": len(served),
        "rejected": refusals[REJECTED],
        "errors_by_status": dict(sorted(refusals.items())),
        "long_prompts_served": sum(r.served for r in longs),
        "long_errors_by_status": dict(sorted(Counter(s for r in longs for s in r.refusals).items())),
    }


def medians(runs: list[dict]) -> dict:
    """Each figure's median over the runs (None where a run has none), with out_tok_s and ttft_p50_ms's
    spread (min, max); the counts by status are summed instead, so one run's errors are not hidden."""
    out = {}
    for k in runs[0]:
        values = [r[k] for r in runs]
        if isinstance(values[0], dict):
            out[k] = dict(sorted(sum((Counter(v) for v in values), Counter()).items()))
        else:
            out[k] = None if None in values else float(np.median(values))
    for k in ("out_tok_s", "ttft_p50_ms"):
        values = [r[k] for r in runs if r[k] is not None]
        out[k + "_spread"] = [min(values), max(values)] if values else None
    return out
