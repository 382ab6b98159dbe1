"""The scaling policy: ``decide(spec, observation, state, now) -> (decision, state)``.

Pure, as DESIGN.md "Scaling policy" asks: no I/O, no clock (``now`` is an argument), frozen inputs and outputs.
The controller calls `decide` on every (debounced) sample of a model and acts on `Decision.desired`; the
`Decision.reason` goes to events, status and logs as it is.

Order of precedence, first match wins:

1. a live on-call override (``scale`` or ``pause``): exactly its count, not clamped to the bounds (KEDA's
   paused-replicas is not clamped either: the person asked for that count); an expired one is ignored and the
   reason says the policy resumed;
2. no fresh demand (missing or stale gateways): never scale down; once more than ``fallback.failureThreshold``
   intervals of ``advanced.staleAfterSeconds`` passed without fresh demand since the last decision that had it
   (KEDA's ``NumberOfFailures > FailureThreshold``, a missed interval being KEDA's failed poll: threshold N
   tolerates N, 0 none), the fallback count clamped to the bounds, chosen by
   ``fallback.behavior`` as KEDA's: ``static`` is ``fallback.replicas`` (the operator's explicit count for flying
   blind, the one way stale metrics can lower the count), ``currentReplicas`` the current desired count,
   ``currentReplicasIfHigher``/``IfLower`` the current count when it is higher/lower than ``fallback.replicas``,
   else ``fallback.replicas``. The count held blind enters the stabilisation window, so it is left only after a
   window of fresh data;
3. idle (only when ``idleReplicaCount`` is set or ``minReplicaCount`` is 0): after ``cooldownPeriod`` without demand
   above ``activationQueueDepth``, drop to the idle count; from there scale up only when demand exceeds it (KEDA).
   Not before ``initialCooldownPeriod`` has passed since the ScaledObject was created (`Observation.created_at`;
   unknown: since this policy state started), as KEDA's;
4. panic: never down, up at once to the panic window's peak or the forecast, whichever is higher;
5. normal: ``ceil(forecast / targetQueueDepth)`` up at once; down only to the highest recommendation of the
   stabilisation window and by at most what the scale-down policies allow per ``scaleDownPeriodSeconds``, exactly
   as HPA's ``calculateScaleDownLimitWithBehaviors``: from the count at the period's start (the current count, less
   the replicas added and plus those removed within the last period, so a step up within the period does not
   raise it), the percent policy keeps ``int(start x (1 - scaleDownPercent / 100))``, rounded down as HPA's
   ``int32()`` (50 % of 3 keeps 1; rounding down removes at least one replica per period, so no extra rule is
   needed), and ``scaleDownPods``, when set, keeps ``start - scaleDownPods``; ``scaleDownSelectPolicy`` ``Max``
   keeps the lower of the two (the larger removal), ``Min`` the higher, and ``Disabled`` never steps down (the idle
   drop of rule 3 is KEDA's own, not the HPA's, and still applies). Only the policy's own steps count, as HPA
   stores only its own rescales: an on-call override's steps (rule 1) are the person's, as a ``kubectl scale`` is
   to an HPA;

then the bounds ``[minReplicaCount (at least 1 while active), maxReplicaCount]``, and after a restart the count held
at restart is a floor until the demand window has a full stable window of data (Knative's restart rule). A bound
beats "never down": lowering ``maxReplicaCount`` below the count applies at once, in panic too. KEDA's
``paused-scale-in`` / ``paused-scale-out`` annotations (`Observation.paused_scale_in`/``_out``) then keep the count
from falling / rising relative to the current desired count (mode ``paused``, the reason says what the policy
wanted); the bounds still apply, as an HPA applies them before its behavior. An on-call override (rule 1) beats
them: the person asked for that count.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from autoscaler import detector, need
from warmpool.protocol import Override, ScaledObjectSpec

__all__ = [
    "Decision",
    "Mode",
    "Observation",
    "Override",
    "PolicyState",
    "decide",
    "initial_state",
    "repeat",
    "settle_s",
    "time_events",
]

Mode = Literal["normal", "panic", "override", "paused", "fallback", "stale", "hold", "idle", "scheduled"]

_ROUNDING: Final = 1e-9
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
    """The arrival and completion rates and the service time learnt from them (`autoscaler.need`); None until a
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
class _Bounds:
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


def _bounds(spec: ScaledObjectSpec) -> _Bounds:
    idle = spec.idle_replica_count if spec.idle_replica_count is not None else spec.min_replica_count
    return _Bounds(spec.min_replica_count, spec.max_replica_count, idle, max(spec.min_replica_count, 1))


