"""What the load needs, counting the capacity already on its way: arrival rate x service time, plus the backlog that
capacity in flight will not absorb. Pure: time is an argument, state goes in and comes out frozen.

Queue depth alone over-asks during a pulse: while claimed slots activate, every arrival waits, and the backlog
grows by (arrivals - completions) x lead time. Read as demand, that backlog asks for replicas the load does not
need once the first ones are ready (Knative's activator and Ray Serve count pending replicas for the same reason).
Here the steady need is Little's law on the arrivals, ``arrival rate x service time / target``, and the backlog is
projected to the moment the capacity asked for is ready and, while it grows, drained within `DRAIN_SERVICES`
service times with at most `HEADROOM` more.

- Arrival rate: the mean of the gateways' counter rates over the panic window, or, while the panic condition holds,
  since it began to hold, over up to the stable window (a step in the load is measured from the step, not averaged
  with the level before it), less
  `RATE_Z` standard errors of a Poisson count over that span. A rate measured over 0.1 s is noise; taking its lower
  bound makes one sample's luck no reason to scale out, and keeps the max that panic and the scale-down
  stabilisation hold from climbing on noise. The bound tightens as evidence accrues, so the count rises to the
  need, never past it.
- Service time: mean in-flight / mean completions over the panic window, taken only while the flow is steady
  (arrivals and completions balance, or every slot stayed busy at one ready count: Little's law; a ramp from idle
  would read several times too long), smoothed over the stable window. Unknown until then: the policy reads
  queue depth as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from autoscaler.decide.detector import TimeWindow
from warmpool.protocol import ScaledObjectSpec

__all__ = [
    "DRAIN_SERVICES",
    "HEADROOM",
    "RATE_Z",
    "TOLERANCE",
    "Need",
    "NeedConfig",
    "NeedState",
    "config",
    "estimate",
    "initial",
    "record",
]

RATE_Z: Final = 2.0
"""Standard errors taken off the measured arrival rate (Poisson: sqrt(rate / seconds)): ~2 % of 600 req/s over
6 s, 46 % of 1 req/s over the same."""
DRAIN_SERVICES: Final = 10.0
"""The projected backlog is to be drained within this many service times once the capacity is ready (within
`HEADROOM`): a queued request waits about that much longer than it would have, on a 2 s completion as on a 50 ms
one."""
HEADROOM: Final = 0.05
"""Capacity for draining a backlog, at most this share of the need (and at least one replica): a backlog's work is
the same GPU-seconds drained fast or slow, but replicas added for it are held through panic and the scale-down
window."""
TOLERANCE: Final = 0.1
"""A need this little over a whole count is that count (HPA's tolerance, in replicas): a rate at a replica's edge
would otherwise add it and take it back a stabilisation window later."""
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
    ready: int = 0
    saturated_since: float | None = None
    """Since when requests have queued at this ready count (None: none queue now)."""
    surge_since: float | None = None
    """Since when the panic condition has held without a break (None: it does not now)."""


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
    high: float = 0.0
    """The need at the rate's upper bound (`RATE_Z` standard errors over it): no scale-in below it, so a rate's
    low minute is no reason to give a replica back."""


def config(spec: ScaledObjectSpec, target: float) -> NeedConfig:
    """The windows a ScaledObject gives: the rate over its panic window, the service time over its stable one."""
    adv = spec.advanced
    return NeedConfig(
        rate_window_s=adv.panic_window_seconds,
        service_window_s=adv.stable_window_seconds,
        target=target,
        carry_s=adv.stale_after_seconds,
    )


def initial(cfg: NeedConfig) -> NeedState:
    def w() -> TimeWindow:
        return TimeWindow.empty(_span(cfg), carry_s=cfg.carry_s)

    return NeedState(w(), w(), w())


def _span(cfg: NeedConfig) -> float:
    """What the windows hold: a surge's rate is read from its start over up to the stable window."""
    return max(cfg.rate_window_s, cfg.service_window_s)


def record(
    cfg: NeedConfig,
    state: NeedState,
    *,
    now: float,
    arrival_rate: float,
    completion_rate: float,
    in_flight: float,
    ready: int = 0,
    queued: float = 0.0,
    surge: bool = False,
) -> NeedState:
    """`state` with one observation recorded and the service time updated. `surge`: the panic condition holds."""
    if state.arrivals.span_s != max(_span(cfg), state.arrivals.bucket_s) or state.arrivals.carry_s != cfg.carry_s:
        state = initial(cfg)  # the spec's windows changed
    arrivals = state.arrivals.record(now, arrival_rate)
    completions = state.completions.record(now, completion_rate)
    flight = state.in_flight.record(now, in_flight)
    saturated = None
    if queued > 0:
        kept = ready == state.ready and state.saturated_since is not None
        saturated = state.saturated_since if kept else now
    surge_since = (state.surge_since if state.surge_since is not None else now) if surge else None
    service_s, last = state.service_s, state.recorded_at
    span = cfg.rate_window_s
    first = arrivals.first_ts
    lam, mu, busy = arrivals.mean(now, span), completions.mean(now, span), flight.mean(now, span)
    full = first is not None and now - first >= span
    if full and lam is not None and mu is not None and busy is not None and mu > 0 and busy > 0:
        # Little's law holds for a steady flow: arrivals and completions balance, or every slot stayed busy at one
        # ready count for the window and a service time before it, so completions run at the saturated rate too
        # (an engine's service time grows with its batch: the one learnt at a light load is short).
        balanced = abs(lam - mu) <= BALANCE * max(lam, mu)
        busy_all_along = saturated is not None and now - saturated >= span + (service_s or 0.0)
        if balanced or busy_all_along:
            seen = busy / mu
            if service_s is None or last is None:
                service_s = seen
            else:
                # Per second of steady flow, not per decision: a burst of decisions moves it no faster.
                weight = min(max(now - last, 0.0) / max(cfg.service_window_s, 1e-9), 1.0)
                service_s += (seen - service_s) * weight
    return NeedState(arrivals, completions, flight, service_s, now, ready, saturated, surge_since)


def _mean(window: TimeWindow, now: float, span_s: float, usual_s: float) -> float:
    """The window's mean over `span_s`: the running aggregate for the usual span, a pass over the buckets for
    another (each span read by its aggregate would keep one more aggregate up to date on every record)."""
    if abs(span_s - usual_s) < 1e-9:
        return window.mean(now, usual_s) or 0.0
    _, values = window.select(now, span_s)
    return float(values.sum()) / values.size if values.size else 0.0


def estimate(
    cfg: NeedConfig, state: NeedState, *, now: float, queued: float, lead_s: float, demand: float | None = None
) -> Need | None:
    """What the load needs at `now` (None while the service time is unknown); `demand`: the queue + in-flight now
    (None: not bounded by it)."""
    w = state.service_s
    if w is None or w <= 0:
        return None
    span = cfg.rate_window_s
    since, first = state.surge_since, state.arrivals.first_ts
    if since is not None:
        span = min(now - since + state.arrivals.bucket_s, cfg.service_window_s)  # the sample that began it too
    if first is not None:
        span = min(span, now - first + state.arrivals.bucket_s)
    span = max(span, state.arrivals.bucket_s)
    lam = _mean(state.arrivals, now, span, cfg.rate_window_s)
    mu = state.completions.mean(now, min(cfg.rate_window_s, 1.0)) or 0.0
    error = RATE_Z * math.sqrt(max(lam, 0.0) / span)
    lam_low = max(lam - error, 0.0)
    steady = lam_low * w / cfg.target
    high = (lam + error) * w / cfg.target
    ready, saturated = state.ready, state.saturated_since
    served = state.completions.mean(now, cfg.rate_window_s) or 0.0
    if ready > 0 and served > 0 and saturated is not None and now - saturated >= cfg.rate_window_s + w:
        # Every slot busy at this ready count for a window and a service time before it: what the replicas
        # complete is what they can, under this load (an engine's service time grows with its batch and with the
        # host's contention; the one learnt at a light load can be a third of it).
        per_replica = served / ready
        steady = max(steady, lam_low / per_replica)
        high = max(high, (lam + error) / per_replica)
    if demand is not None:
        # A rate holds a replica's slots for a service time only once it has lasted one: a 1 s burst of 5 s
        # requests fills 1 s of arrivals' slots, not 5. What exists when the capacity lands (every request now,
        # and the arrivals of the lead time) bounds it until then.
        steady = min(steady, (demand + lam_low * lead_s) / cfg.target)
        high = min(high, (demand + (lam + error) * lead_s) / cfg.target)
    # The queue when the capacity asked for is ready: what waits now, plus what arrives beyond today's throughput
    # over the lead time. Capacity in flight absorbs the rest; this much is left to drain.
    backlog = max(queued + max(lam_low - mu, 0.0) * lead_s, 0.0)
    drain = 0.0
    # Only a growing backlog asks for more: one that today's throughput already outpaces is a queue's noise (a
    # Poisson blip on a small model would add a replica, and take it back a stabilisation window later).
    if backlog > 0 and lam_low > mu:
        drain = min(backlog / (DRAIN_SERVICES * w) * w / cfg.target, max(HEADROOM * steady, 1.0))
    return Need(steady + drain, lam_low, w, backlog, drain, high)
