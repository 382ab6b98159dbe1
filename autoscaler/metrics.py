"""The autoscaler's Prometheus metrics, bound to an injected registry (tests build a fresh one).

Besides its own series the registry carries the default process, platform and GC collectors and
``pulsescale_build_info{version,component}``, so one scrape says which build runs and what it costs. The daemon serves
it on ``/metrics`` (see `autoscaler.daemon`). deploy/monitoring's alerts and dashboard read these names
(tests/kube/test_monitoring.py checks that every name they use is one a component exports).

Series labelled by model exist only for models with a ScaledObject here (`model`), and go with it (`forget`): the
activation histogram's children too, so its cardinality is models x stages, bounded as the gauges are.

`labels(...)` costs a lock and a dict lookup keyed by a tuple of the label values on every call; the paths that run
per sample or per decision take their series from `model(name)` (one `ModelSeries` per model, its children looked
up once) and `sample(outcome)` instead. `forget(name)` drops a model's series when it is no longer autoscaled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from warmpool import protocol
from warmpool.build import register_process

__all__ = ["ACTIVATION_STAGES", "AgentClockSkew", "AutoscalerMetrics", "ModelSeries"]

# Decisions live in milliseconds-to-seconds territory; activation stages in tens of ms to seconds.
_DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_ACTIVATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Loop stalls and lease renewals: a few ms is normal; 0.5 s and over eats into the 1.6 s lease fence.
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0)
ACTIVATION_STAGES = ("token", "load", "engine", "readiness", "total", "claim_to_ready")
"""``pulsescale_autoscaler_activation_seconds{stage}``: the agent's stage timings, and our own claim -> ready."""


@dataclass(frozen=True, slots=True)
class ModelSeries:
    """One model's label children, looked up once (`AutoscalerMetrics.model`)."""

    desired: Gauge
    ready: Gauge
    activating: Gauge
    panic: Gauge
    demand: Gauge
    cold_starts: Counter
    activations_ready: Counter
    activations_failed: Counter
    slots: dict[str, Gauge]
    """Slot state -> ``pulsescale_slots{model,state}``, for every state in `protocol.SLOT_STATES`."""
    activation: dict[str, Histogram]
    """Stage -> ``pulsescale_autoscaler_activation_seconds{model,stage}``, for every stage in `ACTIVATION_STAGES`."""
    arrival_rate: Gauge
    owned: Gauge
    """``pulsescale_model_owned{model}``: 1 on the replica that acts for the model. Every replica keeps a series of
    each model, but only the owner's desired/ready/activating/panic/demand/arrival-rate are current (another's stay
    as they were when it last owned the model): deploy/monitoring's recording rules keep the owner's."""