def _trigger(spec: ScaledObjectSpec) -> tuple[float, float]:
    """(target, activation) over the triggers; they all read the same demand, so the smallest target wants the
    most replicas and the smallest activation depth activates first (KEDA takes the max over triggers)."""
    meta = [t.metadata for t in spec.triggers]
    return min(m.target_queue_depth for m in meta), min(m.activation_queue_depth for m in meta)


def _record_need(
    cfg: need.NeedConfig,
    state: need.NeedState | None,
    obs: Observation,
    demand: float,
    now: float,
    surge: bool = False,
) -> need.NeedState | None:
    """The rates of `obs` recorded (None kept while no decision had them)."""
    lam, mu = _clean(obs.arrival_rate), _clean(obs.completion_rate)
    if lam is None or mu is None:
        return state
    queued = min(_clean(obs.queued) or 0.0, demand)
    return need.record(
        cfg, state or need.initial(cfg), now=now, arrival_rate=lam, completion_rate=mu, in_flight=demand - queued,
        ready=max(obs.ready, 0), queued=queued, surge=surge,
    )  # fmt: skip


def _lows_window(spec: ScaledObjectSpec) -> detector.TimeWindow:
    return detector.TimeWindow.empty(spec.advanced.panic_window_seconds, combine="max")


def _config(
    spec: ScaledObjectSpec, target: float, activation: float, scale_in: ScaleIn | None = None
) -> detector.DetectorConfig:
    adv = spec.advanced
    return detector.DetectorConfig(
        calm_s=scale_in.calm_s if scale_in is not None else None,
        stable_window_s=adv.stable_window_seconds,
        panic_window_s=adv.panic_window_seconds,
        panic_threshold=adv.panic_threshold,
        target_queue_depth=target,
        activation_queue_depth=activation,
        carry_s=adv.stale_after_seconds,
    )


AUTO_HOLD_MAX_S: Final = 60.0
"""The longest scale-in hold an unset stabilisation takes (revision 8's default window): a lead time of minutes, the
cold path's, holds no longer than an HPA-like window would."""
SET_STABILIZATION_PERIOD_S: Final = 60.0
"""`scaleDownPeriodSeconds` left unset where the stabilisation is set: revision 8's default, so a ScaledObject that
sets only the window scales as it did."""
SET_STABILIZATION_PERCENT: Final = 50.0
"""`scaleDownPercent` left unset where the stabilisation is set: revision 8's default, for the same reason."""


@dataclass(frozen=True, slots=True)
class ScaleIn:
    """The scale-in windows in force: a field that is set as given, an unset one from the lead time (revision 9).

    Bringing a released replica back costs one lead time from the warm pool (claim -> ready), so an idle replica
    is held about that long (ski rental's break-even) but never less than a panic window, the evidence a rise needs
    too, and never more than `AUTO_HOLD_MAX_S`. HPA's 300 s and Knative's 60 s windows price a cold start of
    minutes: held after each 10 s burst of the bursty trace replayed 10x, 60 s windows spent 2.1 x the oracle's
    replica-seconds, the hold 1.17 x (README, `pulsescale simulate --trace`)."""

    hold_s: float
    """The stabilisation window: scale down to the highest recommendation over it."""
    period_s: float
    """The scale-down rate's period."""
    percent: float
    """The share of the replicas the scale-down rate removes per period."""
    calm_s: float
    """Panic is left this long after its condition last held: the stable window, or the hold where it is unset."""
    auto: bool
    """The stabilisation window was unset: `hold_s` comes from the lead time."""


def scale_in(spec: ScaledObjectSpec, lead_s: float) -> ScaleIn:
    """The scale-in windows at a measured lead time of `lead_s` (claim -> ready p90) for `spec`."""
    adv = spec.advanced
    stab, period, percent = adv.scale_down_stabilization_seconds, adv.scale_down_period_seconds, adv.scale_down_percent
    if not isinstance(stab, msgspec.UnsetType):
        return ScaleIn(
            stab,
            SET_STABILIZATION_PERIOD_S if isinstance(period, msgspec.UnsetType) else period,
            SET_STABILIZATION_PERCENT if isinstance(percent, msgspec.UnsetType) else percent,
            adv.stable_window_seconds,
            auto=False,
        )
    hold = min(max(lead_s, adv.panic_window_seconds), AUTO_HOLD_MAX_S)
    return ScaleIn(
        hold,
        hold if isinstance(period, msgspec.UnsetType) else period,
        100.0 if isinstance(percent, msgspec.UnsetType) else percent,
        min(adv.stable_window_seconds, hold),
        auto=True,
    )


