"""`autoscaler.decide.settling` on a hand clock: when a decision repeats the last, and what repeating it leaves.

The decider skips a model whose decision would repeat (`ModelDecider.settled`) and brings its state up to date with
`settling.repeat`; a wrong sum or a missed event there is a model left unscaled, so each is pinned here by value,
and `repeat` against what `policy.decide` itself leaves.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from autoscaler.decide import detector, policy, settling
from autoscaler.decide.policyspec import PolicySpec
from autoscaler.decide.policystate import Flat
from tests.autoscaler.test_policy import T0, auto_spec, make_spec
from warmpool.protocol import ScaledObjectSpec

BUCKET = detector.BUCKET_S


def test_settle_s_sums_the_windows_in_force_at_their_longest() -> None:
    windows = {"scale_down_stabilization_seconds": 20.0, "scale_down_period_seconds": 15.0}
    spec = make_spec(advanced={"stable_window_seconds": 30.0, "panic_window_seconds": 3.0, **windows})
    assert PolicySpec.of(spec).settle_s == pytest.approx(30.0 + 3.0 + 20.0 + 15.0 + 2 * BUCKET)
    # Unset (revision 9): the hold is at most 60 s, and so is its period; panic's calm is within the stable window.
    assert PolicySpec.of(auto_spec()).settle_s == pytest.approx(60.0 + 6.0 + 60.0 + 60.0 + 2 * BUCKET)
    # A set window with the period unset: revision 8's 60 s period.
    only_window = make_spec(windows={"scale_down_stabilization_seconds": 5.0})
    assert PolicySpec.of(only_window).settle_s == pytest.approx(60.0 + 6.0 + 5.0 + 60.0 + 2 * BUCKET)


def test_trend_settle_s_is_a_panic_window_and_two_buckets() -> None:
    spec = make_spec(advanced={"panic_window_seconds": 4.0})
    assert PolicySpec.of(spec).trend_settle_s == pytest.approx(4.0 + 2 * BUCKET)


@pytest.mark.parametrize(
    ("flat", "decided_after", "settled"),
    [
        (None, 100.0, False),  # two decisions differed: only settle_s says
        (Flat(demand=None, rec=-1, demand_since=None), 100.0, False),  # nothing fresh yet
        (Flat(demand=8.0, rec=2, demand_since=T0), 6.0 + 2 * BUCKET - 0.01, False),
        (Flat(demand=8.0, rec=2, demand_since=T0), 6.0 + 2 * BUCKET, True),
        (Flat(demand=8.0, rec=2, demand_since=T0), 600.0, True),
    ],
)
def test_flat_settled_once_the_trend_window_saw_one_demand(
    flat: Flat | None, decided_after: float, settled: bool
) -> None:
    spec = PolicySpec.of(make_spec())
    state = dataclasses.replace(policy.initial_state(spec, now=T0, current_replicas=2), flat=flat)
    assert settling.flat_settled(spec, state, T0 + decided_after) is settled


def _state(spec_kw: dict[str, object], **fields: object) -> tuple[PolicySpec, policy.PolicyState]:
    spec = PolicySpec.of(make_spec(**spec_kw))
    return spec, dataclasses.replace(policy.initial_state(spec, now=T0, current_replicas=3), **fields)


def test_time_events_name_the_idle_drop_and_the_end_of_the_initial_cooldown() -> None:
    kw = {"min_replica_count": 0, "cooldown_period": 30, "activation": 1.0}
    spec, state = _state(kw, desired=3, last_active_at=T0 + 5.0)
    # Inactive (demand at the activation depth) above the idle count: the drop, cooldownPeriod after the activity.
    assert settling.time_events(spec, state, None, 1.0) == (T0 + 35.0,)
    # Active now, at the idle count, or never active: no drop to wait for.
    assert settling.time_events(spec, state, None, 1.5) == ()
    assert settling.time_events(spec, dataclasses.replace(state, desired=0), None, 0.0) == ()
    assert settling.time_events(spec, dataclasses.replace(state, last_active_at=None), None, 0.0) == ()
    # initialCooldownPeriod ends that long after the creation, or after the state's start when not known.
    spec, state = _state({"initial_cooldown_period": 40}, desired=3)
    assert settling.time_events(spec, state, T0 - 10.0, 9.0) == (T0 + 30.0,)
    assert settling.time_events(spec, state, None, 9.0) == (T0 + 40.0,)
    assert settling.time_events(spec, state, math.nan, 9.0) == (T0 + 40.0,)
    both_kw = {"min_replica_count": 0, "cooldown_period": 30, "initial_cooldown_period": 40}
    spec, state = _state(both_kw, desired=2, last_active_at=T0 + 1.0)
    assert settling.time_events(spec, state, None, 0.0) == (T0 + 31.0, T0 + 40.0)


@pytest.mark.parametrize("demand", [3.0, 4.0, 9.0])
@pytest.mark.parametrize("keda", [make_spec(activation=4.0), auto_spec(activation=4.0)], ids=["set", "unset"])
def test_repeat_leaves_what_deciding_again_leaves(keda: ScaledObjectSpec, demand: float) -> None:
    """A flat load with rates, decided to its settled state; then one more decision and `repeat` from the same
    state: the windows, the rates and the times each moves on are the same (below, at and above the activation)."""
    spec = PolicySpec.of(keda)
    state = policy.initial_state(spec, now=T0, current_replicas=3)
    now, decision = T0, None
    rate = demand / 2.0  # 2 s of service, all in flight
    for _ in range(1500):
        now += 0.1
        obs = policy.Observation(demand, 3, lead_time_s=0.1, queued=0.0, arrival_rate=rate, completion_rate=rate)
        decision, state = policy.decide(spec, obs, state, now)
    assert decision is not None and decision.mode == "normal"
    later = now + 0.1
    obs = policy.Observation(demand, 3, lead_time_s=0.1, queued=0.0, arrival_rate=rate, completion_rate=rate)
    again, decided = policy.decide(spec, obs, state, later)
    assert again.desired == decision.desired
    repeated = settling.repeat(spec, state, decision, later, demand, queued=0.0, arrival_rate=rate,
                               completion_rate=rate)  # fmt: skip
    assert repeated.last_fresh_at == decided.last_fresh_at == later
    assert repeated.last_active_at == decided.last_active_at
    assert repeated.hold_replicas == decided.hold_replicas
    assert repeated.desired == decided.desired and repeated.rec == decided.rec and repeated.held == decided.held
    for span in (BUCKET / 2, 0.5, 6.0, 60.0):  # the newest bucket alone, then wider
        assert repeated.pulse.window.mean(later, span) == pytest.approx(decided.pulse.window.mean(later, span))
        assert repeated.recommendations.peak(later, span) == decided.recommendations.peak(later, span)
    assert repeated.lows is not None and decided.lows is not None
    assert repeated.lows.peak(later, 6.0) == decided.lows.peak(later, 6.0)
    assert repeated.need is not None and decided.need is not None
    assert repeated.need.service_s == pytest.approx(decided.need.service_s)
    assert repeated.need.arrivals.mean(later, 6.0) == pytest.approx(decided.need.arrivals.mean(later, 6.0))
    assert repeated.need.completions.mean(later, 6.0) == pytest.approx(decided.need.completions.mean(later, 6.0))


def test_a_one_second_initial_cooldown_is_a_time_event_too() -> None:
    spec, state = _state({"initial_cooldown_period": 1}, desired=3)
    assert settling.time_events(spec, state, T0 - 0.5, 9.0) == (T0 + 0.5,)


def test_repeat_carries_the_panic_times_the_hold_and_the_lows_by_value() -> None:
    """Fixed values: the panic window's times kept, the restart hold kept while the stable window is not yet seen
    and dropped once it is, the lows window recording the last recommendation, and no rates' ready count from a
    state that had none (0, not 1)."""
    spec = PolicySpec.of(make_spec())  # stable window 60 s
    base = policy.initial_state(spec, now=T0, current_replicas=3)
    window = base.pulse.window.record(T0 + 1.0, 8.0)  # demand seen since T0 + 1
    lows = policy._lows_window(spec).record(T0 + 1.0, -5)
    state = dataclasses.replace(
        base,
        pulse=detector.PulseState(window, panic=True, panic_since=T0 + 1.5, panic_condition_at=T0 + 2.0),
        hold_replicas=3, rec=2, held=2, lows=lows, need=None,
    )  # fmt: skip
    decision = policy.Decision(desired=3, reason="", panic=True, mode="panic")
    soon = settling.repeat(spec, state, decision, T0 + 10.0, 8.0, queued=0.0, arrival_rate=4.0, completion_rate=4.0)
    assert (soon.pulse.panic, soon.pulse.panic_since, soon.pulse.panic_condition_at) == (True, T0 + 1.5, T0 + 2.0)
    assert soon.hold_replicas == 3  # 9 s of the 60 s window seen
    assert soon.lows is not None and soon.lows.peak(T0 + 10.0, 6.0) == -2  # the last recommendation, the lowest now
    assert soon.need is not None and soon.need.ready == 0
    later = settling.repeat(spec, state, decision, T0 + 61.0, 8.0)
    assert later.hold_replicas is None  # a whole stable window seen: the hold is gone
