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

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from autoscaler.exposition import Changed, Exposition, TrackedCounter, TrackedGauge, TrackedHistogram, go_float
from warmpool import protocol
from warmpool.build import register_process

__all__ = [
    "ACTIVATION_STAGES",
    "AgentClockSkew",
    "AutoscalerMetrics",
    "ModelSeries",
    "SampleCounts",
    "Tally",
    "WatchFigures",
]

# Decisions live in milliseconds-to-seconds territory; activation stages in tens of ms to seconds.
_DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
_ACTIVATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Loop stalls and lease renewals: a few ms is normal; 0.5 s and over eats into the 1.6 s lease fence.
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0)
_SLACK_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 5.0)
"""Shard terms' slack (s): ~1.1 s at the default lease of 2 s renewed every 0.5 s; the low buckets are the warnings."""
_SKEW_CHUNK = 250
"""Nodes' clock skews formatted between two yields of a scrape (~1 ms here)."""
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
    HELP = (
        "How far each node agent's clock is ahead of this autoscaler's (negative: behind), from its heartbeats: "
        f"its slots are not offered beyond {protocol.MAX_TRUSTED_SKEW_S:g} s either way"
    )

    def __init__(self) -> None:
        self.source: Callable[[], Mapping[str, float]] = dict

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["node"])
        for node, skew_s in sorted(self.source().items()):
            family.add_metric([node], skew_s)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, "", labels=["node"])

    def render_text(self) -> Iterator[bytes]:
        """What `generate_latest` makes of `collect`, formatted directly and in chunks (`autoscaler.exposition`
        yields to the loop between them): a fleet has thousands of nodes, and the family objects cost ~10 us a node,
        20 ms in one go at 2,000."""
        doc = self.HELP.replace("\\", r"\\").replace("\n", r"\n")
        yield f"# HELP {self.NAME} {doc}\n# TYPE {self.NAME} gauge\n".encode()
        skews = sorted(self.source().items())
        for at in range(0, len(skews), _SKEW_CHUNK):
            chunk = skews[at : at + _SKEW_CHUNK]
            yield "".join(f'{self.NAME}{{node="{node}"}} {go_float(skew_s)}\n' for node, skew_s in chunk).encode()


class WatchedView(Protocol):
    """What `WatchFigures` reads of a bucket view (`warmpool.bucketview.BucketView`)."""

    @property
    def bucket(self) -> str: ...
    @property
    def relists(self) -> int: ...
    @property
    def spared(self) -> Mapping[str, int]: ...


class WatchFigures(Collector):
    """``pulsescale_watch_relists_total{bucket}`` and ``pulsescale_watch_probes_spared_total{bucket,why}``, read
    at scrape time from `source` (the daemon binds it to its bucket views: `warmpool.bucketview.BucketView`'s
    `relists` and `spared`). A re-list of `pulse_slots` at 3,000 models is 12,000 records the server sends again."""

    RELISTS = "pulsescale_watch_relists"
    RELISTS_HELP = "Watches of a KV bucket made anew (after a reconnect, or a probe that found the consumer lost)"
    SPARED = "pulsescale_watch_probes_spared"
    SPARED_HELP = (
        "Consumer probes that a busy or starved process once took for a lost consumer, and no longer re-list: "
        "late (answered within the probe's budget of this process's own time, not the clock's), in_flight (what the "
        "consumer had sent reached the watch)"
    )

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[tuple[str, int, Mapping[str, int]]]] = list
        """(bucket, relists, spared by why) per view."""

    def follow(self, *views: WatchedView | None) -> None:
        """Read `views` (None: a view this daemon does not keep) at every scrape."""
        kept = [v for v in views if v is not None]
        self.source = lambda: [(v.bucket, v.relists, dict(v.spared)) for v in kept]

    def collect(self) -> Iterator[CounterMetricFamily]:
        relists = CounterMetricFamily(self.RELISTS, self.RELISTS_HELP, labels=["bucket"])
        spared = CounterMetricFamily(self.SPARED, self.SPARED_HELP, labels=["bucket", "why"])
        for bucket, count, by_why in sorted(self.source()):
            relists.add_metric([bucket], count)
            for why, n in sorted(by_why.items()):
                spared.add_metric([bucket, why], n)
        yield relists
        yield spared

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.RELISTS, "", labels=["bucket"])
        yield CounterMetricFamily(self.SPARED, "", labels=["bucket", "why"])


