"""Prometheus metrics of one server (its own registry, so several apps in one process do not collide)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

#: seconds: from a few steps of a small model to a long beam search on a CPU
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class _EngineCounters:
    """The engine's counters read at scrape time (the engine thread only adds to plain ints)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats
        for name, doc, value in (
            ("fastgen_generated_tokens", "Tokens generated (new tokens of finished inputs)", stats.generated_tokens),
            ("fastgen_steps", "Decoder steps run", stats.steps),
            ("fastgen_step_rows", "Decoder rows summed over steps", stats.rows),
            ("fastgen_inputs_finished", "Inputs finished", stats.finished),
            ("fastgen_inputs_failed", "Inputs that raised (alone)", stats.failed),
            ("fastgen_inputs_cancelled", "Inputs cancelled (client gone)", stats.cancelled),
            ("fastgen_busy_seconds", "Wall time in decoder steps (/ fastgen_steps: a step)", stats.busy_seconds),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class Metrics:
    def __init__(self, engine: Any) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("fastgen_queue_depth", "Inputs waiting to join the batch", registry=r).set_function(
            lambda: engine.queue_depth
        )
        Gauge("fastgen_rows_in_flight", "Decoder rows of the inputs in the batch", registry=r).set_function(
            lambda: engine.rows_in_flight
        )
        r.register(_EngineCounters(engine))
        self.requests = Counter(
            "fastgen_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.latency = Histogram(
            "fastgen_request_latency_seconds",
            "Request latency (received to answered)",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "fastgen_time_to_first_token_seconds",
            "Received to the first decoder step of the request's input",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "fastgen_queue_wait_seconds", "Received to joined the batch", buckets=_LATENCY_BUCKETS, registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
