"""What a demo run measured, as report.json. Pure: no I/O, times passed in (`demo.table` prints it).

The run (`demo.run`, its `demo.recorder`) records five streams, each from where it happens, and this module only
combines them:

- the load generator's requests, each with its send and end time and its HTTP status (or why none), and the
  per-second counts made from them (sent, 200s, 504s, other errors, latency percentiles, 200s by completion);
- the `QueueSample`s on ``pulse.queue.<model>`` (queue depth, in flight, the counters): the gateway's, or with
  ``--source vllm-metrics`` the bridge's (`RunRecord.bridge_id`), read from the engines;
- the autoscaler's events on ``pulse.events.<model>`` (``slot.claimed``/``slot.ready`` with the agent's stage
  timings, ``cold.start``, ``scale.decision``...);
- the slot registry, sampled every tick (replicas ready / activating / warm);
- the gateway's own counters from its ``/metrics`` once the load has drained (answers by status, its latency
  histogram), which report.json carries beside the load generator's figures so they can be checked against each
  other.

Every figure in the report is computed from those records (a test recomputes them from its own subscription).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from demo import measures
from demo.measures import Request, Window
from gateway.loadgen import percentile
from warmpool.protocol import Event, QueueSample

__all__ = [
    "ARTICLE",
    "Activation",
    "LoadSecond",
    "RunRecord",
    "Tick",
    "activations",
    "build_report",
    "demand_section",
    "first_claim_after",
    "ready_count_at",
    "time_to_capacity",
]

ARTICLE: Final[dict[str, Any]] = {
    "cold_start_s": {"classic": 185.2, "optimised": 2.55},
    "timeouts": {"classic": 142_500, "optimised": 0},
    "disk_read_iops": {"classic": 89_000, "optimised": 0},
    "all_up_s": {"classic": 680.0, "optimised": 6.4},
    "rootfs_s": {"classic": 120.0, "optimised": 0.8},
    "instances": 100,
}
"""The article's load test (100 instances, Locust at 300 % of capacity): ../shared/SEED.md, last table."""

STAGES: Final = ("token", "load", "engine", "readiness", "total")


@dataclass(frozen=True)
class LoadSecond:
    """One second of the load generator's counts; `t` is its start, in seconds since the load began."""

    t: float
    sent: int
    ok: int
    timeouts: int
    errors: int
    p50_ms: float | None = None
    p99_ms: float | None = None
    rejected: int = 0
    """Of `errors`: 429s (the gateway's queue was full)."""
    dropped: int = 0
    """Not sent at all: the generator's own limit of outstanding requests was reached."""
    served: int = 0
    """200s that *completed* in this second (the others count by send second): the rate the replicas served."""


@dataclass(frozen=True)
class Tick:
    """The registry and the gateway as the demo saw them at `t` (seconds since the load began)."""

    t: float
    ready: int
    activating: int
    warm: int
    queue_depth: int
    inflight: int
    desired: int | None = None
    phase: str = ""


@dataclass(frozen=True)
class Activation:
    """One slot taken into service: the autoscaler's claim and the agent's `ready`, with the agent's stages."""

    node: str
    slot: str
    claimed_at: float
    """Wall time of the ``slot.claimed`` event (the autoscaler's clock)."""
    ready_at: float
    stages_ms: dict[str, float]
    path: str
    """``warm`` (a slot warm before the pulse) or ``cold`` (a node the cold path started)."""

    @property
    def claim_to_ready_ms(self) -> float:
        return (self.ready_at - self.claimed_at) * 1e3


@dataclass
class RunRecord:
    """Everything one run recorded; `build_report` turns it into report.json."""

    load_start: float
    """Wall time of the first request."""
    pulse_start: float
    pulse_end: float
    load_end: float
    seconds: list[LoadSecond] = field(default_factory=list)
    ticks: list[Tick] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    samples: list[QueueSample] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)
    """(phase, wall time it began)."""
    cold_nodes: dict[str, float] = field(default_factory=dict)
    """Nodes the cold path started -> wall time they were started."""
    cold_warm_at: dict[str, float] = field(default_factory=dict)
    """Cold-started nodes -> wall time their first slot turned warm."""
    replica_service_s: float | None = None
    """Measured service time of one replica (median of sequential requests before the load)."""
    disk_reads: int | None = None
    """Reads completed by the host's block devices during the pulse (/proc/diskstats), None when unreadable."""
    notes: list[str] = field(default_factory=list)
    """Said once during the run (the rootfs stage skipped, ...): copied into the report."""
    load_totals: dict[str, int] = field(default_factory=dict)
    """The load generator's own totals, when it keeps them (sent, ok, timeouts, errors)."""
    requests: list[Request] = field(default_factory=list)
    """Every request the load generator sent and saw end (times since `load_start`)."""
    offered_end: float | None = None
    """Wall time the offered load ended (its last second; `load_end` is after the drain); None: `load_end`."""
    gateway_metrics: dict[str, Any] | None = None
    """The gateway's own counters scraped from its ``/metrics`` after the drain (`demo.recorder.gateway_counters`):
    ``responses_by_status`` and the ``request_seconds`` histogram; None when it could not be read."""
    bridge_id: str | None = None
    """``--source vllm-metrics``: the bridge's gateway id, which tells its samples from the gateway's."""
    bridge_metrics: dict[str, Any] | None = None
    """The bridge's own counters after the drain (`demo.recorder.bridge_counters`); None without a bridge or when
    they could not be read."""
    rootfs: dict[str, Any] | None = None
    """The rootfs stage (`demo.image`): ``mode``, ``mounted``, and when mounted its ``digest``, sizes, build, mount
    and warm times and the page-cache residency and slots on the image at the pulse's start and end; when not, the
    ``reason``."""


