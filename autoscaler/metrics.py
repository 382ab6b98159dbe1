"""The autoscaler's Prometheus metrics, bound to an injected registry (tests build a fresh one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["AutoscalerMetrics"]

# Decision latency lives in milliseconds-to-seconds territory; activation stages in tens of ms to seconds.
_DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_ACTIVATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.decision_seconds = Histogram(
            "pulsescale_decision_seconds",
            "Sample received to scaling decision made",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.claim_latency_seconds = Histogram(
            "pulsescale_decision_to_claim_seconds",
            "Scale-up decision to the slot claim written",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.desired = Gauge("pulsescale_desired_replicas", "Replicas the policy wants", ["model"], registry=r)
        self.ready = Gauge("pulsescale_ready_replicas", "Replicas serving", ["model"], registry=r)
        self.activating = Gauge(
            "pulsescale_activating_replicas", "Replicas claimed and activating", ["model"], registry=r
        )
        self.panic = Gauge("pulsescale_panic", "1 while the model is in panic mode", ["model"], registry=r)
        self.demand = Gauge(
            "pulsescale_demand_requests", "Queue + in-flight over fresh gateways", ["model"], registry=r
        )
        self.slots = Gauge("pulsescale_slots", "Slots in the registry by state", ["model", "state"], registry=r)
        self.activation_seconds = Histogram(
            "pulsescale_activation_seconds",
            "Activation time by stage, as the agent measured it",
            ["stage"],
            buckets=_ACTIVATION_BUCKETS,
            registry=r,
        )
        self.activations = Counter(
            "pulsescale_activations_total", "Activations by outcome", ["model", "outcome"], registry=r
        )
        self.cold_starts = Counter(
            "pulsescale_cold_path_total", "Scale-ups sent to the cold path (no warm slot)", ["model"], registry=r
        )
        self.rejected = Counter(
            "pulsescale_rejected_messages_total", "Messages rejected, by reason", ["reason"], registry=r
        )
        self.samples = Counter("pulsescale_samples_total", "Queue samples by outcome", ["outcome"], registry=r)
        self.internal_errors = Counter(
            "pulsescale_internal_errors_total", "Bugs caught and survived (see the log for the traceback)", registry=r
        )
        self.leader = Gauge("pulsescale_leader", "1 while this replica holds the leader lease", registry=r)
