"""Speculative decoding's counters on /metrics, read from the engine at scrape time (an engine that
does not speculate adds nothing)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hkserve.engine.speculative import SpeculativeEngine


class SpecCollector:
    def __init__(self, engine: SpeculativeEngine):
        self.engine = engine

    def collect(self):
        counts = self.engine.counts
        yield CounterMetricFamily(
            "hkserve_spec_draft_tokens", "Draft tokens proposed by n-gram lookup", value=counts.drafted
        )
        yield CounterMetricFamily(
            "hkserve_spec_accepted_tokens", "Draft tokens accepted by verify steps", value=counts.accepted
        )
        yield CounterMetricFamily(
            "hkserve_spec_verify_steps", "Slot-steps that verified at least one draft", value=counts.verify_rows
        )
        yield GaugeMetricFamily(
            "hkserve_spec_mean_accepted_length",
            "Accepted draft tokens per slot-step that verified drafts, since start",
            value=counts.mean_accepted,
        )


def register(registry: CollectorRegistry, runner) -> None:
    """Add the collector when the runner's engine speculates."""
    engine = getattr(runner, "engine", None)
    if isinstance(engine, SpeculativeEngine):
        registry.register(SpecCollector(engine))
