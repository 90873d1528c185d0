"""Speculative decoding's counters on /metrics, read from the runner at scrape time (a runner whose
engine does not speculate adds nothing)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hkserve.engine.protocols import ServingRunner
from hkserve.engine.spec_policy import SpecCounts


class SpecCollector:
    def __init__(self, counts: Callable[[], SpecCounts]):
        self.counts = counts

    def collect(self):
        counts = self.counts()
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


def register(registry: CollectorRegistry, runner: ServingRunner) -> None:
    """Add the collector when the runner's engine speculates."""
    if runner.spec_counts() is not None:
        registry.register(SpecCollector(runner.spec_counts))