def _span_s(spec: ScaledObjectSpec) -> float:
    """The recommendations' window: the longest stabilisation `scale_in` can resolve to for `spec`."""
    stab = spec.advanced.scale_down_stabilization_seconds
    return max(AUTO_HOLD_MAX_S if isinstance(stab, msgspec.UnsetType) else stab, detector.BUCKET_S)


def _recommendation_window(spec: ScaledObjectSpec) -> detector.TimeWindow:
    return detector.TimeWindow.empty(_span_s(spec), combine="max")


def _n(x: float) -> str:
    """A number for a reason string: at most one decimal, no trailing zeros."""
    return f"{x:.1f}".removesuffix(".0")


def _replicas(demand: float, target: float) -> int:
    return max(math.ceil(demand / target - _ROUNDING), 0)


def initial_state(spec: ScaledObjectSpec, *, now: float, current_replicas: int) -> PolicyState:
    """State for a model seen for the first time, or after a restart or leader failover: the current count is held
    (scale-ups allowed) until a stable window of demand has been seen (Knative's restart rule)."""
    current = max(current_replicas, 0)
    target, activation = _trigger(spec)
    bounds = _bounds(spec)
    return PolicyState(
        desired=current,
        mode="hold",
        started_at=now,
        hold_replicas=current,
        pulse=detector.initial(_config(spec, target, activation)),
        recommendations=_recommendation_window(spec),
        last_active_at=now if current > bounds.idle else None,
        flat=_UNRECORDED,
    )


