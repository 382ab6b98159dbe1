"""What the pulse cost, from what the run measured. Pure: no I/O, times passed in (`demo.report` calls these).

- every request the load generator sent, as a `Request` (sent, ended, HTTP status or why there was none): latency
  percentiles per phase, answers by status, and the per-second series (by send time and, for the 200s, by the second
  they completed in, which no replica count can exceed);
- the serving replicas, a step function from the autoscaler's ``slot.ready``/``slot.released``/``slot.failed``
  events: replica-seconds against the replica-seconds the offered load needed, second by second, at one replica's
  capacity;
- the base phase: replicas held against what the base load needs at the headroom the demo provisions it with;
- the autoscaler's ``cold.start`` asks, by phase (before any load, base, pulse, after);
- its ``scale.decision`` steps on the flat load after the pulse, and the scale-down stabilisation window they fall in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from gateway.loadgen import percentile
from warmpool.protocol import Event

__all__ = [
    "CONNECTION_ERROR",
    "CLIENT_TIMEOUT",
    "Request",
    "Window",
    "after_pulse",
    "base_phase",
    "by_status",
    "cold_path_phases",
    "latency",
    "needed_for",
    "replica_seconds",
]

CONNECTION_ERROR: Final = "connection_error"
"""No HTTP answer: the connection failed or broke (refused, reset, closed before the answer)."""
CLIENT_TIMEOUT: Final = "client_timeout"
"""No HTTP answer within the load generator's own bound (the gateway's timeout and the drain)."""


@dataclass(frozen=True)
class Request:
    """One request the load generator sent; times in seconds since the load's t=0."""

    sent_s: float
    done_s: float
    """When its answer was read in full, or when it failed."""
    status: int | None
    """The HTTP status; None when there was no HTTP answer (`error` says why)."""
    error: str | None = None

    @property
    def latency_s(self) -> float:
        return self.done_s - self.sent_s

    @property
    def outcome(self) -> str:
        """``200``, ``504``... or `CONNECTION_ERROR` / `CLIENT_TIMEOUT`: the key of `by_status`."""
        return str(self.status) if self.status is not None else self.error or CONNECTION_ERROR


@dataclass(frozen=True)
class Window:
    """[start, end) in seconds since the load's t=0."""

    start: float
    end: float

    def __contains__(self, t: float) -> bool:
        return self.start <= t < self.end


# --- requests -------------------------------------------------------------------------------------------------------