class Tally:
    """One count, incremented on the loop and read at scrape time: what a sample's outcome costs is an addition,
    where a prometheus_client counter takes a lock (twice per sample, at 10,000 samples a second)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class SampleCounts(Collector):
    """``pulsescale_samples_total{outcome}``: a `Tally` per outcome, made on first use."""

    NAME = "pulsescale_samples"
    HELP = "Queue samples by outcome"

    def __init__(self) -> None:
        self.tallies: dict[str, Tally] = {}

    def tally(self, outcome: str) -> Tally:
        t = self.tallies.get(outcome)
        if t is None:
            t = self.tallies[outcome] = Tally()
        return t

    def collect(self) -> list[CounterMetricFamily]:
        family = CounterMetricFamily(self.NAME, self.HELP, labels=["outcome"])
        for outcome, t in list(self.tallies.items()):
            family.add_metric([outcome], t.value)
        return [family]

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.NAME, self.HELP, labels=["outcome"])]


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
        # The families labelled by model are tracked (`autoscaler.exposition`): a scrape renders only what changed.
        changed = self.changed = Changed()
        self.desired = TrackedGauge(
            "pulsescale_desired_replicas", "Replicas the policy wants", ["model"], registry=r, changed=changed
        )
        self.ready = TrackedGauge(
            "pulsescale_ready_replicas", "Replicas serving", ["model"], registry=r, changed=changed
        )
        self.activating = TrackedGauge(
            "pulsescale_activating_replicas", "Replicas claimed and activating", ["model"], registry=r, changed=changed
        )
        self.panic = TrackedGauge(
            "pulsescale_panic", "1 while the model is in panic mode", ["model"], registry=r, changed=changed
        )
        self.demand = TrackedGauge(
            "pulsescale_demand_requests",
            "Queue + in-flight over fresh gateways",
            ["model"],
            registry=r,
            changed=changed,
        )
        self.arrival_rate = TrackedGauge(
            "pulsescale_arrival_rate",
            "Requests arriving per second over the fresh gateways (from their arrivals counters), as the last "
            "decision saw it: the offered load",
            ["model"],
            registry=r,
            changed=changed,
        )
        self.slots = TrackedGauge(
            "pulsescale_slots", "Slots in the registry by state", ["model", "state"], registry=r, changed=changed
        )
        self.owned = TrackedGauge(
            "pulsescale_model_owned",
            "1 while this replica acts for the model (holds its shard's lease): the model's desired, ready, "
            "activating, panic, demand and arrival-rate gauges are current only where this is 1 (set every second)",
            ["model"],
            registry=r,
            changed=changed,
        )
        self.activation_seconds = TrackedHistogram(
            "pulsescale_autoscaler_activation_seconds",
            "Activation time by stage: token, load, engine, readiness and total as the agent reported them; "
            "claim_to_ready as the autoscaler measured it (claim written to the agent's ready reply)",
            ["model", "stage"],
            buckets=_ACTIVATION_BUCKETS,
            registry=r,
            changed=changed,
        )
        self.activations = TrackedCounter(
            "pulsescale_activations_total", "Activations by outcome", ["model", "outcome"], registry=r, changed=changed
        )
        self.cold_starts = TrackedCounter(
            "pulsescale_cold_path_total",
            "Scale-ups sent to the cold path (no warm slot)",
            ["model"],
            registry=r,
            changed=changed,
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
        self.samples = SampleCounts()
        """``pulsescale_samples_total{outcome}``: plain counts, read at scrape time (`SampleCounts`)."""
        r.register(self.samples)
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
        self.lease_renewal_slack = Histogram(
            "pulsescale_lease_renewal_slack_seconds",
            "What was left of a shard's term when a renewal extending it was answered: the time to the fence (80 % "
            "of the lease after the last renewal heard, 1.6 s by default) at which this replica would have stopped "
            "acting for the shard. Renewals run every quarter lease, so ~1.1 s is normal; near 0 a lease is nearly "
            "lost",
            buckets=_SLACK_BUCKETS,
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
        self.watches = WatchFigures()
        """Bind its `source` to the daemon's bucket views (the daemon does)."""
        r.register(self.watches)
        self.exposition = Exposition(
            r,
            (self.desired, self.ready, self.activating, self.panic, self.demand, self.arrival_rate, self.slots,
             self.owned, self.activation_seconds, self.activations, self.cold_starts),
            changed,
        )  # fmt: skip
        """``/metrics``'s text (`autoscaler.exposition`): what changed rendered, the rest kept."""
        self._models: dict[str, ModelSeries] = {}

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

    def sample(self, outcome: str) -> Tally:
        """``pulsescale_samples_total{outcome}``'s count of `outcome` (`SampleCounts`)."""
        return self.samples.tally(outcome)

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