class AgentClockSkew(Collector):
    """``pulsescale_agent_clock_skew_seconds{node}``, read at scrape time from `source` (the registry's
    `KvSlotStore.clock_skews`, bound by the daemon): one series per node heard, gone with the node's lease."""

    NAME = "pulsescale_agent_clock_skew_seconds"

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            self.NAME,
            "How far each node agent's clock is ahead of this autoscaler's (negative: behind), from its heartbeats: "
            f"its slots are not offered beyond {protocol.MAX_TRUSTED_SKEW_S:g} s either way",
            labels=["node"],
        )
        for node, skew_s in sorted(self.source().items()):
            family.add_metric([node], skew_s)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, "", labels=["node"])


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        register_process(r, "autoscaler")
        self.nats_connected = Gauge(
            "pulsescale_nats_connected", "1 while the connection to NATS is up (the daemon binds it)", registry=r
        )
        self.decision_seconds = Histogram(
            "pulsescale_decision_seconds",
            "Sample received to the first slot claim written for the scale-up decision that sample caused "
            "(once per such decision)",
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
        self.arrival_rate = Gauge(
            "pulsescale_arrival_rate",
            "Requests arriving per second over the fresh gateways (from their arrivals counters), as the last "
            "decision saw it: the offered load",
            ["model"],
            registry=r,
        )
        self.slots = Gauge("pulsescale_slots", "Slots in the registry by state", ["model", "state"], registry=r)
        self.owned = Gauge(
            "pulsescale_model_owned",
            "1 while this replica acts for the model (holds its shard's lease): the model's desired, ready, "
            "activating, panic, demand and arrival-rate gauges are current only where this is 1 (set every second)",
            ["model"],
            registry=r,
        )
        self.activation_seconds = Histogram(
            "pulsescale_autoscaler_activation_seconds",
            "Activation time by stage: token, load, engine, readiness and total as the agent reported them; "
            "claim_to_ready as the autoscaler measured it (claim written to the agent's ready reply)",
            ["model", "stage"],
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
        self.registry_rejected = Counter(
            "pulsescale_registry_rejected_records_total",
            "Records in the KV buckets (slots, agents, ScaledObjects, overrides, the leader lease) that break the "
            "contract, by reason",
            ["reason"],
            registry=r,
        )
        self.samples = Counter("pulsescale_samples_total", "Queue samples by outcome", ["outcome"], registry=r)
        self.internal_errors = Counter(
            "pulsescale_internal_errors_total", "Bugs caught and survived (see the log for the traceback)", registry=r
        )
        self.leader = Gauge(
            "pulsescale_leader", "1 while this replica acts for at least one shard of the models", registry=r
        )
        self.shards_held = Gauge(
            "pulsescale_shards_held", "Shards of the models whose lease this replica holds (of 32)", registry=r
        )
        self.lease_lost = Counter(
            "pulsescale_lease_lost_total",
            "Shard leases this replica lost (not renewed in time, or taken over); a hand-over or resign is not one",
            registry=r,
        )
        self.loop_lag = Histogram(
            "pulsescale_event_loop_lag_seconds",
            "How late the event loop ran a timer that was due (sampled every 100 ms): what lease renewals, claims "
            "and decisions waited behind at that moment",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.lease_renewal_seconds = Histogram(
            "pulsescale_lease_renewal_seconds",
            "A shard lease renewal, from its send to the broker's answer (or its failure): when renewals stop "
            "being answered within the fence (80 % of the lease, 1.6 s by default) the lease is lost",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.agent_leases = Gauge(
            "pulsescale_agent_leases", "Node agents with a lease in pulse_agents, as this replica sees them", registry=r
        )
        self.agent_leases_lapsed = Gauge(
            "pulsescale_agent_leases_lapsed",
            "Of them, agents known to have stopped renewing (judged on a current view, as a release of their ready "
            "slots is): their slots are not offered, their serving slots are replaced",
            registry=r,
        )
        self.agent_clock_skew = AgentClockSkew()
        """Bind its `source` to the registry's `KvSlotStore.clock_skews` (the daemon does)."""
        r.register(self.agent_clock_skew)
        self._models: dict[str, ModelSeries] = {}
        self._samples: dict[str, Counter] = {}

    def model(self, model: str) -> ModelSeries:
        """The model's series, made on first use and cached (no `labels()` lookup per sample)."""
        series = self._models.get(model)
        if series is None:
            series = self._models[model] = ModelSeries(
                desired=self.desired.labels(model),
                ready=self.ready.labels(model),
                activating=self.activating.labels(model),
                panic=self.panic.labels(model),
                demand=self.demand.labels(model),
                cold_starts=self.cold_starts.labels(model),
                activations_ready=self.activations.labels(model, "ready"),
                activations_failed=self.activations.labels(model, "failed"),
                slots={state: self.slots.labels(model, state) for state in protocol.SLOT_STATES},
                activation={stage: self.activation_seconds.labels(model, stage) for stage in ACTIVATION_STAGES},
                arrival_rate=self.arrival_rate.labels(model),
                owned=self.owned.labels(model),
            )
        return series

    def sample(self, outcome: str) -> Counter:
        """``pulsescale_samples_total{outcome}``, cached by outcome."""
        child = self._samples.get(outcome)
        if child is None:
            child = self._samples[outcome] = self.samples.labels(outcome)
        return child

    def forget(self, model: str) -> None:
        """Drop the model's series (it is no longer autoscaled here): a scrape stops showing its last values."""
        if self._models.pop(model, None) is None:
            return
        for family in (self.desired, self.ready, self.activating, self.panic, self.demand, self.cold_starts,
                       self.arrival_rate, self.owned):  # fmt: skip
            family.remove(model)
        for outcome in ("ready", "failed"):
            self.activations.remove(model, outcome)
        for state in protocol.SLOT_STATES:
            self.slots.remove(model, state)
        for stage in ACTIVATION_STAGES:
            self.activation_seconds.remove(model, stage)