# --- pure derivations ---------------------------------------------------------------------------------------------


def _sorted(events: Iterable[Event]) -> list[Event]:
    return sorted(events, key=lambda e: e.ts)


def activations(events: Iterable[Event], cold_nodes: Iterable[str] = ()) -> list[Activation]:
    """Every ``slot.claimed`` followed by the same slot's ``slot.ready``; a claim that failed (``slot.failed`` or
    ``slot.released`` first) is no activation."""
    cold = set(cold_nodes)
    open_claims: dict[tuple[str, str], float] = {}
    out: list[Activation] = []
    for e in _sorted(events):
        if e.node is None or e.slot is None:
            continue
        key = (e.node, e.slot)
        if e.type == "slot.claimed":
            open_claims[key] = e.ts
        elif e.type in ("slot.failed", "slot.released"):
            open_claims.pop(key, None)
        elif e.type == "slot.ready" and key in open_claims:
            t = e.timings
            stages = {s: float(getattr(t, f"{s}_ms")) for s in STAGES} if t is not None else {}
            out.append(
                Activation(e.node, e.slot, open_claims.pop(key), e.ts, stages, "cold" if e.node in cold else "warm")
            )
    return out


def serving_changes(events: Iterable[Event]) -> list[tuple[float, int]]:
    """(time, serving replicas after it) at every ``slot.ready`` and every release or failure of a serving slot."""
    serving: set[tuple[str, str]] = set()
    out: list[tuple[float, int]] = []
    for e in _sorted(events):
        if e.node is None or e.slot is None:
            continue
        key = (e.node, e.slot)
        if e.type == "slot.ready":
            serving.add(key)
        elif e.type in ("slot.released", "slot.failed") and key in serving:
            serving.discard(key)
        else:
            continue
        out.append((e.ts, len(serving)))
    return out


def ready_count_at(events: Iterable[Event], at: float) -> int:
    count = 0
    for ts, n in serving_changes(events):
        if ts > at:
            break
        count = n
    return count


def time_to_capacity(events: Iterable[Event], pulse_start: float, needed: int) -> float | None:
    """Seconds from the pulse start until `needed` replicas serve at once (0 when they already did); None if never."""
    changes = serving_changes(events)
    if ready_count_at(events, pulse_start) >= needed:
        return 0.0
    for ts, n in changes:
        if ts > pulse_start and n >= needed:
            return ts - pulse_start
    return None


def first_claim_after(events: Iterable[Event], at: float) -> float | None:
    """Seconds from `at` to the first ``slot.claimed`` at or after it (the autoscaler's first reaction to the pulse,
    before any engine's part); None when nothing was claimed."""
    claims = [e.ts for e in events if e.type == "slot.claimed" and e.ts >= at]
    return min(claims) - at if claims else None


def demand_section(rec: RunRecord, source: str, scrape_every_s: float | None) -> dict[str, Any]:
    """Who published the demand the autoscaler scaled on: the source, its publisher, its samples and the longest
    silence between two of them while the load ran (past the autoscaler's 1 s, its demand was stale), and the
    bridge's own counters."""
    mine = [s for s in rec.samples if rec.bridge_id is None or s.gateway == rec.bridge_id]
    end = rec.offered_end if rec.offered_end is not None else rec.load_end
    ts = sorted(s.ts for s in mine if rec.load_start <= s.ts <= end)
    gap = max((b - a for a, b in itertools.pairwise(ts)), default=None)
    return {
        "source": source,
        "publisher": mine[-1].gateway if mine else None,
        "samples": len(mine),
        "longest_gap_s": None if gap is None else round(gap, 3),
        "scrape_every_s": scrape_every_s,
        "bridge": rec.bridge_metrics,
    }


def needed_replicas(pulse_rps: float, service_s: float) -> int:
    """Replicas the pulse needs: its rate times one replica's service time (Little's law at full use), at least
    one. Not capped at the fleet: a pulse bigger than the fleet says so."""
    return max(1, math.ceil(pulse_rps * service_s - 1e-9))


