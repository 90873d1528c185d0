"""Where `hkserve serve`'s start-up goes: a timeline of its phases (model load, engine build, warm-up),
the compiles inside them (JAX's own monitoring events: programs compiled or loaded from the persistent
cache, the time spent tracing, lowering and compiling) and the memory it holds once ready.

The server logs the result as one INFO line, `startup: {json}`, when it turns ready; `hkserve bench
startup` reads it (bench/startup.py) and the warm-start test counts its cache misses (a second start
that compiles anything is a start-up regression).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import jax
import psutil

from hkserve.engine.forwarding import base_engine

# JAX's monitoring events (jax/_src/dispatch.py, compiler.py, compilation_cache.py).
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE = "/jax/core/compile/backend_compile_duration"  # around every compile, loaded from the cache or not
CACHE_HITS = "/jax/compilation_cache/cache_hits"
CACHE_WRITES = "/jax/compilation_cache/cache_misses"  # JAX counts a miss where it writes the new entry


class CompileCounter:
    """Counts the programs compiled in this process and when: every jit program (an eager op is one too)
    passes through COMPILE once per new shape, and CACHE_HITS when it came from the persistent cache, so
    programs - hits were compiled here, whether the cache skipped them or missed them."""

    def __init__(self):
        self._lock = threading.Lock()  # the warm-up runs on its own thread
        self.programs = self.hits = self.writes = 0
        self.spans: list[tuple[float, float]] = []  # (start, end) of each trace, lowering or compile, time.time()
        self.seconds = dict.fromkeys(("trace", "lower", "compile"), 0.0)  # summed by kind (nested traces twice)
        jax.monitoring.register_event_listener(self._event)
        jax.monitoring.register_event_time_span_listener(self._span)

    def close(self) -> None:
        jax.monitoring.unregister_event_listener(self._event)
        jax.monitoring.unregister_event_time_span_listener(self._span)

    def _event(self, event: str, **_) -> None:
        with self._lock:
            self.hits += event == CACHE_HITS
            self.writes += event == CACHE_WRITES

    def _span(self, event: str, start: float, end: float, **_) -> None:
        kind = {TRACE: "trace", LOWER: "lower", COMPILE: "compile"}.get(event)
        if kind:
            with self._lock:
                self.spans.append((start, end))
                self.seconds[kind] += end - start
                self.programs += event == COMPILE

    def seconds_within(self, start: float, end: float) -> float:
        """Wall time between start and end spent compiling: the union of the spans (a jit traced inside
        another's trace nests in it), clipped to [start, end]."""
        with self._lock:
            spans = sorted((max(s, start), min(e, end)) for s, e in self.spans if e > start and s < end)
        total, reach = 0.0, start
        for s, e in spans:
            if e > reach:
                total += e - max(s, reach)
                reach = e
        return total


@dataclasses.dataclass
class Phase:
    name: str
    start: float  # time.time()
    end: float


def tree_bytes(tree) -> int:
    return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree) if hasattr(leaf, "nbytes"))


class StartupTimeline:
    """The phases of one start, timed on the wall clock, with the compiles inside each."""

    def __init__(self):
        self.process_start = psutil.Process().create_time()
        self.compiles = CompileCounter()
        # Up to here: the interpreter and the imports (hkserve, JAX, the HTTP stack), before serve runs.
        self.phases = [Phase("imports", self.process_start, time.time())]
        self.stored_weights_bytes = 0  # the weights as read from the store, before packing

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.phases.append(Phase(name, start, time.time()))

    def report(self, engine) -> dict:
        """Seconds by part (each phase less its compiles, the compiles, the rest since the process
        started: tokenizer, HTTP app, threads), the compile counts, and the memory held: see `memory`.
        Taken once, at ready: the counting stops here (a long-running server keeps no list of spans)."""
        now = time.time()
        self.compiles.close()
        seconds = {}
        for p in self.phases:
            compiling = self.compiles.seconds_within(p.start, p.end)
            seconds[p.name] = round(p.end - p.start - compiling, 3)
            seconds["compile"] = round(seconds.get("compile", 0.0) + compiling, 3)
        seconds["other"] = round(now - self.process_start - sum(seconds.values()), 3)
        programs, hits = self.compiles.programs, self.compiles.hits
        return {
            "ready_s": round(now - self.process_start, 3),
            "seconds": seconds,
            "compiles": {"programs": programs, "cache_hits": hits, "cache_misses": programs - hits},
            "compile_seconds": {k: round(v, 3) for k, v in self.compiles.seconds.items()},
            "cache_writes": self.compiles.writes,
            "memory": memory(base_engine(engine), self.stored_weights_bytes),
        }


def memory(engine, stored_weights_bytes: int) -> dict:
    """Bytes held, by what the engine knows exactly: the served params (packed where the kernels read
    them packed), the KV memory; the rest of JAX's live arrays (decode state, any copy still held);
    and what resident memory holds besides arrays (Python, tokenizer, XLA executables, allocator)."""
    rss = psutil.Process().memory_info().rss
    live = sum(a.nbytes for a in jax.live_arrays())
    params, kv = tree_bytes(engine.params), tree_bytes(engine.state.memory)
    return {
        "rss": rss,
        "stored_weights": stored_weights_bytes,
        "served_params": params,
        "kv": kv,
        "other_arrays": live - params - kv,
        "not_arrays": rss - live,
    }
