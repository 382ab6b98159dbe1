"""When time alone can change a policy decision: the decider skips a model until then, and repeats its last one.

`PolicySpec.settle_s` and `PolicySpec.trend_settle_s` (`autoscaler.decide.policyspec`) say when a decision on
unchanged inputs repeats the last one as far as the windows go, `flat_settled` when one flat since the start does,
`time_events` the times at which time alone changes it (the idle drop, the end of ``initialCooldownPeriod``), and
`repeat` the state `autoscaler.decide.policy.decide` would leave when it repeats its last decision, without running
it (`autoscaler.decide.decider.ModelDecider.settled`). Pure.
"""

from __future__ import annotations

import dataclasses
import math

from autoscaler.decide import detector, policy
from autoscaler.decide.policy import PolicySpec
from autoscaler.decide.policystate import Decision, Observation, PolicyState

__all__ = ["flat_settled", "repeat", "time_events"]


def flat_settled(spec: PolicySpec, state: PolicyState, decided_at: float) -> bool:
    """The windows held one demand and one recommendation since the start, and the decision at `decided_at` saw
    them past `trend_settle_s`: deciding again on the same inputs repeats it (`ModelDecider.settled`)."""
    flat = state.flat
    # (`policy.initial_state`'s, before any decision, has no `demand_since` either.)
    return flat is not None and flat.demand_since is not None and decided_at >= flat.demand_since + spec.trend_settle_s


def time_events(spec: PolicySpec, state: PolicyState, created_at: float | None, demand: float) -> tuple[float, ...]:
    """Times at which a decision on the unchanged fresh `demand` may change by time alone, beside the windows
    (`settle_s`): the idle drop (``cooldownPeriod`` after the last activity, while inactive above the idle count)
    and the end of ``initialCooldownPeriod`` (whose reason counts it down). The fallback and an override's expiry
    are the caller's to rule out."""
    out: list[float] = []
    keda = spec.keda
    if state.last_active_at is not None and demand <= spec.activation and state.desired > spec.bounds.idle:
        out.append(state.last_active_at + keda.cooldown_period)
    if keda.initial_cooldown_period > 0:
        since = created_at if created_at is not None and math.isfinite(created_at) else state.started_at
        out.append(since + keda.initial_cooldown_period)
    return tuple(out)


def repeat(
    spec: PolicySpec,
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
    pulse = state.pulse
    window = pulse.window.record(now, demand)
    ready = state.need.ready if state.need is not None else 0  # `settled` held it: the same ready count
    obs = Observation(demand, ready, queued=queued, arrival_rate=arrival_rate, completion_rate=completion_rate)
    return dataclasses.replace(
        state,
        pulse=detector.PulseState(window, pulse.panic, pulse.panic_since, pulse.panic_condition_at),
        hold_replicas=policy.hold_after(spec, state.hold_replicas, window, now),  # a hold of 0 may be repeated
        recommendations=state.recommendations.record(now, state.held),
        last_fresh_at=now,
        last_active_at=state.last_active_at if demand <= spec.activation else now,
        need=policy.record_need(spec.need, state.need, obs, demand, now),
        lows=state.lows.record(now, -state.rec) if state.lows is not None else None,
    )