def _in(t: float, start: float, end: float) -> bool:
    return start <= t < end


def build_report(rec: RunRecord, config: dict[str, Any], *, pulse_rps: float, timeout_s: float) -> dict[str, Any]:
    """report.json: the issue's keys (`requests`, `ok`, `timeouts`, `errors`, `needed_replicas`,
    `time_to_capacity_s`, `activations`, `config`) and what explains them."""
    service_s = rec.replica_service_s if rec.replica_service_s else config.get("service_s", 0.05)
    needed = needed_replicas(pulse_rps, service_s)
    ttc = time_to_capacity(rec.events, rec.pulse_start, needed)
    acts = activations(rec.events, rec.cold_nodes)
    # 504s answer requests that waited `timeout_s`: those caused by the pulse arrive up to that long after it ends.
    p0, p1 = rec.pulse_start - rec.load_start, rec.pulse_end - rec.load_start + timeout_s
    sent = sum(s.sent for s in rec.seconds)
    ok = sum(s.ok for s in rec.seconds)
    timeouts = sum(s.timeouts for s in rec.seconds)
    errors = sum(s.errors for s in rec.seconds)
    if rec.load_totals:
        sent, ok = rec.load_totals.get("sent", sent), rec.load_totals.get("ok", ok)
        timeouts, errors = rec.load_totals.get("timeouts", timeouts), rec.load_totals.get("errors", errors)
    # The gateway's own samples (with a bridge as the source, the gateway publishes none: only its /metrics).
    gateway_samples = [s for s in rec.samples if rec.bridge_id is None or s.gateway != rec.bridge_id]
    last = gateway_samples[-1] if gateway_samples else None
    bridged = rec.bridge_id is not None
    first_claim = first_claim_after(rec.events, rec.pulse_start)
    by_type: dict[str, int] = {}
    for e in rec.events:
        by_type[e.type] = by_type.get(e.type, 0) + 1
    cold_events = [e for e in _sorted(rec.events) if e.type == "cold.start"]
    pulse_w = Window(p0, rec.pulse_end - rec.load_start)
    by_phase = measures.cold_path_phases(cold_events, rec.load_start, pulse_w)
    cold_phases = {
        # Asks (count) in each phase; each ask states the whole shortfall of its moment.
        "before_load": by_phase["asks"]["before_load"],
        "during_base": by_phase["asks"]["base"],
        "during_pulse": by_phase["asks"]["pulse"],
        "after_pulse": by_phase["asks"]["after"],
        "most_replicas_in_one_ask": by_phase["most_replicas_in_one_ask"],
    }
    during_pulse = [a for a in acts if a.claimed_at >= rec.pulse_start]
    desired = [t.desired for t in rec.ticks if t.desired is not None]
    return {
        "requests": sent,
        "ok": ok,
        "timeouts": timeouts,
        "errors": errors,
        "timeouts_during_pulse": sum(s.timeouts for s in rec.seconds if _in(s.t, p0, p1)),
        "needed_replicas": needed,
        "time_to_capacity_s": None if ttc is None else round(ttc, 3),
        "first_claim_after_pulse_s": None if first_claim is None else round(first_claim, 3),
        "demand": demand_section(
            rec, str(config.get("source", "gateway")), config.get("bridge_scrape_every_s") if bridged else None
        ),
        "activations": [
            {
                "node": a.node,
                "slot": a.slot,
                "path": a.path,
                "claimed_at_s": round(a.claimed_at - rec.pulse_start, 3),
                "ready_at_s": round(a.ready_at - rec.pulse_start, 3),
                "claim_to_ready_ms": round(a.claim_to_ready_ms, 1),
                "stages_ms": {k: round(v, 2) for k, v in a.stages_ms.items()},
            }
            for a in acts
        ],
        "claim_to_ready_ms": {
            "p50": _round(percentile(sorted(a.claim_to_ready_ms for a in acts), 50)),
            "p99": _round(percentile(sorted(a.claim_to_ready_ms for a in acts), 99)),
            "max": _round(max((a.claim_to_ready_ms for a in acts), default=None)),
            "during_pulse": len(during_pulse),
        },
        "ready_at_pulse_start": ready_count_at(rec.events, rec.pulse_start),
        "peak_ready": max((t.ready for t in rec.ticks), default=0),
        "peak_desired": max(desired, default=None),
        "peak_queue_depth": max((s.queue_depth for s in rec.samples), default=0),
        **_costs(rec, config, service_s),
        "replica_capacity_rps": round(1 / service_s, 2) if service_s else None,
        "replica_service_ms": round(service_s * 1e3, 2),
        "load_started_at": rec.load_start,
        "load": dict(rec.load_totals),
        "pulse": {
            "start_s": round(p0, 3),
            "end_s": round(rec.pulse_end - rec.load_start, 3),
            "rps": round(pulse_rps, 2),
        },
        "gateway": ({"gateway": None, "samples": 0, "metrics": rec.gateway_metrics} if bridged else None)
        if last is None
        else {
            "gateway": last.gateway,
            "arrivals_total": last.arrivals_total,
            "completions_total": last.completions_total,
            "timeouts_total": last.timeouts_total,
            "samples": len(gateway_samples),
            # Its /metrics (None: not read): every answer it gave by status, and its arrival -> answer histogram.
            "metrics": rec.gateway_metrics,
        },
        "cold_path": {
            "requests": [
                {
                    "at_s": round(e.ts - rec.pulse_start, 3),
                    "phase": measures.phase_of(e.ts - rec.load_start, pulse_w),
                    "replicas": e.desired,
                    "reason": e.reason,
                }
                for e in cold_events
            ],
            **cold_phases,
            "nodes_started": {n: round(t - rec.pulse_start, 3) for n, t in sorted(rec.cold_nodes.items())},
            "node_start_to_warm_s": {
                n: round(rec.cold_warm_at[n] - t, 3) for n, t in sorted(rec.cold_nodes.items()) if n in rec.cold_warm_at
            },
        },
        "host_disk_reads_during_pulse": rec.disk_reads,
        "rootfs": rec.rootfs if rec.rootfs is not None else {"mounted": False, "reason": "not recorded"},
        "events": by_type,
        "phases": [{"phase": p, "at_s": round(t - rec.load_start, 3)} for p, t in rec.phases],
        "notes": list(rec.notes),
        "series": [
            {
                "t": round(s.t, 3),
                "sent": s.sent,
                "ok": s.ok,
                "timeouts": s.timeouts,
                "errors": s.errors,
                "rejected": s.rejected,
                "dropped": s.dropped,
                "p50_ms": _round(s.p50_ms),
                "p99_ms": _round(s.p99_ms),
                "served": s.served,
                "needed": measures.needed_for(s.sent, 1 / service_s) if service_s else None,
            }
            for s in rec.seconds
        ],
        "ticks": [
            {
                "t": round(t.t, 3),
                "ready": t.ready,
                "activating": t.activating,
                "warm": t.warm,
                "queue_depth": t.queue_depth,
                "inflight": t.inflight,
                "desired": t.desired,
                "phase": t.phase,
            }
            for t in rec.ticks
        ],
        "config": config,
    }


