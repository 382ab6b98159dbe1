"""The gateway's Prometheus metrics, bound to an injected registry (tests build a fresh one); served on the
gateway's own listener at ``/metrics``."""

from __future__ import annotations

from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)

from warmpool.build import build_version

__all__ = ["GatewayMetrics"]

# Queue waits and LLM requests: milliseconds (a free endpoint) to a minute (a long generation, a long wait).
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        if GC_COLLECTOR is not None:
            GCCollector(registry=r)
        Gauge("pulsescale_build_info", "The running build (value 1)", ["version"], registry=r).labels(
            build_version()
        ).set(1)
        self.responses = Counter(
            "pulsescale_gateway_responses_total",
            "Responses by model and HTTP status (429: queue full, 504: timed out, 502: every upstream broke)",
            ["model", "code"],
            registry=r,
        )
        self.queue_depth = Gauge("pulsescale_gateway_queue_depth", "Requests waiting", ["model"], registry=r)
        self.inflight = Gauge("pulsescale_gateway_inflight", "Requests at an upstream", ["model"], registry=r)
        self.endpoints = Gauge(
            "pulsescale_gateway_ready_endpoints", "Ready slots the gateway routes to", ["model"], registry=r
        )
        self.queue_wait = Histogram(
            "pulsescale_gateway_queue_wait_seconds",
            "Arrival to dispatch to an upstream (first attempt)",
            ["model"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "pulsescale_gateway_request_seconds",
            "Arrival to the end of the response, requests an upstream answered",
            ["model"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pulsescale_gateway_retries_total",
            "Requests put back in the queue because their upstream broke before answering",
            ["model"],
            registry=r,
        )
        self.broken_streams = Counter(
            "pulsescale_gateway_broken_streams_total",
            "Streamed responses cut because the upstream broke after the first bytes went to the client",
            ["model"],
            registry=r,
        )
        self.samples = Counter(
            "pulsescale_gateway_samples_published_total", "Queue samples published", ["model"], registry=r
        )
        self.rejected_records = Counter(
            "pulsescale_gateway_rejected_records_total",
            "pulse_slots records that broke the contract, by reason",
            ["reason"],
            registry=r,
        )
