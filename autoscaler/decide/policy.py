"""The scaling policy: ``decide(spec, observation, state, now) -> (decision, state)``.

Pure, as DESIGN.md "Scaling policy" asks: no I/O, no clock (``now`` is an argument), frozen inputs and outputs.
`spec` is a `PolicySpec` (`autoscaler.decide.policyspec`): the ScaledObject resolved once when it changes, as
Knative's ``DeciderSpec``, so a decision derives nothing from KEDA's wire type.
The controller calls `decide` on every (debounced) sample of a model and acts on `Decision.desired`; the
`Decision.reason` goes to events, status and logs as it is.
Its terms (`Observation`, `PolicyState`, `Decision`, the bounds) are in `autoscaler.decide.policystate`; rules 1 and 2
and KEDA's pause annotations in `autoscaler.decide.holds`; the scale-in windows and the HPA rate limit in
`autoscaler.decide.scalein`; when time alone changes a decision (what the decider may skip) in
`autoscaler.decide.settling`.

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
from typing import Final

from autoscaler.decide import detector, need
from autoscaler.decide.holds import apply_override, blind, describe, live, one_way
from autoscaler.decide.policyspec import PolicySpec
from autoscaler.decide.policystate import (
    ROUNDING,
    Decision,
    Flat,
    Mode,
    Observation,
    PolicyState,
    clean,
)
from autoscaler.decide.policystate import (
    number_text as _n,
)
from autoscaler.decide.scalein import ScaleIn, rate_floor, rate_text, scale_in, step_gap_s
from warmpool.protocol import Override

__all__ = [
    "Decision",
    "Mode",
    "Observation",
    "Override",
    "PolicySpec",
    "PolicyState",
    "cooling_s",
    "decide",
    "hold_after",
    "initial_state",
    "record_need",
]


def record_need(
    cfg: need.NeedConfig,
    state: need.NeedState | None,
    obs: Observation,
    demand: float,
    now: float,
    surge: bool = False,
) -> need.NeedState | None:
    """The rates of `obs` recorded (None kept while no decision had them)."""
    lam, mu = clean(obs.arrival_rate), clean(obs.completion_rate)
    if lam is None or mu is None:
        return state
    queued = min(clean(obs.queued) or 0.0, demand)
    return need.record(
        cfg, state or need.initial(cfg), now=now, arrival_rate=lam, completion_rate=mu, in_flight=demand - queued,
        ready=max(obs.ready, 0), queued=queued, surge=surge,
    )  # fmt: skip


def _lows_window(spec: PolicySpec) -> detector.TimeWindow:
    return detector.TimeWindow.empty(spec.detector.panic_window_s, combine="max")


def _recommendation_window(spec: PolicySpec) -> detector.TimeWindow:
    return detector.TimeWindow.empty(spec.span_s, combine="max")


def _replicas(demand: float, target: float) -> int:
    return max(math.ceil(demand / target - ROUNDING), 0)


def initial_state(spec: PolicySpec, *, now: float, current_replicas: int) -> PolicyState:
    """State for a model seen for the first time, or after a restart or leader failover: the current count is held
    (scale-ups allowed) until a stable window of demand has been seen (Knative's restart rule)."""
    current = max(current_replicas, 0)
    return PolicyState(
        desired=current,
        mode="hold",
        started_at=now,
        hold_replicas=current,
        pulse=detector.initial(spec.detector),
        recommendations=_recommendation_window(spec),
        last_active_at=now if current > spec.bounds.idle else None,
        flat=_UNRECORDED,
    )


def _fresh(
    spec: PolicySpec,
    pulse: detector.Pulse,
    rec: int,
    stabilised: int,
    state: PolicyState,
    last_active_at: float | None,
    lead_s: float,
    now: float,
    cooling_s: float,
    windows: ScaleIn,
    needs: need.Need | None = None,
) -> tuple[int, Mode, str]:
    """Rules 3 to 5 on fresh demand. `cooling_s`: what is left of ``initialCooldownPeriod`` (<= 0: none); `needs`:
    what the rates say the load needs (None: the queue depth's forecast decides)."""
    prev, bounds, activation, cooldown = state.desired, spec.bounds, spec.activation, spec.keda.cooldown_period
    demand = pulse.current if pulse.current is not None else 0.0
    if bounds.idle_capable and not pulse.panic:
        if prev <= bounds.idle and demand <= activation:
            return bounds.idle, "idle", f"idle at {bounds.idle}: demand {_n(demand)} <= activation {_n(activation)}"
        # Only while inactive now: with a cooldownPeriod of 0 the time since the last activity is 0 >= 0 even under
        # demand, and the count would flap between idle and active on every decision.
        inactive = demand <= activation
        if prev > bounds.idle and inactive and (last_active_at is None or now - last_active_at >= cooldown):
            if cooling_s <= 0:
                return (
                    bounds.idle,
                    "idle",
                    f"idle {prev} -> {bounds.idle}: no demand above {_n(activation)} for {_n(cooldown)} s",
                )
            desired, mode, reason = _scale(spec, pulse, rec, stabilised, state, lead_s, now, windows, needs)
            return desired, mode, f"{reason}; idle at {bounds.idle} in {_n(cooling_s)} s (initialCooldownPeriod)"
    return _scale(spec, pulse, rec, stabilised, state, lead_s, now, windows, needs)


def _scale(
    spec: PolicySpec,
    pulse: detector.Pulse,
    rec: int,
    stabilised: int,
    state: PolicyState,
    lead_s: float,
    now: float,
    windows: ScaleIn,
    needs: need.Need | None = None,
) -> tuple[int, Mode, str]:
    """Rules 4 and 5: panic, or the normal recommendation with its stabilisation and rate limit."""
    adv, bounds, target, activation = spec.keda.advanced, spec.bounds, spec.target, spec.activation
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
        floor = rate_floor(prev, state.scale_ups, state.scale_downs, spec.keda, windows, now)
        if needs is not None and any(now - ts < step_gap_s(windows) for ts, _ in state.scale_downs):
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
    return desired, mode, f"steady at {prev}: scale-down rate {rate_text(spec.keda, windows)} used"


def cooling_s(spec: PolicySpec, state: PolicyState, created_at: float | None, now: float) -> float:
    """Seconds of ``initialCooldownPeriod`` still to run (<= 0: over). While it runs, a decision's reason may count
    it down, so no decision repeats the last (`ModelDecider.settled`)."""
    period = spec.keda.initial_cooldown_period
    if period <= 0:
        return 0.0
    since = created_at if created_at is not None and math.isfinite(created_at) else state.started_at
    return since + period - now


def decide(spec: PolicySpec, obs: Observation, state: PolicyState, now: float) -> tuple[Decision, PolicyState]:
    """One scaling decision for one model at `now`; see the module docstring for the rules and their order."""
    adv = spec.keda.advanced
    bounds, target, activation = spec.bounds, spec.target, spec.activation
    prev = state.desired
    demand = clean(obs.demand)
    lead_s = obs.lead_time_s
    if lead_s is None or not math.isfinite(lead_s) or lead_s <= 0:
        lead_s = adv.lead_time_seconds
    windows = scale_in(spec.keda, lead_s)  # the whole lead time: a cold path's minutes make bringing one back dear
    # The slope is fitted on one panic window of history; extrapolating it much further is guessing (a cold start's
    # minutes-long claim -> ready time would turn noise into dozens of replicas).
    lead_s = min(lead_s, max(adv.panic_window_seconds, adv.lead_time_seconds))
    pulse, pulse_state = detector.observe(
        dataclasses.replace(spec.detector, calm_s=windows.calm_s),
        state.pulse,
        now=now,
        demand=demand,
        ready=max(obs.ready, 0),
        lead_time_s=lead_s,
    )

    first_ts = pulse_state.window.first_ts
    hold = hold_after(spec, state.hold_replicas, pulse_state.window, now)

    recs = state.recommendations
    flat = state.flat
    if recs.span_s != spec.span_s:
        recs = _recommendation_window(spec).record(now, prev)  # the spec's window changed: start from the count
        flat = None
    last_fresh_at, last_active_at = state.last_fresh_at, state.last_active_at
    need_state, last_rec, last_held, lows = state.need, state.rec, state.held, state.lows

    if demand is None:
        desired, mode, reason = blind(spec.keda, state, bounds, now)
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
        need_cfg = spec.need
        need_state = record_need(need_cfg, need_state, obs, demand, now, pulse.panic_condition)
        needs = (
            need.estimate(
                need_cfg,
                need_state,
                now=now,
                queued=min(clean(obs.queued) or 0.0, demand),
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
            last_active_at,
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
        desired, mode, reason = one_way(obs, prev, desired, mode, reason, bounds)

    override = obs.override
    if pulse.panic or override is not None:
        flat = None  # panic is left on a timer; an override's reason changes when it goes
    overridden = override is not None and live(override, now)
    if override is not None:
        if overridden:
            desired, mode, reason = apply_override(override, prev, bounds, now)
        else:
            reason = f"{describe(override)} expired, policy resumed: {reason}"

    period_s = windows.period_s
    scale_downs = tuple(entry for entry in state.scale_downs if now - entry[0] < step_gap_s(windows))
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


def hold_after(spec: PolicySpec, hold: int | None, window: detector.TimeWindow, now: float) -> int | None:
    """The restart hold at `now`: gone once a full stable window of demand was seen since the restart (the
    policy's own view takes over)."""
    first_ts = window.first_ts
    if hold is not None and first_ts is not None and now - first_ts >= spec.detector.stable_window_s:
        return None
    return hold
