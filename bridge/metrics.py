"""The bridge's Prometheus metrics, bound to an injected registry (tests build a fresh one), served on ``/metrics``.

Per source (label ``source``: a target's URL, a slot's key, ``query:<model>``): reads made, bad input by reason
(every reason of `bridge.errors.REASONS` present from the source's start), dropped with the source. Per model: the
age of its oldest source's last good reading (past its bound the samples stop), whether its samples go out, how
often they stopped, the last demand published."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bridge.errors import REASONS
from warmpool.build import register_process

__all__ = ["BridgeMetrics"]

# A scrape on loopback takes a millisecond; the timeout is 500 ms by default.
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class BridgeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        register_process(r, "bridge")
        self.reads = Counter(
            "pulsescale_bridge_reads_total",
            "Scrapes of engine pages and queries made, by source",
            ["source"],
            registry=r,
        )
        self.errors = Counter(
            "pulsescale_bridge_errors_total",
            "Bad input by source and reason (bridge.errors); every reason but counter_reset and bad_model_name "
            "failed the read (on a page of several models, that model's part of it)",
            ["source", "reason"],
            registry=r,
        )
        self.read_seconds = Histogram(
            "pulsescale_bridge_read_seconds",
            "Time one scrape or query took, by kind (target, slot, query)",
            ["kind"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.sources = Gauge("pulsescale_bridge_sources", "Sources read, by kind", ["kind"], registry=r)
        self.reading_age = Gauge(
            "pulsescale_bridge_reading_age_seconds",
            "Age of the model's oldest source's last good reading (its samples stop past that source's bound)",
            ["model"],
            registry=r,
        )
        self.publishing = Gauge(
            "pulsescale_bridge_publishing",
            "1 while the model's samples go out, 0 while a source of it failed or went stale",
            ["model"],
            registry=r,
        )
        self.stopped = Counter(
            "pulsescale_bridge_samples_stopped_total",
            "Times the model's samples stopped because a source of it failed or went stale",
            ["model"],
            registry=r,
        )
        self.samples = Counter(
            "pulsescale_bridge_samples_published_total", "Queue samples published", ["model"], registry=r
        )
        self.queue_depth = Gauge(
            "pulsescale_bridge_queue_depth",
            "Requests waiting, as last published (vLLM: waiting)",
            ["model"],
            registry=r,
        )
        self.inflight = Gauge(
            "pulsescale_bridge_inflight",
            "Requests in flight, as last published (vLLM: running; a query: its value)",
            ["model"],
            registry=r,
        )
        self.rejected_records = Counter(
            "pulsescale_bridge_rejected_records_total",
            "pulse_slots and pulse_scalers records that broke the contract, by reason (bad_source: a ScaledObject "
            "trigger's source block; its last good one stands)",
            ["reason"],
            registry=r,
        )

    def source_added(self, source: str) -> None:
        self.reads.labels(source)
        for reason in REASONS:
            self.errors.labels(source, reason)

    def source_removed(self, source: str) -> None:
        with contextlib.suppress(KeyError):
            self.reads.remove(source)
        for reason in REASONS:
            with contextlib.suppress(KeyError):
                self.errors.remove(source, reason)

    def model_added(self, model: str, age: Callable[[], float]) -> None:
        self.reading_age.labels(model).set_function(age)
        self.publishing.labels(model).set(0)

    def model_removed(self, model: str) -> None:
        """`model` has no source left: its gauges go (its counters stay, as counters do)."""
        for gauge in (self.reading_age, self.publishing, self.queue_depth, self.inflight):
            with contextlib.suppress(KeyError):
                gauge.remove(model)
