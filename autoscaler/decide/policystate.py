"""The policy's terms: what it observes, what it decides, the state it carries, and the bounds and trigger it reads.

`autoscaler.decide.policy.decide` takes an `Observation` and a `PolicyState` and returns a `Decision` and the next
state; `autoscaler.decide.holds`, `autoscaler.decide.scalein` and `autoscaler.decide.settling` read the same terms.
Pure: frozen data, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

from autoscaler.decide import detector, need
from warmpool.protocol import Override, ScaledObjectSpec

__all__ = [
    "ROUNDING",
    "Bounds",
    "Decision",
    "Flat",
    "Mode",
    "Observation",
    "PolicyState",
    "bounds_of",
    "clean",
    "number_text",
    "trigger_of",
]

Mode = Literal["normal", "panic", "override", "paused", "fallback", "stale", "hold", "idle", "scheduled"]

ROUNDING: Final = 1e-9
"""`ceil(8.000000001 / 4)` must be 2, not 3: demand sums and trends are floats."""


@dataclass(frozen=True, slots=True)
class Observation:
    """What the ingest layer knows about one model at decision time."""

    demand: float | None
    """Sum over fresh gateways of queue depth + in-flight; None when no gateway is fresh (missing/stale metrics)."""
    ready: int
    """Serving replicas. Panic compares demand with ready capacity alone, as Knative (slots still activating are
    already counted in the desired total the controller holds)."""
    lead_time_s: float | None = None
    """Measured claim -> ready p90; None (or not a positive number) uses ``advanced.leadTimeSeconds``. Capped at
    the panic window (or the configured lead time, if longer): the trend is not extrapolated past its history."""
    override: Override | None = None
    paused_scale_in: bool = False
    """KEDA's ``paused-scale-in`` annotation (the ScaledObject record's): the count may rise, never fall."""
    paused_scale_out: bool = False
    """KEDA's ``paused-scale-out`` annotation: the count may fall, never rise."""
    created_at: float | None = None
    """When the ScaledObject was created (Unix s), for ``initialCooldownPeriod``; None counts from
    `PolicyState.started_at` (when this autoscaler first saw it)."""
    queued: float | None = None
    """The part of `demand` still waiting in the gateways' queues (the rest is in flight); None: not known, the
    whole demand is read as in flight."""
    arrival_rate: float | None = None
    """Requests per second arriving at the fresh gateways (their counters' deltas); None: not known yet."""
    completion_rate: float | None = None
    """Requests per second the fresh gateways saw complete; None: not known yet."""
    scheduled_floor: int | None = None
    """The floor a scheduled warm-up in force at `now` raises the count to (`ScaledObjectSpec.schedules`); None:
    none in force. Clamped to ``maxReplicaCount``; an on-call override still wins."""


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    reason: str
    panic: bool
    mode: Mode
    forecast_demand: float | None = None
    stable_demand: float | None = None
    panic_demand: float | None = None


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Everything `decide` carries from one call to the next. Frozen; its numpy arrays are read-only."""

    desired: int
    mode: Mode
    started_at: float
    hold_replicas: int | None
    """The count at (re)start, a floor until a stable window of demand has been seen; None once it has."""
    pulse: detector.PulseState
    recommendations: detector.TimeWindow
    """Per-bucket max of the normal-mode recommendation, over the scale-down stabilisation window."""
    scale_downs: tuple[tuple[float, int], ...] = ()
    """``(when, replicas removed)`` within the last scale-down period (or stabilisation window, if longer), for the
    rate limit and the gap between steps (`_step_gap_s`)."""
    scale_ups: tuple[tuple[float, int], ...] = ()
    """``(when, replicas added)`` within the last scale-down period: HPA takes them off the period's start count."""
    last_fresh_at: float | None = None
    last_active_at: float | None = None
    flat: Flat | None = None
    """What every decision since the start recorded, while all recorded the same (`Flat`); None once two differed
    (or one panicked, or had an override): then only `settle_s` after the last change says the windows settled."""
    need: need.NeedState | None = None
    """The arrival and completion rates and the service time learnt from them (`autoscaler.decide.need`); None until a
    decision had rates."""
    rec: int = 0
    """The last fresh decision's recommendation (what `repeat` records again in `lows`)."""
    held: int = 0
    """What the last fresh decision recorded in `recommendations`: its recommendation, or on rates the count the
    rate's upper bound may need if higher (what `repeat` records there again)."""
    lows: detector.TimeWindow | None = None
    """The rates' recommendations over the panic window, negated (its peak is their lowest): outside panic a
    count goes up only once the whole window asked for it; None until a decision had rates."""

    @property
    def panic(self) -> bool:
        return self.pulse.panic


@dataclass(frozen=True, slots=True)
class Flat:
    """The windows hold one value each since the start: `demand` (None until the first fresh one; the pulse window
    records nothing blind) and the recommendation `rec` (a blind decision records its count). Once `demand_since`
    (the first fresh demand) is `trend_settle_s` behind, a decision on the same inputs repeats the last one."""

    demand: float | None
    rec: int
    demand_since: float | None


@dataclass(frozen=True, slots=True)
class Bounds:
    min: int
    max: int
    idle: int
    """The count when idle: ``idleReplicaCount`` if set, else ``minReplicaCount``."""
    active_floor: int
    """While active at least one replica, as KEDA (with ``minReplicaCount`` 0 an active model still needs one)."""

    @property
    def idle_capable(self) -> bool:
        return self.idle < self.active_floor

    def clamp(self, replicas: int) -> int:
        """Any count into the legal set: ``{idle}`` (when idle-capable) or ``[active_floor, max]``."""
        if replicas > self.max:
            return self.max
        if replicas >= self.active_floor:
            return replicas
        return self.idle if self.idle_capable and replicas <= self.idle else self.active_floor


def bounds_of(spec: ScaledObjectSpec) -> Bounds:
    idle = spec.idle_replica_count if spec.idle_replica_count is not None else spec.min_replica_count
    return Bounds(spec.min_replica_count, spec.max_replica_count, idle, max(spec.min_replica_count, 1))


def trigger_of(spec: ScaledObjectSpec) -> tuple[float, float]:
    """(target, activation) over the triggers; they all read the same demand, so the smallest target wants the
    most replicas and the smallest activation depth activates first (KEDA takes the max over triggers)."""
    meta = [t.metadata for t in spec.triggers]
    return min(m.target_queue_depth for m in meta), min(m.activation_queue_depth for m in meta)


def clean(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def number_text(x: float) -> str:
    """A number for a reason string: at most one decimal, no trailing zeros."""
    return f"{x:.1f}".removesuffix(".0")
