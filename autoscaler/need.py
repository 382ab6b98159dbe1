"""What the load needs, counting the capacity already on its way: arrival rate x service time, plus the backlog that
capacity in flight will not absorb. Pure: time is an argument, state goes in and comes out frozen.

Queue depth alone over-asks during a pulse: while claimed slots activate, every arrival waits, and the backlog
grows by (arrivals - completions) x lead time. Read as demand, that backlog asks for replicas the load does not
need once the first ones are ready (Knative's activator and Ray Serve count pending replicas for the same reason).
Here the steady need is Little's law on the arrivals, ``arrival rate x service time / target``, and the backlog is
projected to the moment the capacity asked for is ready and, while it grows, drained over `DRAIN_S` with at most
`HEADROOM` more.

- Arrival rate: the mean of the gateways' counter rates over the panic window, or since the panic began when that
  is more recent (a step in the load is measured from the step, not averaged with the level before it), less
  `RATE_Z` standard errors of a Poisson count over that span. A rate measured over 0.1 s is noise; taking its lower
  bound makes one sample's luck no reason to scale out, and keeps the max that panic and the scale-down
  stabilisation hold from climbing on noise. The bound tightens as evidence accrues, so the count rises to the
  need, never past it.
- Service time: mean in-flight / mean completions over the panic window, taken only while arrivals and completions
  balance (Little's law needs a steady flow; a ramp from idle would read several times too long), smoothed over
  the stable window. Unknown until then: the policy reads queue depth as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from autoscaler.detector import TimeWindow

__all__ = ["DRAIN_S", "HEADROOM", "RATE_Z", "Need", "NeedConfig", "NeedState", "estimate", "initial", "record"]

RATE_Z: Final = 2.0
"""Standard errors taken off the measured arrival rate (Poisson: sqrt(rate / seconds)): ~2 % of 600 req/s over
6 s, 46 % of 1 req/s over the same."""
DRAIN_S: Final = 10.0
"""The projected backlog is to be drained within this once the capacity is ready (within `HEADROOM`)."""
HEADROOM: Final = 0.05
"""Capacity for draining a backlog, at most this share of the need (and at least one replica): a backlog's work is
the same GPU-seconds drained fast or slow, but replicas added for it are held through panic and the scale-down
window."""
BALANCE: Final = 0.2
"""Arrivals and completions within this share of each other: the flow is steady enough for Little's law."""


@dataclass(frozen=True, slots=True)
class NeedConfig:
    rate_window_s: float
    """The arrival rate's window (the panic window)."""
    service_window_s: float
    """The service time's smoothing (the stable window)."""
    target: float
    """Queue + in-flight one replica carries (`targetQueueDepth`)."""
    carry_s: float


@dataclass(frozen=True, slots=True)
class NeedState:
    arrivals: TimeWindow
    completions: TimeWindow
    in_flight: TimeWindow
    service_s: float | None = None
    """Smoothed service time (s); None until one balanced window was seen."""
    recorded_at: float | None = None
    """The last record: the service time moves by the time since it, over the stable window (an EWMA in time)."""


@dataclass(frozen=True, slots=True)
class Need:
    """One reading: `replicas` is the total the load needs when the capacity asked for is ready."""

    replicas: float
    arrival_rate: float
    """The lower bound taken (req/s)."""
    service_s: float
    backlog: float
    """Projected queue when the capacity asked for is ready."""
    drain_replicas: float


def initial(cfg: NeedConfig) -> NeedState:
    def w() -> TimeWindow:
        return TimeWindow.empty(cfg.rate_window_s, carry_s=cfg.carry_s)

    return NeedState(w(), w(), w())


def record(
    cfg: NeedConfig,
    state: NeedState,
    *,
    now: float,
    arrival_rate: float,
    completion_rate: float,
    in_flight: float,
) -> NeedState:
    """`state` with one observation recorded and the service time updated."""
    if (
        state.arrivals.span_s != max(cfg.rate_window_s, state.arrivals.bucket_s)
        or state.arrivals.carry_s != cfg.carry_s
    ):
        state = initial(cfg)  # the spec's windows changed
    arrivals = state.arrivals.record(now, arrival_rate)
    completions = state.completions.record(now, completion_rate)
    flight = state.in_flight.record(now, in_flight)
    service_s, last = state.service_s, state.recorded_at
    span = cfg.rate_window_s
    first = arrivals.first_ts
    lam, mu, busy = arrivals.mean(now, span), completions.mean(now, span), flight.mean(now, span)
    full = first is not None and now - first >= span
    steady = full and lam is not None and mu is not None and busy is not None and mu > 0 and busy > 0
    if steady and lam is not None and mu is not None and busy is not None and abs(lam - mu) <= BALANCE * max(lam, mu):
        seen = busy / mu
        if service_s is None or last is None:
            service_s = seen
        else:
            # Per second of balanced flow, not per decision: a burst of decisions moves it no faster.
            weight = min(max(now - last, 0.0) / max(cfg.service_window_s, 1e-9), 1.0)
            service_s += (seen - service_s) * weight
    return NeedState(arrivals, completions, flight, service_s, now)


def _mean(window: TimeWindow, now: float, span_s: float, full_s: float) -> float:
    """The window's mean over `span_s`: the running aggregate for the full span, a pass over the buckets for a
    shorter one (each span read by its aggregate would keep one more aggregate up to date on every record)."""
    if span_s >= full_s:
        return window.mean(now, full_s) or 0.0
    _, values = window.select(now, span_s)
    return float(values.sum()) / values.size if values.size else 0.0


def estimate(
    cfg: NeedConfig,
    state: NeedState,
    *,
    now: float,
    queued: float,
    lead_s: float,
    since: float | None,
) -> Need | None:
    """What the load needs at `now` (None while the service time is unknown). `since`: when the current panic
    began (the rate is measured from there when that is within the window)."""
    w = state.service_s
    if w is None or w <= 0:
        return None
    span = cfg.rate_window_s
    first = state.arrivals.first_ts
    if since is not None and now - since < span:
        span = max(now - since, state.arrivals.bucket_s)
    elif first is not None and now - first < span:
        span = max(now - first, state.arrivals.bucket_s)
    lam = _mean(state.arrivals, now, span, cfg.rate_window_s)
    mu = state.completions.mean(now, min(cfg.rate_window_s, 1.0)) or 0.0
    lam_low = max(lam - RATE_Z * math.sqrt(max(lam, 0.0) / span), 0.0)
    steady = lam_low * w / cfg.target
    # The queue when the capacity asked for is ready: what waits now, plus what arrives beyond today's throughput
    # over the lead time. Capacity in flight absorbs the rest; this much is left to drain.
    backlog = max(queued + max(lam_low - mu, 0.0) * lead_s, 0.0)
    drain = 0.0
    # Only a growing backlog asks for more: one that today's throughput already outpaces is a queue's noise (a
    # Poisson blip on a small model would add a replica, and take it back a stabilisation window later).
    if backlog > 0 and lam_low > mu:
        drain = min(backlog / DRAIN_S * w / cfg.target, max(HEADROOM * steady, 1.0))
    return Need(steady + drain, lam_low, w, backlog, drain)