def _clean(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def _live(override: Override, now: float) -> bool:
    return override.expires_at is None or now < override.expires_at


def _describe(override: Override) -> str:
    count = "current" if override.replicas is None else str(override.replicas)
    by = f" by {override.by}" if override.by else ""
    return f"override {override.kind}={count}{by}"


def _apply_override(override: Override, prev: int, bounds: _Bounds, now: float) -> tuple[int, Mode, str]:
    left = "until resumed" if override.expires_at is None else f"{_n(override.expires_at - now)} s left"
    by = f" by {override.by}" if override.by else ""
    mode: Mode
    if override.kind == "scale" and override.replicas is not None:
        desired, mode = max(override.replicas, 0), "override"
        what = f"override scale={desired}"
    else:
        desired = prev if override.replicas is None else max(override.replicas, 0)
        mode, what = "paused", f"paused at {desired}"
    outside = "" if bounds.min <= desired <= bounds.max else f", outside bounds {bounds.min}..{bounds.max}"
    return desired, mode, f"{what}{by}, {left}{outside}"


def _in_period(changes: tuple[tuple[float, int], ...], period_s: float, now: float) -> int:
    """Replicas changed within the last `period_s` (HPA's ``getReplicasChangePerPeriod``: after now - period)."""
    return sum(n for ts, n in changes if now - ts < period_s)


def _rate_floor(prev: int, state: PolicyState, spec: ScaledObjectSpec, windows: ScaleIn, now: float) -> int:
    """The lowest count the scale-down policies allow now, as HPA's ``calculateScaleDownLimitWithBehaviors``."""
    adv = spec.advanced
    if adv.scale_down_select_policy == "Disabled":
        return prev
    period_s = windows.period_s
    at_period_start = prev - _in_period(state.scale_ups, period_s, now) + _in_period(state.scale_downs, period_s, now)
    # HPA's int32(float64(start) * (1 - float64(value)/100)): the same float expression, truncated, so the count
    # is HPA's bit for bit (a ceiling kept one replica more: 25 % of 10 kept 8 where HPA keeps 7).
    keep = int(at_period_start * (1 - windows.percent / 100))
    if adv.scale_down_pods is not None:
        by_pods = at_period_start - adv.scale_down_pods
        # Max: the policy that removes more (keeps fewer) wins; Min: the one that removes fewer.
        keep = min(keep, by_pods) if adv.scale_down_select_policy == "Max" else max(keep, by_pods)
    # A limit above the count (steps down already used up) holds the count, as HPA's; never below zero.
    return min(prev, max(keep, 0))


def _step_gap_s(windows: ScaleIn) -> float:
    """On rates, the least time between two scale-in steps: the stabilisation window, or the period if longer."""
    return max(windows.hold_s, windows.period_s)


def _rate_text(spec: ScaledObjectSpec, windows: ScaleIn) -> str:
    """The scale-down policies for a reason string: ``50 %/60 s``, ``max(50 %, 2 pods)/60 s``."""
    adv = spec.advanced
    pct = f"{_n(windows.percent)} %"
    if adv.scale_down_pods is not None:
        pct = f"{adv.scale_down_select_policy.lower()}({pct}, {adv.scale_down_pods} pods)"
    return f"{pct}/{_n(windows.period_s)} s"


def _fallback_count(spec: ScaledObjectSpec, prev: int) -> tuple[int, str]:
    """The count KEDA's ``fallback.behavior`` asks for, with the words for the reason; "current" is the current
    desired count (what the autoscaler holds), as KEDA reads the target's current replicas."""
    fb = spec.fallback
    assert fb is not None
    behavior = fb.behavior
    if behavior == "currentReplicas":
        return prev, f"currentReplicas: current {prev}"
    if behavior == "currentReplicasIfHigher":
        if prev > fb.replicas:
            return prev, f"currentReplicasIfHigher: current {prev} > fallback {fb.replicas}"
        return fb.replicas, f"currentReplicasIfHigher: current {prev} <= fallback {fb.replicas}"
    if behavior == "currentReplicasIfLower":
        if prev < fb.replicas:
            return prev, f"currentReplicasIfLower: current {prev} < fallback {fb.replicas}"
        return fb.replicas, f"currentReplicasIfLower: current {prev} >= fallback {fb.replicas}"
    return fb.replicas, "static"


def _blind(spec: ScaledObjectSpec, state: PolicyState, bounds: _Bounds, now: float) -> tuple[int, Mode, str]:
    """No fresh demand: hold (never down), or the fallback count once enough intervals were missed."""
    prev = state.desired
    since = state.last_fresh_at if state.last_fresh_at is not None else state.started_at
    stale_s = max(now - since, 0.0)
    missed = math.floor(stale_s / spec.advanced.stale_after_seconds + _ROUNDING)
    fallback = spec.fallback
    what = "no fresh metrics since restart" if state.last_fresh_at is None else "metrics stale"
    # KEDA's rule (pkg/fallback): NumberOfFailures > FailureThreshold. A failure is a missed interval, as KEDA's
    # is a failed poll one polling period after the last good one: threshold N tolerates N, 0 none.
    if fallback is not None and missed > fallback.failure_threshold:
        count, how = _fallback_count(spec, prev)
        desired = min(max(count, bounds.min), bounds.max)
        return (
            desired,
            "fallback",
            (
                f"fallback {desired} ({how}): {what} {_n(stale_s)} s, {missed} missed intervals > failureThreshold "
                f"{fallback.failure_threshold}"
            ),
        )
    desired = bounds.clamp(prev)
    mode: Mode = "hold" if state.hold_replicas is not None else "stale"
    tolerated = (
        "" if fallback is None else f", {missed} missed intervals of failureThreshold {fallback.failure_threshold}"
    )
    return desired, mode, f"{what} {_n(stale_s)} s{tolerated}: holding {desired}"


def _fresh(
    spec: ScaledObjectSpec,
    pulse: detector.Pulse,
    rec: int,
    stabilised: int,
    state: PolicyState,
    bounds: _Bounds,
    last_active_at: float | None,
    activation: float,
    target: float,
    lead_s: float,
    now: float,
    cooling_s: float,
    windows: ScaleIn,
    needs: need.Need | None = None,
) -> tuple[int, Mode, str]:
    """Rules 3 to 5 on fresh demand. `cooling_s`: what is left of ``initialCooldownPeriod`` (<= 0: none); `needs`:
    what the rates say the load needs (None: the queue depth's forecast decides)."""
    prev = state.desired
    demand = pulse.current if pulse.current is not None else 0.0
    if bounds.idle_capable and not pulse.panic:
        if prev <= bounds.idle and demand <= activation:
            return bounds.idle, "idle", f"idle at {bounds.idle}: demand {_n(demand)} <= activation {_n(activation)}"
        # Only while inactive now: with a cooldownPeriod of 0 the time since the last activity is 0 >= 0 even under
        # demand, and the count would flap between idle and active on every decision.
        inactive = demand <= activation
        if prev > bounds.idle and inactive and (last_active_at is None or now - last_active_at >= spec.cooldown_period):
            if cooling_s <= 0:
                return (
                    bounds.idle,
                    "idle",
                    f"idle {prev} -> {bounds.idle}: no demand above {_n(activation)} for {_n(spec.cooldown_period)} s",
                )
            desired, mode, reason = _scale(
                spec, pulse, rec, stabilised, state, bounds, activation, target, lead_s, now, windows, needs
            )
            return desired, mode, f"{reason}; idle at {bounds.idle} in {_n(cooling_s)} s (initialCooldownPeriod)"
    return _scale(spec, pulse, rec, stabilised, state, bounds, activation, target, lead_s, now, windows, needs)


def _scale(
    spec: ScaledObjectSpec,
    pulse: detector.Pulse,
    rec: int,
    stabilised: int,
    state: PolicyState,
    bounds: _Bounds,
    activation: float,
    target: float,
    lead_s: float,
    now: float,
    windows: ScaleIn,
    needs: need.Need | None = None,
) -> tuple[int, Mode, str]:
    """Rules 4 and 5: panic, or the normal recommendation with its stabilisation and rate limit."""
    adv = spec.advanced
    prev = state.desired
    demand = pulse.current if pulse.current is not None else 0.0
    forecast = pulse.forecast_demand if pulse.forecast_demand is not None else demand
    want = floor = prev
    mode: Mode = "normal"
    if pulse.panic:
        raw, mode = max(prev, rec), "panic"
    elif rec >= prev:
        raw = rec
    else:
        want = min(prev, stabilised)
        if needs is not None:
            want = min(prev, max(want, math.ceil(needs.high - need.TOLERANCE)))  # the rate may be that high yet
        floor = _rate_floor(prev, state, spec, windows, now)
        if needs is not None and any(now - ts < _step_gap_s(windows) for ts, _ in state.scale_downs):
            # On rates the window's highest recommendation falls a replica at a time as a pulse's recommendations
            # leave it: one step per stabilisation window (or period), not one per decision.
            floor = prev
        raw = max(want, floor)
    desired = min(max(raw, bounds.active_floor), bounds.max)
    note = f" (bounds {bounds.active_floor}..{bounds.max})" if desired != raw else ""
    per_target = f"forecast {_n(forecast)} / target {_n(target)}"
    if needs is not None:
        backlog = f" + backlog {_n(needs.backlog)} (+{_n(needs.drain_replicas)})" if needs.backlog > 0 else ""
        per_target = f"need {_n(needs.arrival_rate)} req/s x {needs.service_s:.2g} s / target {_n(target)}{backlog}"

    if mode == "panic":
        peak = pulse.panic_demand if pulse.panic_demand is not None else demand
        if not pulse.panic_condition:
            last = state.pulse.panic_condition_at
            quiet_s = now - last if last is not None else 0.0
            why = f"panic: holding, {_n(max(windows.calm_s - quiet_s, 0.0))} s until calm"
        elif pulse.capacity > 0:
            why = f"panic: demand {_n(peak)} >= {_n(adv.panic_threshold)} x capacity {_n(pulse.capacity)}"
        else:
            why = f"panic: demand {_n(peak)} > {_n(activation)} with nothing ready"
        said = f"; {per_target}" if needs is not None else ""
        return desired, mode, f"{why} -> {desired}{note}{said}"
    if desired > prev:
        ahead = per_target if needs is not None else f"forecast {_n(forecast)} in {_n(lead_s)} s / target {_n(target)}"
        return desired, mode, f"up {prev} -> {desired}: {ahead}{note}"
    if desired < prev:
        limited = ", rate-limited" if floor > want else ""
        return desired, mode, f"down {prev} -> {desired}: {per_target}{limited}{note}"
    if note or rec >= prev:
        return desired, mode, f"steady at {prev}: {per_target}{note}"
    if want >= prev:
        stab = _n(windows.hold_s)
        return desired, mode, f"steady at {prev}: stabilising, max {stabilised} over {stab} s (now {rec})"
    if adv.scale_down_select_policy == "Disabled":
        return desired, mode, f"steady at {prev}: scale-down disabled (scaleDownSelectPolicy), policy wants {want}"
    return desired, mode, f"steady at {prev}: scale-down rate {_rate_text(spec, windows)} used"


def cooling_s(spec: ScaledObjectSpec, state: PolicyState, created_at: float | None, now: float) -> float:
    """Seconds of ``initialCooldownPeriod`` still to run (<= 0: over). While it runs, a decision's reason may count
    it down, so no decision repeats the last (`ModelDecider.settled`)."""
    if spec.initial_cooldown_period <= 0:
        return 0.0
    since = created_at if created_at is not None and math.isfinite(created_at) else state.started_at
    return since + spec.initial_cooldown_period - now


def _one_way(
    obs: Observation, prev: int, desired: int, mode: Mode, reason: str, bounds: _Bounds
) -> tuple[int, Mode, str]:
    """KEDA's ``paused-scale-in``/``paused-scale-out``: hold the current count against the direction paused. The
    bounds still apply (a lowered max, a raised min), as an HPA applies them before its behavior."""
    if obs.paused_scale_in and desired < prev:
        held, what = bounds.clamp(prev), "scale-in"
    elif obs.paused_scale_out and desired > prev:
        held, what = bounds.clamp(prev), "scale-out"
    else:
        return desired, mode, reason
    if held == desired:
        return desired, mode, reason  # the bounds alone moved it
    return held, "paused", f"paused {what}: holding {held} (policy wants {desired}: {reason})"


def decide(spec: ScaledObjectSpec, obs: Observation, state: PolicyState, now: float) -> tuple[Decision, PolicyState]:
    """One scaling decision for one model at `now`; see the module docstring for the rules and their order."""
    adv = spec.advanced
    bounds = _bounds(spec)
    target, activation = _trigger(spec)
    prev = state.desired
    demand = _clean(obs.demand)
    lead_s = obs.lead_time_s
    if lead_s is None or not math.isfinite(lead_s) or lead_s <= 0:
        lead_s = adv.lead_time_seconds
    windows = scale_in(spec, lead_s)  # the whole lead time: a cold path's minutes make bringing one back dear
    # The slope is fitted on one panic window of history; extrapolating it much further is guessing (a cold start's
    # minutes-long claim -> ready time would turn noise into dozens of replicas).
    lead_s = min(lead_s, max(adv.panic_window_seconds, adv.lead_time_seconds))
    pulse, pulse_state = detector.observe(
        _config(spec, target, activation, windows),
        state.pulse,
        now=now,
        demand=demand,
        ready=max(obs.ready, 0),
        lead_time_s=lead_s,
    )

    first_ts = pulse_state.window.first_ts
    hold = _hold_after(spec, state.hold_replicas, pulse_state.window, now)

    recs = state.recommendations
    flat = state.flat
    if recs.span_s != _span_s(spec):
        recs = _recommendation_window(spec).record(now, prev)  # the spec's window changed: start from the count
        flat = None
    last_fresh_at, last_active_at = state.last_fresh_at, state.last_active_at
    need_state, last_rec, last_held, lows = state.need, state.rec, state.held, state.lows

    if demand is None:
        desired, mode, reason = _blind(spec, state, bounds, now)
        # Recorded as a recommendation so that, when metrics return, the count held blind is only left after a
        # stabilisation window of fresh data (KEDA's fallback reaches HPA's window the same way).
        recs = recs.record(now, desired)
        flat = _flat_after(flat, None, desired, now)
    else:
        last_fresh_at = now
        if demand > activation:
            last_active_at = now
        forecast = pulse.forecast_demand if pulse.forecast_demand is not None else demand
        peak = pulse.panic_demand if pulse.panic and pulse.panic_demand is not None else 0.0
        need_cfg = need.config(spec, target)
        need_state = _record_need(need_cfg, need_state, obs, demand, now, pulse.panic_condition)
        needs = (
            need.estimate(
                need_cfg,
                need_state,
                now=now,
                queued=min(_clean(obs.queued) or 0.0, demand),
                lead_s=lead_s,
                demand=demand,
            )
            if need_state is not None
            else None
        )
        if needs is not None:
            # Little's law on the arrivals, the backlog that capacity in flight leaves: not the queue's depth.
            rec = max(math.ceil(needs.replicas - need.TOLERANCE), 0)
        elif need_state is not None:
            # Rates but no service time yet (from idle, nothing has completed): the demand's mean (its peak in
            # panic). Its trend over a lead time would count the backlog of the first seconds, before anything
            # could complete, as need.
            level = pulse.stable_demand if pulse.stable_demand is not None else demand
            rec = _replicas(max(level, peak), target)
        else:
            rec = _replicas(max(forecast, peak), target)
        last_rec = last_held = rec
        if needs is not None:
            # The stabilisation window holds the count the rate's upper bound may need: scale-in waits until the
            # rate could not have been that high for a whole window (at one instant, a steady 18 req/s read over
            # 6 s dipped low enough once a minute, and 5 replicas went to 4 at 4.5 replicas' work).
            last_held = max(rec, math.ceil(needs.high - need.TOLERANCE))
        recs = recs.record(now, last_held)
        up_to = rec
        if needs is not None:
            lows = (lows or _lows_window(spec)).record(now, -rec)
            if not pulse.panic:
                # A rise outside panic is believed once it held a panic window: a rate's 2-sigma minute on a small
                # model would add a replica and take it back a stabilisation window later.
                up_to = min(rec, int(-(lows.peak(now, adv.panic_window_seconds) or -rec)))
        flat = _flat_after(flat, demand, rec, now)
        stab_s = windows.hold_s
        stabilised = recs.peak(now, stab_s) if stab_s > 0 else None
        desired, mode, reason = _fresh(
            spec,
            pulse,
            up_to,
            rec if stabilised is None else max(int(stabilised), rec),
            state,
            bounds,
            last_active_at,
            activation,
            target,
            lead_s,
            now,
            cooling_s(spec, state, obs.created_at, now),
            windows,
            needs,
        )
        if hold is not None and desired < hold:
            floor = bounds.clamp(hold)  # the count at restart may itself be outside the (new) bounds
            seen_s = now - (first_ts if first_ts is not None else now)
            reason = (
                f"hold {floor} after restart: {_n(seen_s)} of {_n(adv.stable_window_seconds)} s window seen"
                f" (policy: {desired})"
            )
            desired, mode = floor, "hold"

    if obs.scheduled_floor is not None and desired < min(obs.scheduled_floor, bounds.max):
        # A scheduled warm-up (the article's pre-event prewarm, KEDA's cron scaler) raises the floor, blind too.
        floor = min(obs.scheduled_floor, bounds.max)
        reason = f"scheduled warm-up: floor {floor} (policy: {desired})"
        desired, mode = floor, "scheduled"

    if obs.paused_scale_in or obs.paused_scale_out:
        desired, mode, reason = _one_way(obs, prev, desired, mode, reason, bounds)

    override = obs.override
    if pulse.panic or override is not None:
        flat = None  # panic is left on a timer; an override's reason changes when it goes
    overridden = override is not None and _live(override, now)
    if override is not None:
        if overridden:
            desired, mode, reason = _apply_override(override, prev, bounds, now)
        else:
            reason = f"{_describe(override)} expired, policy resumed: {reason}"

    period_s = windows.period_s
    scale_downs = tuple(entry for entry in state.scale_downs if now - entry[0] < _step_gap_s(windows))
    scale_ups = tuple(entry for entry in state.scale_ups if now - entry[0] < period_s)
    # Only the policy's own steps, as HPA stores only its own rescales: an on-call override's count is the person's
    # (as a `kubectl scale` is to an HPA), and the policy resumes from it with a fresh period start.
    if not overridden and desired < prev:
        scale_downs += ((now, prev - desired),)
    elif not overridden and desired > prev:
        scale_ups += ((now, desired - prev),)

    decision = Decision(
        desired=desired,
        reason=reason,
        panic=pulse.panic,
        mode=mode,
        forecast_demand=pulse.forecast_demand,
        stable_demand=pulse.stable_demand,
        panic_demand=pulse.panic_demand,
    )
    new_state = PolicyState(
        desired=desired,
        mode=mode,
        started_at=state.started_at,
        hold_replicas=hold,
        pulse=pulse_state,
        recommendations=recs,
        scale_downs=scale_downs,
        scale_ups=scale_ups,
        last_fresh_at=last_fresh_at,
        last_active_at=last_active_at,
        flat=flat,
        need=need_state,
        rec=last_rec,
        held=last_held,
        lows=lows,
    )
    return decision, new_state


_UNRECORDED: Final = Flat(demand=None, rec=-1, demand_since=None)
"""`PolicyState.flat` before the first decision: nothing recorded yet."""


def _flat_after(flat: Flat | None, demand: float | None, rec: int, now: float) -> Flat | None:
    """`flat` after a decision records `demand` (None: blind, nothing in the pulse window) and `rec`."""
    if flat is None:
        return None
    if flat is _UNRECORDED:
        return Flat(demand, rec, now if demand is not None else None)
    if rec != flat.rec:
        return None
    if flat.demand is None:
        # Blind until now, nothing in the pulse window: a first fresh demand starts it.
        return flat if demand is None else Flat(demand, rec, now)
    if demand != flat.demand:
        return None  # a new value, or blind after fresh data (the pulse window keeps the old one)
    return flat


# --- when time alone can change a decision (housekeeping skips a model otherwise) --------------------------------


def settle_s(spec: ScaledObjectSpec) -> float:
    """Seconds after the last change of a model's demand (or its spec) past which a decision on the same demand,
    ready count and lead time repeats the previous one exactly, as far as the windows go: the trend is fitted over
    a panic window, the mean over the stable window, panic is left a stable window after its condition, the
    recommendations of the panic window's forecast are stabilised over the scale-down window, and the rate limit
    remembers a period of steps. Summed, not maxed: each starts when the one before has settled. Two buckets of
    slack for keys that round either way."""
    adv = spec.advanced
    # Unset windows at their longest (`scale_in` at a lead time of AUTO_HOLD_MAX_S or more): settling later is safe.
    longest = scale_in(spec, AUTO_HOLD_MAX_S)
    return (
        adv.stable_window_seconds + adv.panic_window_seconds + longest.hold_s + longest.period_s + 2 * detector.BUCKET_S
    )


def _hold_after(spec: ScaledObjectSpec, hold: int | None, window: detector.TimeWindow, now: float) -> int | None:
    """The restart hold at `now`: gone once a full stable window of demand was seen since the restart (the
    policy's own view takes over)."""
    first_ts = window.first_ts
    if hold is not None and first_ts is not None and now - first_ts >= spec.advanced.stable_window_seconds:
        return None
    return hold


def trend_settle_s(spec: ScaledObjectSpec) -> float:
    """Seconds of decisions on one unchanged demand, from its first (`Flat.demand_since`), past which the next
    repeats the last exactly when the windows never held another value (`PolicyState.flat`): the trend's fit needs
    points all along its panic window before its forecast is the demand itself. Two buckets of slack, as
    `settle_s`."""
    return spec.advanced.panic_window_seconds + 2 * detector.BUCKET_S


def flat_settled(spec: ScaledObjectSpec, state: PolicyState, decided_at: float) -> bool:
    """The windows held one demand and one recommendation since the start, and the decision at `decided_at` saw
    them past `trend_settle_s`: deciding again on the same inputs repeats it (`ModelDecider.settled`)."""
    flat = state.flat
    # (`_UNRECORDED`, before any decision, has no `demand_since` either.)
    return flat is not None and flat.demand_since is not None and decided_at >= flat.demand_since + trend_settle_s(spec)


def time_events(
    spec: ScaledObjectSpec, state: PolicyState, created_at: float | None, demand: float
) -> tuple[float, ...]:
    """Times at which a decision on the unchanged fresh `demand` may change by time alone, beside the windows
    (`settle_s`): the idle drop (``cooldownPeriod`` after the last activity, while inactive above the idle count)
    and the end of ``initialCooldownPeriod`` (whose reason counts it down). The fallback and an override's expiry
    are the caller's to rule out."""
    out: list[float] = []
    _, activation = _trigger(spec)
    if state.last_active_at is not None and demand <= activation and state.desired > _bounds(spec).idle:
        out.append(state.last_active_at + spec.cooldown_period)
    if spec.initial_cooldown_period > 0:
        since = created_at if created_at is not None and math.isfinite(created_at) else state.started_at
        out.append(since + spec.initial_cooldown_period)
    return tuple(out)


def repeat(
    spec: ScaledObjectSpec,
    state: PolicyState,
    decision: Decision,
    now: float,
    demand: float,
    *,
    queued: float | None = None,
    arrival_rate: float | None = None,
    completion_rate: float | None = None,
) -> PolicyState:
    """The state `decide` leaves when, at `now`, it repeats `decision` (its last) on the same fresh `demand` (and
    the same rates), no panic, no binding hold and no scale step in the period (see `settle_s`): the demand, the
    rates and the recommendation recorded in the windows (a few microseconds; the reads, the trend and the rules
    are what is skipped), and the times of the last fresh and the last active demand moved on, as each decision
    moves them."""
    target, activation = _trigger(spec)
    pulse = state.pulse
    window = pulse.window.record(now, demand)
    ready = state.need.ready if state.need is not None else 0  # `settled` held it: the same ready count
    obs = Observation(demand, ready, queued=queued, arrival_rate=arrival_rate, completion_rate=completion_rate)
    return dataclasses.replace(
        state,
        pulse=detector.PulseState(window, pulse.panic, pulse.panic_since, pulse.panic_condition_at),
        hold_replicas=_hold_after(spec, state.hold_replicas, window, now),  # a hold of 0 may be repeated
        recommendations=state.recommendations.record(now, state.held),
        last_fresh_at=now,
        last_active_at=state.last_active_at if demand <= activation else now,
        need=_record_need(need.config(spec, target), state.need, obs, demand, now),
        lows=state.lows.record(now, -state.rec) if state.lows is not None else None,
    )