def by_status(requests: Iterable[Request]) -> dict[str, int]:
    """Requests by outcome (``200``, ``504``, ``connection_error``...), most frequent first."""
    out: dict[str, int] = {}
    for r in requests:
        out[r.outcome] = out.get(r.outcome, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def latency(requests: Iterable[Request]) -> dict[str, Any]:
    """``requests`` counted and their latency's p50, p99 and max in ms (None without any)."""
    lat = sorted(r.latency_s * 1e3 for r in requests)
    return {
        "requests": len(lat),
        "p50": _round(percentile(lat, 50)),
        "p99": _round(percentile(lat, 99)),
        "max": _round(lat[-1] if lat else None),
    }


# --- replicas -------------------------------------------------------------------------------------------------------


def needed_for(rps: float, capacity_rps: float, utilisation: float = 1.0) -> int:
    """Replicas that serve `rps` with each at `utilisation` of `capacity_rps`; 0 for no load."""
    if rps <= 0 or capacity_rps <= 0:
        return 0
    return math.ceil(rps / (capacity_rps * utilisation) - 1e-9)


def _serving_in(changes: Sequence[tuple[float, int]], w: Window) -> list[tuple[float, float, int]]:
    """The serving count as (start, end, count) pieces covering `w` (times relative to the load's t=0)."""
    count = 0
    for ts, n in changes:
        if ts > w.start:
            break
        count = n
    pieces: list[tuple[float, float, int]] = []
    at = w.start
    for ts, n in changes:
        if ts <= w.start:
            continue
        if ts >= w.end:
            break
        pieces.append((at, ts, count))
        at, count = ts, n
    pieces.append((at, w.end, count))
    return [p for p in pieces if p[1] > p[0]]


def replica_seconds(
    changes: Sequence[tuple[float, int]], w: Window, sent_per_s: Sequence[int], capacity_rps: float
) -> dict[str, Any]:
    """Replica-seconds served in `w` against the replica-seconds needed (each second of `sent_per_s` from t=0 needs
    `needed_for(sent, capacity_rps)` replicas, at full use), and the peaks of both. `changes` are (time since t=0,
    serving replicas after it)."""
    pieces = _serving_in(changes, w)
    served = sum((b - a) * n for a, b, n in pieces)
    needed_by_s = [needed_for(n, capacity_rps) for n in sent_per_s]
    needed = 0.0
    for t, need in enumerate(needed_by_s):
        overlap = min(t + 1, w.end) - max(t, w.start)
        needed += max(0.0, overlap) * need
    return {
        "window_s": [round(w.start, 3), round(w.end, 3)],
        "replica_seconds": round(served, 1),
        "needed_replica_seconds": round(needed, 1),
        "ratio": None if needed == 0 else round(served / needed, 2),
        "peak_replicas": max((n for _, _, n in pieces), default=0),
        "needed_peak_replicas": max(needed_by_s, default=0),
        "capacity_rps_per_replica": round(capacity_rps, 2),
    }


def base_phase(
    changes: Sequence[tuple[float, int]],
    w: Window,
    sent_per_s: Sequence[int],
    capacity_rps: float,
    utilisation: float,
) -> dict[str, Any]:
    """The base load before the pulse: the most replicas serving in `w` (`replicas`) against what its measured rate
    needs with each replica at `utilisation` of `capacity_rps` (`needed_replicas`, the headroom the demo provisions
    the base with) and at full use (`needed_at_full_use`)."""
    whole = [n for t, n in enumerate(sent_per_s) if t >= w.start and t + 1 <= w.end]
    rps = sum(whole) / len(whole) if whole else 0.0
    pieces = _serving_in(changes, w)
    span = w.end - w.start
    return {
        "window_s": [round(w.start, 3), round(w.end, 3)],
        "offered_rps": round(rps, 2),
        "replicas": max((n for _, _, n in pieces), default=0),
        "replicas_mean": round(sum((b - a) * n for a, b, n in pieces) / span, 2) if span > 0 else 0.0,
        "needed_replicas": max(1, needed_for(rps, capacity_rps, utilisation)),
        "needed_at_full_use": max(1, needed_for(rps, capacity_rps)),
        "utilisation": utilisation,
    }


# --- the autoscaler's asks and steps -------------------------------------------------------------------------------

PHASES: Final = ("before_load", "base", "pulse", "after")


def phase_of(t: float, pulse: Window) -> str:
    """`t` (seconds since the load's t=0) in the run's phases: before any load, the base, the pulse, after it."""
    if t < 0:
        return "before_load"
    if t < pulse.start:
        return "base"
    return "pulse" if t < pulse.end else "after"


def cold_path_phases(cold_starts: Iterable[Event], load_start: float, pulse: Window) -> dict[str, Any]:
    """The ``cold.start`` asks by phase: how many asks (`asks`) and the most replicas one ask asked for (each ask
    states the whole shortfall of its moment, so asks are not summed)."""
    asks = dict.fromkeys(PHASES, 0)
    most = dict.fromkeys(PHASES, 0)
    for e in cold_starts:
        p = phase_of(e.ts - load_start, pulse)
        asks[p] += 1
        most[p] = max(most[p], e.desired or 0)
    return {"asks": asks, "most_replicas_in_one_ask": most}


def after_pulse(
    decisions: Iterable[Event], load_start: float, w: Window, window_s: float, desired_before: int | None
) -> dict[str, Any]:
    """The autoscaler's target steps (``scale.decision`` events) on the flat load in `w`: scale-ins and scale-outs,
    each with the scale-down stabilisation window it falls in (0: within `window_s` of the first step, 1: the next
    `window_s`...), and the most scale-ins inside any one window's span (sliding: any `window_s` seconds).
    `desired_before` is the target before the first event here (the last decision before `w`)."""
    steps: list[dict[str, Any]] = []
    first: float | None = None
    prev = desired_before
    for e in sorted(decisions, key=lambda e: e.ts):
        t = e.ts - load_start
        if e.desired is None:
            continue
        if t < w.start:
            prev = e.desired
            continue
        if t >= w.end:
            break
        if prev is not None and e.desired != prev:
            first = t if first is None else first
            steps.append(
                {
                    "at_s": round(t - w.start, 3),
                    "from": prev,
                    "to": e.desired,
                    "kind": "in" if e.desired < prev else "out",
                    "window": int((t - first) // window_s) if window_s > 0 else 0,
                    "reason": e.reason,
                }
            )
        prev = e.desired
    ins = [s["at_s"] for s in steps if s["kind"] == "in"]
    most = max((sum(1 for u in ins if t <= u < t + window_s) for t in ins), default=0)
    return {
        "window_s": [round(w.start, 3), round(w.end, 3)],
        "stabilisation_window_s": window_s,
        "scale_ins": len(ins),
        "scale_outs": sum(1 for s in steps if s["kind"] == "out"),
        "max_scale_ins_per_window": most,
        "steps": steps,
    }


def _round(v: float | None, nd: int = 1) -> float | None:
    return None if v is None else round(v, nd)
