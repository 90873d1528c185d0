"""Prometheus metrics of the server (one registry per app, so tests can build several apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

MASK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self, stats_fn):
        """`stats_fn()` → RunnerStats (slots, running, waiting, the kv pool, preemptions), read at scrape time."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "hkserve_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "hkserve_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hkserve_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "hkserve_queue_time_seconds",
            "Time from arrival to admission into a slot",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("hkserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("hkserve_generation_tokens", "Tokens generated", registry=r)
        self.constrained_requests = Counter(
            "hkserve_constrained_requests", "Requests (choices) whose output a grammar constrains", registry=r
        )
        self.mask_time = Histogram(
            "hkserve_grammar_mask_seconds",
            "Host time to fill the token bitmasks of one step (all constrained slots) or of a first token",
            buckets=MASK_BUCKETS,
            registry=r,
        )
        self.prefix_lookup_tokens = Counter(
            "hkserve_prefix_cache_lookup_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "hkserve_prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache reused", registry=r
        )
        self.requests = Counter("hkserve_requests", "Finished requests (one per choice)", ["finish_reason"], registry=r)
        running = Gauge("hkserve_requests_running", "Requests holding a slot", registry=r)
        waiting = Gauge("hkserve_requests_waiting", "Requests in the admission queue", registry=r)
        slots = Gauge("hkserve_slots_total", "Decode slots", registry=r)
        used = Gauge("hkserve_slot_usage_ratio", "Fraction of slots in use", registry=r)
        running.set_function(lambda: stats_fn().running)
        waiting.set_function(lambda: stats_fn().waiting)
        slots.set_function(lambda: stats_fn().slots)
        used.set_function(lambda: stats_fn().running / max(stats_fn().slots, 1))
        blocks = Gauge("hkserve_kv_blocks_total", "Blocks of the paged KV pool (0: static layout)", registry=r)
        held = Gauge(
            "hkserve_kv_blocks_used",
            "Paged KV blocks named by running or cached slots, a shared block once",
            registry=r,
        )
        blocks.set_function(lambda: stats_fn().kv_blocks_total)
        held.set_function(lambda: stats_fn().kv_blocks_used)
        r.register(
            RunnerCounter("hkserve_preemptions", "Requests preempted to free KV blocks", lambda: stats_fn().preemptions)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RunnerCounter:
    """A counter the runner's loop keeps (in its stats snapshot), exported as `<name>_total` at scrape time."""

    def __init__(self, name: str, documentation: str, read):
        self.name, self.documentation, self.read = name, documentation, read

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation)
        family.add_metric([], self.read())
        yield family
