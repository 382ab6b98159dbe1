"""The gateway's Prometheus metrics, bound to an injected registry (tests build a fresh one); served at ``/metrics``
on the clients' listener, or on its own (`GatewaySettings.metrics_host`).

Series labelled by model exist only for models the gateway serves (`gateway.catalog`): a name a client makes up is
refused before anything is labelled with it. Refusals are counted by reason (`gateway.errors.REASONS`), every reason
present from the start."""

from __future__ import annotations

import contextlib

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from gateway.errors import REASONS
from warmpool.build import register_process

__all__ = ["GatewayMetrics"]

# Queue waits and LLM requests: milliseconds (a free endpoint) to a minute (a long generation, a long wait).
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        register_process(r, "gateway")
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
        self.refused = Counter(
            "pulsescale_gateway_refused_total",
            "Requests and connections refused before any upstream saw them, by reason (gateway.errors)",
            ["reason"],
            registry=r,
        )
        for reason in REASONS:
            self.refused.labels(reason)
        self.connections = Gauge(
            "pulsescale_gateway_connections", "Open client connections, by listener", ["listener"], registry=r
        )
        self.body_budget_used = Gauge(
            "pulsescale_gateway_body_budget_used_bytes",
            "Bytes of request bodies held by requests being read or waiting for a slot",
            registry=r,
        )
        self.body_budget = Gauge(
            "pulsescale_gateway_body_budget_bytes", "The limit of pulsescale_gateway_body_budget_used_bytes", registry=r
        )
        self.queues = Gauge("pulsescale_gateway_queues", "Model queues the gateway keeps", registry=r)
        self.queues_reclaimed = Counter(
            "pulsescale_gateway_queues_reclaimed_total",
            "Idle queues dropped (their model no longer known, or idle for queue_idle_s)",
            registry=r,
        )
        self.rejected_records = Counter(
            "pulsescale_gateway_rejected_records_total",
            "pulse_slots, pulse_scalers and pulse_assignments records that broke the contract, by reason "
            "(unassigned_model: a ready slot not routed, its node not assigned its model; once per record)",
            ["reason"],
            registry=r,
        )
        self.rejected_records.labels("unassigned_model")  # present from the start: an alert needs no first refusal

    def forget(self, model: str) -> None:
        """Drop `model`'s gauges (its queue was reclaimed: no queue, no depth). Its counters stay, as counters do;
        only models a trusted source named ever get any."""
        for gauge in (self.queue_depth, self.inflight, self.endpoints):
            with contextlib.suppress(KeyError):  # never set
                gauge.remove(model)