def _costs(rec: RunRecord, config: dict[str, Any], service_s: float) -> dict[str, Any]:
    """What the pulse cost (`demo.measures`): latency by phase (every request that ended, whatever its answer: a
    504 is a client's wait too; and the 200s alone), the answers by status, replica-seconds against the needed ones,
    the base's replicas against its need, and the autoscaler's steps on the flat load after the pulse."""
    pulse_w = Window(rec.pulse_start - rec.load_start, rec.pulse_end - rec.load_start)
    load_w = Window(0.0, (rec.offered_end if rec.offered_end is not None else rec.load_end) - rec.load_start)
    phases = {"base": Window(0.0, pulse_w.start), "pulse": pulse_w, "after": Window(pulse_w.end, math.inf)}
    reqs = rec.requests
    ok = [r for r in reqs if r.status == 200]
    latency = {"overall": measures.latency(reqs)}
    latency |= {name: measures.latency(r for r in reqs if r.sent_s in w) for name, w in phases.items()}
    worst = max((s.p99_ms for s in rec.seconds if s.p99_ms is not None), default=None)
    statuses = measures.by_status(reqs)
    cap = 1 / service_s if service_s else 0.0
    changes = [(ts - rec.load_start, n) for ts, n in serving_changes(rec.events)]
    sent = [s.sent for s in rec.seconds]
    advanced = (config.get("scaled_object") or {}).get("advanced") or {}
    decisions = [e for e in rec.events if e.type == "scale.decision"]
    return {
        "latency_ms": {**latency, "p99_worst_second": _round(worst)},
        "latency_ok_ms": {
            "overall": measures.latency(ok),
            "pulse": measures.latency(r for r in ok if r.sent_s in pulse_w),
        },
        "responses_by_status": statuses,
        "non_200": sum(n for k, n in statuses.items() if k != "200"),
        "replicas": measures.replica_seconds(changes, load_w, sent, cap),
        "base": measures.base_phase(changes, phases["base"], sent, cap, float(config.get("base_utilisation") or 1.0)),
        "after_pulse": measures.after_pulse(
            decisions,
            rec.load_start,
            Window(pulse_w.end, load_w.end),
            float(advanced.get("scaleDownStabilizationSeconds") or 0.0),
            config.get("base_replicas"),
        ),
    }


def _round(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(v, nd)
