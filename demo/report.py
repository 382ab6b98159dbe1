"""What a demo run measured, as report.json and the article's load-test table. Pure: no I/O, times passed in.

The run (`demo.run`, its `demo.recorder`) records four streams, each from where it happens, and this module only
combines them:

- the load generator's per-second counts (requests sent, 200s, 504s, other errors, latency percentiles);
- the gateway's `QueueSample`s on ``pulse.queue.<model>`` (queue depth, in flight, its counters);
- the autoscaler's events on ``pulse.events.<model>`` (``slot.claimed``/``slot.ready`` with the agent's stage
  timings, ``cold.start``, ``scale.decision``...);
- the slot registry, sampled every tick (replicas ready / activating / warm).

Every figure in the report is computed from those records (a test recomputes them from its own subscription).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from gateway.loadgen import percentile
from warmpool.protocol import Event, QueueSample

__all__ = [
    "ARTICLE",
    "Activation",
    "LoadSecond",
    "RunRecord",
    "Tick",
    "activations",
    "article_table",
    "build_report",
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
    last = rec.samples[-1] if rec.samples else None
    by_type: dict[str, int] = {}
    for e in rec.events:
        by_type[e.type] = by_type.get(e.type, 0) + 1
    cold_events = [e for e in _sorted(rec.events) if e.type == "cold.start"]
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
        "latency_ms": {
            "p50": _round(percentile(sorted(s.p50_ms for s in rec.seconds if s.p50_ms is not None), 50)),
            "p99_worst_second": _round(max((s.p99_ms for s in rec.seconds if s.p99_ms is not None), default=None)),
        },
        "replica_capacity_rps": round(1 / service_s, 2) if service_s else None,
        "replica_service_ms": round(service_s * 1e3, 2),
        "load_started_at": rec.load_start,
        "load": dict(rec.load_totals),
        "pulse": {
            "start_s": round(p0, 3),
            "end_s": round(rec.pulse_end - rec.load_start, 3),
            "rps": round(pulse_rps, 2),
        },
        "gateway": None
        if last is None
        else {
            "gateway": last.gateway,
            "arrivals_total": last.arrivals_total,
            "completions_total": last.completions_total,
            "timeouts_total": last.timeouts_total,
            "samples": len(rec.samples),
        },
        "cold_path": {
            "requests": [
                {"at_s": round(e.ts - rec.pulse_start, 3), "replicas": e.desired, "reason": e.reason}
                for e in cold_events
            ],
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
                "p50_ms": _round(s.p50_ms),
                "p99_ms": _round(s.p99_ms),
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


def _round(v: float | None, nd: int = 2) -> float | None:
    return None if v is None else round(v, nd)


# --- the article's table ------------------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    return "never" if v is None else f"{v:.2f} s"


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _rootfs_cell(r: dict[str, Any]) -> str:
    if not r.get("mounted"):
        return f"skipped ({r.get('reason') or 'not run'})"
    resident = r.get("resident_pct_at_pulse_start", r.get("resident_pct_at_mount"))
    on = r.get("slots_on_image_at_pulse_start")
    of = r.get("slots_at_pulse_start")
    return (
        f"mounted {str(r['digest'])[:19]}... once per host ({r['image_bytes'] / 1e6:.1f} MB, built "
        f"{r['build_s']:.2f} s, mount {r['mount_s'] * 1e3:.0f} ms)"
        + ("" if resident is None else f", {resident:.0f} % resident at the pulse")
        + ("" if on is None else f", {on}/{of} slots on it")
    )


def article_table(report: dict[str, Any]) -> str:
    """The article's load-test table with a column of this run's measured figures, and the stage breakdown of each
    activation (plain text: it ends headless runs and logs as well as the live view)."""
    cfg = report["config"]
    c2r = report["claim_to_ready_ms"]
    needed = report["needed_replicas"]
    cold = report["cold_path"]["node_start_to_warm_s"]
    cold_s = max(cold.values()) if cold else None
    one_pod = f"{_fmt_ms(c2r['p50'])} p50 claim->ready"
    if cold_s is not None:
        delay = cfg.get("cold_delay_s") or 0
        one_pod += f"; cold path {f'{delay:g} s delay + ' if delay else ''}{cold_s:.1f} s node start + claim"
    disk = report["host_disk_reads_during_pulse"]
    a = ARTICLE
    rootfs = report.get("rootfs") or {}
    rows = [
        ("metric", "classic (article)", "pulsescale (article)", "this run"),
        (
            "one pod, end-to-end cold start",
            f"{a['cold_start_s']['classic']} s",
            f"{a['cold_start_s']['optimised']} s",
            one_pod,
        ),
        (
            "client 504s during the pulse",
            f"{a['timeouts']['classic']:,}",
            str(a["timeouts"]["optimised"]),
            f"{report['timeouts_during_pulse']:,} (of {report['requests']:,} requests; {report['timeouts']:,} in all)",
        ),
        (
            "engine rootfs (image pull and unpack -> EROFS mount)",
            f"{a['rootfs_s']['classic']:g} s per pod",
            f"{a['rootfs_s']['optimised']} s",
            _rootfs_cell(rootfs),
        ),
        (
            "host disk reads during scale-out",
            f"{a['disk_read_iops']['classic']:,} IOPS",
            "0",
            "n/a" if disk is None else f"{disk:,} reads (/proc/diskstats, whole host)",
        ),
        (
            f"all needed instances up ({needed} here, {a['instances']} in the article)",
            f"{a['all_up_s']['classic']:.0f} s",
            f"{a['all_up_s']['optimised']} s",
            _fmt_s(report["time_to_capacity_s"]) + " after the pulse start",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"pulsescale demo: {cfg['nodes']} nodes x {cfg['slots_per_node']} slots, pool {cfg['pool_size']}, "
        f"base {cfg['base_rps']:g} req/s on {cfg['base_replicas']} replicas, pulse {cfg['pulse'] * 100:.0f} % "
        f"= {report['pulse']['rps']:g} req/s for {cfg['pulse_s']:g} s, needs {needed} replicas "
        f"({report['replica_capacity_rps']} req/s each)",
        "",
    ]
    for i, r in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    acts = report["activations"]
    if acts:
        lines += ["", "activations (claim -> ready, the agent's stages; times from the pulse start):"]
        head = ("node/slot", "path", "claimed", "claim->ready", "token", "load", "engine", "readiness", "agent total")
        body = [
            (
                f"{x['node']}/{x['slot']}",
                x["path"],
                f"{x['claimed_at_s']:+.2f} s",
                _fmt_ms(x["claim_to_ready_ms"]),
                *(_fmt_ms(x["stages_ms"].get(s)) for s in STAGES),
            )
            for x in acts
        ]
        w2 = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        lines.append("  ".join(c.ljust(w) for c, w in zip(head, w2, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, w2, strict=True)).rstrip() for r in body]
    start = report["pulse"]["start_s"]
    for req in report["cold_path"]["requests"]:
        if req["at_s"] >= -start:  # asked while the load ran (before it: the pool was still staging)
            lines.append(f"cold path at {req['at_s']:+.2f} s: {req['replicas']} more replica(s) asked for")
    for node, took in report["cold_path"]["node_start_to_warm_s"].items():
        lines.append(f"cold path: {node} started from nothing, warm after {took:.2f} s")
    for note in report["notes"]:
        lines.append(f"note: {note}")
    return "\n".join(lines)
