"""Pinning tests for the scaling policy's details that the table tests leave loose (mutation survivors).

Fixed inputs, hand-computed expectations: the need recorded from an observation, the state a decision carries
forward (flat, rec/held, scale-up/-down bookkeeping), the scheduled floor, `cooling_s`, and each branch of
`_scale`, `_fresh` and `_flat_after` at and either side of its boundaries. No reason text is asserted.
"""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest

from autoscaler.decide import detector, need
from autoscaler.decide.policy import (
    _UNRECORDED,
    _flat_after,
    _fresh,
    _lows_window,
    _recommendation_window,
    _replicas,
    _scale,
    cooling_s,
    decide,
    initial_state,
    record_need,
)
from autoscaler.decide.policyspec import PolicySpec
from autoscaler.decide.policystate import Bounds, Flat, Observation, PolicyState
from autoscaler.decide.scalein import AUTO_HOLD_MAX_S, scale_in, step_gap_s
from tests.autoscaler.test_policy import auto_spec, make_spec
from warmpool.protocol import Override, Trigger, TriggerMetadata

T0 = 1_700_000_000.0
KEDA = make_spec()  # target 4, activation 0, min 1 / max 50, stabilisation 60 s, 50 % per 60 s, panic 2x
SPEC = PolicySpec.of(KEDA)
CFG = need.config(KEDA, 4.0)


def _pulse(current: float | None = 4.0, *, panic: bool = False) -> detector.Pulse:
    return detector.Pulse(
        fresh=True,
        current=current,
        stable_demand=current,
        panic_demand=current,
        forecast_demand=current,
        slope_per_s=0.0,
        capacity=20.0,
        panic=panic,
        panic_condition=panic,
        entered_panic=False,
        left_panic=False,
    )


def _need(high: float) -> need.Need:
    return need.Need(replicas=1.0, arrival_rate=1.0, service_s=1.0, backlog=0.0, drain_replicas=0.0, high=high)


def _state(spec=SPEC, desired: int = 5, **kw) -> PolicyState:  # type: ignore[no-untyped-def]
    return dataclasses.replace(initial_state(spec, now=T0, current_replicas=desired), **kw)


# --- record_need -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lam", "mu"), [(None, 10.0), (10.0, None), (None, None), (math.nan, 10.0)])
def test_record_need_keeps_the_state_unless_both_rates_are_known(lam: float | None, mu: float | None) -> None:
    before = need.initial(CFG)
    obs = Observation(demand=8.0, ready=2, arrival_rate=lam, completion_rate=mu)
    assert record_need(CFG, before, obs, 8.0, T0) is before
    assert record_need(CFG, None, obs, 8.0, T0) is None


def test_record_need_passes_ready_queued_and_surge_to_the_need() -> None:
    obs = Observation(demand=8.0, ready=3, queued=2.0, arrival_rate=10.0, completion_rate=9.0)
    got = record_need(CFG, None, obs, 8.0, T0)
    assert got is not None
    assert got.ready == 3  # obs.ready reaches need.record
    assert got.saturated_since == T0  # queued 2 > 0: every slot busy from now
    assert got.surge_since is None  # surge defaults to False
    assert got.recorded_at == T0
    assert got.in_flight.mean(T0, 6.0) == pytest.approx(6.0)  # demand 8 less queued 2
    assert got.arrivals.mean(T0, 6.0) == pytest.approx(10.0)
    assert got.completions.mean(T0, 6.0) == pytest.approx(9.0)
    surged = record_need(CFG, None, obs, 8.0, T0, True)
    assert surged is not None and surged.surge_since == T0
    # Nothing ready (or a negative count) records 0 ready; queued is capped at the demand (in flight 0).
    none_ready = record_need(CFG, None, dataclasses.replace(obs, ready=-1, queued=50.0), 8.0, T0)
    assert none_ready is not None and none_ready.ready == 0
    assert none_ready.in_flight.mean(T0, 6.0) == pytest.approx(0.0)
    # No queue: not saturated.
    unqueued = record_need(CFG, None, dataclasses.replace(obs, queued=None), 8.0, T0)
    assert unqueued is not None and unqueued.saturated_since is None
    assert unqueued.in_flight.mean(T0, 6.0) == pytest.approx(8.0)


# --- small helpers ------------------------------------------------------------------------------------------------


def test_lows_window_keeps_the_lowest_recommendation_of_a_bucket() -> None:
    lows = _lows_window(SPEC).record(T0, -3).record(T0, -5)  # two decisions in one bucket: recs 3 then 5
    assert lows.peak(T0, 6.0) == -3  # "max" of the negated recs: the lowest rec, not the last one
    assert lows.span_s == KEDA.advanced.panic_window_seconds


def test_replicas_rounds_up_and_zero_demand_needs_none() -> None:
    assert _replicas(0.0, 4.0) == 0
    assert _replicas(8.0 + 1e-12, 4.0) == 2
    assert _replicas(8.1, 4.0) == 3


def test_initial_state_holds_the_current_count_with_nothing_recorded() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=3)
    assert (st.desired, st.mode, st.started_at, st.hold_replicas, st.last_active_at) == (3, "hold", T0, 3, T0)
    assert st.flat is _UNRECORDED and st.flat == Flat(None, -1, None)
    idle = initial_state(PolicySpec.of(make_spec(min_replica_count=0)), now=T0, current_replicas=-2)
    assert (idle.desired, idle.hold_replicas, idle.last_active_at) == (0, 0, None)


def test_cooling_s_counts_down_from_creation_or_from_the_start() -> None:
    st = _state()
    assert cooling_s(SPEC, st, T0 - 100.0, T0 + 5.0) == 0.0  # no initialCooldownPeriod
    one = PolicySpec.of(make_spec(initial_cooldown_period=1.0))
    assert cooling_s(one, st, T0 - 0.25, T0 + 0.5) == pytest.approx(0.25)  # created 0.25 s before the start
    assert cooling_s(one, st, None, T0 + 0.5) == pytest.approx(0.5)  # unknown: since started_at
    assert cooling_s(one, st, math.nan, T0 + 0.5) == pytest.approx(0.5)
    assert cooling_s(one, st, math.inf, T0 + 2.0) == pytest.approx(-1.0)


# --- _flat_after ---------------------------------------------------------------------------------------------------


def test_flat_after_every_branch() -> None:
    assert _flat_after(None, 8.0, 2, T0) is None
    assert _flat_after(_UNRECORDED, 8.0, 2, T0) == Flat(8.0, 2, T0)  # first fresh decision: dated now
    assert _flat_after(_UNRECORDED, None, 2, T0) == Flat(None, 2, None)  # first blind one: no demand, no date
    blind = Flat(None, 2, None)
    assert _flat_after(blind, None, 2, T0) is blind  # still blind, same count
    assert _flat_after(blind, 8.0, 2, T0) == Flat(8.0, 2, T0)  # fresh demand starts it
    assert _flat_after(blind, None, 3, T0) is None  # the count changed
    fresh = Flat(8.0, 2, T0 - 1.0)
    assert _flat_after(fresh, 8.0, 2, T0) is fresh  # the same again: kept, with its first date
    assert _flat_after(fresh, 8.0, 3, T0) is None
    assert _flat_after(fresh, 9.0, 2, T0) is None
    assert _flat_after(fresh, None, 2, T0) is None  # blind after fresh data


# --- _scale and _fresh ---------------------------------------------------------------------------------------------


def _call_scale(state: PolicyState, now: float, needs: need.Need | None, rec: int = 1, stabilised: int = 1):  # type: ignore[no-untyped-def]
    windows = scale_in(KEDA, 2.0)
    return _scale(SPEC, _pulse(), rec, stabilised, state, 2.0, now, windows, needs)[:2]


def test_scale_down_on_rates_holds_what_the_rates_upper_bound_may_need() -> None:
    now = T0 + 1000.0
    st = _state(desired=5)
    # From 5, 50 % per period keeps int(2.5) = 2; the rates' upper bound 3.0 needs ceil(3.0 - 0.1) = 3 > 2.
    assert _call_scale(st, now, _need(3.0)) == (3, "normal")
    assert _call_scale(st, now, _need(3.2)) == (4, "normal")  # ceil(3.1)
    assert _call_scale(st, now, None) == (2, "normal")  # no rates: the rate limit alone
    assert _call_scale(st, now, _need(9.0)) == (5, "normal")  # never above the current count
    assert _call_scale(st, now, _need(3.0), rec=5) == (5, "normal")  # rec == prev: steady
    assert _call_scale(st, now, _need(3.0), rec=7) == (7, "normal")  # up at once


def test_scale_on_rates_waits_a_step_gap_after_a_step_down() -> None:
    now = T0 + 1000.0
    gap = step_gap_s(scale_in(KEDA, 2.0))
    assert gap == 60.0
    # A step exactly one gap ago no longer blocks (nor counts in the 60 s period): 50 % of 5 keeps 2, need 3.
    assert _call_scale(_state(scale_downs=((now - gap, 1),)), now, _need(3.0)) == (3, "normal")
    # Within the gap: no step at all on rates.
    assert _call_scale(_state(scale_downs=((now - gap + 0.5, 1),)), now, _need(3.0)) == (5, "normal")


def test_scale_in_panic_never_goes_down() -> None:
    windows = scale_in(KEDA, 2.0)
    got = _scale(SPEC, _pulse(40.0, panic=True), 3, 3, _state(), 2.0, T0, windows)
    assert got[:2] == (5, "panic")


def _call_fresh(spec, state: PolicyState, pulse: detector.Pulse, cooling: float, needs: need.Need | None):  # type: ignore[no-untyped-def]
    windows = scale_in(spec.keda, 2.0)
    return _fresh(spec, pulse, 1, 1, state, None, 2.0, T0 + 1000.0, cooling, windows, needs)[:2]


def test_fresh_idle_and_the_initial_cooldown() -> None:
    spec = PolicySpec.of(make_spec(min_replica_count=0))
    # At idle with no current reading: demand 0 <= activation 0, stays idle.
    assert _call_fresh(spec, _state(spec, desired=0), _pulse(None), 0.0, None) == (0, "idle")
    assert _call_fresh(spec, _state(spec, desired=0), _pulse(0.0), 0.0, None) == (0, "idle")
    # Active, inactive since forever, the initial cooldown over (0 s left): drop to idle.
    assert _call_fresh(spec, _state(spec, desired=5), _pulse(0.0), 0.0, _need(3.0)) == (0, "idle")
    # 0.5 s of initialCooldownPeriod left: the normal rules with the rates (50 % keeps 2, the upper bound 3).
    assert _call_fresh(spec, _state(spec, desired=5), _pulse(0.0), 0.5, _need(3.0)) == (3, "normal")
    assert _call_fresh(spec, _state(spec, desired=5), _pulse(0.0), 0.5, None) == (2, "normal")


# --- decide: the state carried forward ----------------------------------------------------------------------------


def test_a_fresh_decision_records_flat_rec_held_and_mode() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=2)
    now = T0 + 0.1
    decision, new = decide(SPEC, Observation(demand=8.0, ready=2), st, now)
    # ceil(8 / 4) = 2 = the count held at restart: normal, steady.
    assert (decision.desired, decision.mode, decision.panic) == (2, "normal", False)
    assert (new.desired, new.mode, new.rec, new.held) == (2, "normal", 2, 2)
    assert new.flat == Flat(8.0, 2, now)
    assert (new.scale_ups, new.scale_downs) == ((), ())  # a steady decision is no step
    assert (new.last_fresh_at, new.last_active_at) == (now, now)
    # The same again keeps the flat record with its first date.
    _, again = decide(SPEC, Observation(demand=8.0, ready=2), new, now + 0.1)
    assert again.flat == Flat(8.0, 2, now)


def test_a_blind_decision_records_its_count_as_flat() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=2)
    decision, new = decide(SPEC, Observation(demand=None, ready=2), st, T0 + 0.1)
    assert decision.desired == 2
    assert new.flat == Flat(None, 2, None)


def test_an_override_or_panic_clears_flat() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=2)
    obs = Observation(demand=8.0, ready=2, override=Override(kind="scale", replicas=4, expires_at=T0 + 100.0))
    decision, new = decide(SPEC, obs, st, T0 + 0.1)
    assert (decision.desired, decision.mode) == (4, "override")
    assert new.flat is None
    assert new.scale_ups == ()  # the person's step, not the policy's
    _, panicked = decide(SPEC, Observation(demand=40.0, ready=2), st, T0 + 0.1)
    assert panicked.panic and panicked.flat is None


def test_steps_are_kept_for_a_period_and_added_up() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=1)
    now = T0 + 100.0
    # A step up 30 s ago (kept), one up and one down exactly a period (60 s) ago (both dropped).
    st = dataclasses.replace(st, scale_ups=((now - 30.0, 1), (now - 60.0, 2)), scale_downs=((now - 60.0, 1),))
    decision, new = decide(SPEC, Observation(demand=8.0, ready=1), st, now)
    assert decision.desired == 2  # 8 / 4, up from 1
    assert new.scale_ups == ((now - 30.0, 1), (now, 1))
    assert new.scale_downs == ()
    _, steady = decide(SPEC, Observation(demand=8.0, ready=2), new, now + 0.1)
    assert steady.scale_ups == ((now - 30.0, 1), (now, 1))  # no (now, 0) for a steady decision


# --- decide: scheduled warm-up and paused scale-in -----------------------------------------------------------------


def test_a_scheduled_floor_raises_the_count_up_to_the_max() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=2)
    obs = Observation(demand=8.0, ready=2, scheduled_floor=3)
    decision, new = decide(SPEC, obs, st, T0 + 0.1)
    assert (decision.desired, decision.mode, new.mode) == (3, "scheduled", "scheduled")
    assert isinstance(decision.reason, str) and decision.reason
    assert new.scale_ups == ((T0 + 0.1, 1),)
    # At the floor already: the policy's own decision.
    at = decide(SPEC, dataclasses.replace(obs, scheduled_floor=2), st, T0 + 0.1)[0]
    assert (at.desired, at.mode) == (2, "normal")
    # Above maxReplicaCount: the max.
    top = decide(SPEC, dataclasses.replace(obs, scheduled_floor=80), st, T0 + 0.1)[0]
    assert (top.desired, top.mode) == (50, "scheduled")


def test_paused_scale_in_keeps_the_mode_and_reason_when_it_does_not_bind() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=2)
    decision, new = decide(SPEC, Observation(demand=16.0, ready=4, paused_scale_in=True), st, T0 + 0.1)
    # 16 / 4 = 4 up from 2 (16 < 2 x 4 ready x 4: no panic); paused-scale-in allows a rise as it is.
    assert (decision.desired, decision.mode, new.mode) == (4, "normal", "normal")
    assert isinstance(decision.reason, str) and decision.reason


# --- decide: rates ---------------------------------------------------------------------------------------------------


def test_a_surge_reaches_the_need_state() -> None:
    st = initial_state(SPEC, now=T0, current_replicas=2)
    # 24 >= 2 x 2 ready x 4: the panic condition holds, so the need dates a surge from now.
    obs = Observation(demand=24.0, ready=2, arrival_rate=10.0, completion_rate=10.0)
    _, new = decide(SPEC, obs, st, T0 + 0.1)
    assert new.need is not None and new.need.surge_since == T0 + 0.1
    _, calm = decide(SPEC, dataclasses.replace(obs, demand=8.0), st, T0 + 0.1)
    assert calm.need is not None and calm.need.surge_since is None


def test_created_at_reaches_the_initial_cooldown() -> None:
    spec = PolicySpec.of(make_spec(min_replica_count=0, initial_cooldown_period=60.0, cooldown_period=0.0))
    st = dataclasses.replace(initial_state(spec, now=T0, current_replicas=3), hold_replicas=None)  # no restart hold
    obs = Observation(demand=0.0, ready=3, created_at=T0 - 120.0)
    # Created two minutes ago: the initial cooldown is over, no demand, cooldown 0: idle at once.
    d, _ = decide(spec, obs, st, T0 + 0.1)
    assert (d.desired, d.mode) == (0, "idle")
    # Unknown creation: counted from the start, 59.9 s to go: the normal rules, 50 % of 3 keeps int(1.5) = 1.
    d2, _ = decide(spec, dataclasses.replace(obs, created_at=None), st, T0 + 0.1)
    assert (d2.desired, d2.mode) == (1, "normal")


# --- PolicySpec.of ---------------------------------------------------------------------------------------------------


def test_policy_spec_resolves_the_scaled_object_once() -> None:
    """Bounds, the smallest target and activation over the triggers, the detector's and the need's windows: what
    `decide` used to derive from KEDA's wire type on every call."""
    second = Trigger(
        type="gateway-queue", metadata=TriggerMetadata(model="llm", target_queue_depth=3.0, activation_queue_depth=7.0)
    )
    keda = make_spec(
        target=5.0, activation=2.0, min_replica_count=0, idle_replica_count=None, max_replica_count=9,
        advanced={"stable_window_seconds": 30.0, "panic_window_seconds": 3.0, "panic_threshold": 1.5,
                  "stale_after_seconds": 2.5},
    )  # fmt: skip
    keda = msgspec.structs.replace(keda, triggers=[*keda.triggers, second])
    spec = PolicySpec.of(keda)
    assert spec.keda is keda
    assert (spec.target, spec.activation) == (3.0, 2.0)
    assert spec.bounds == Bounds(min=0, max=9, idle=0, active_floor=1)
    assert spec.detector == detector.DetectorConfig(
        stable_window_s=30.0, panic_window_s=3.0, panic_threshold=1.5, target_queue_depth=3.0,
        activation_queue_depth=2.0, carry_s=2.5, calm_s=None,
    )  # fmt: skip
    assert spec.need == need.NeedConfig(rate_window_s=3.0, service_window_s=30.0, target=3.0, carry_s=2.5)
    assert spec.span_s == 60.0  # SET's stabilisation window
    assert PolicySpec.of(auto_spec()).span_s == AUTO_HOLD_MAX_S


# --- _scale's reasons: what events, status and logs show on-call ---------------------------------------------------


def _reading(current: float, forecast: float, *, panic: bool = False, condition: bool = True, peak: float = 40.0,
             capacity: float = 20.0) -> detector.Pulse:  # fmt: skip
    return detector.Pulse(
        fresh=True, current=current, stable_demand=current, panic_demand=peak, forecast_demand=forecast,
        slope_per_s=0.0, capacity=capacity, panic=panic, panic_condition=condition, entered_panic=False,
        left_panic=False,
    )  # fmt: skip


RATES = need.Need(replicas=7.0, arrival_rate=12.5, service_s=1.5, backlog=3.0, drain_replicas=0.5, high=7.0)


@pytest.mark.parametrize(
    ("desired", "rec", "stabilised", "reading", "needs", "want"),
    [
        (2, 7, 7, _reading(10.0, 26.0), None, (7, "normal", "up 2 -> 7: forecast 26 in 2 s / target 4")),
        (2, 7, 7, _reading(10.0, 26.0), RATES,
         (7, "normal", "up 2 -> 7: need 12.5 req/s x 1.5 s / target 4 + backlog 3 (+0.5)")),
        (2, 7, 7, _reading(10.0, 26.0), dataclasses.replace(RATES, backlog=0.0),
         (7, "normal", "up 2 -> 7: need 12.5 req/s x 1.5 s / target 4")),
        (2, 70, 70, _reading(10.0, 26.0), None,
         (50, "normal", "up 2 -> 50: forecast 26 in 2 s / target 4 (bounds 1..50)")),
        (2, 7, 7, _reading(10.0, None), None, (7, "normal", "up 2 -> 7: forecast 10 in 2 s / target 4")),  # type: ignore[arg-type]
        (5, 1, 1, _reading(3.0, 3.5), None, (2, "normal", "down 5 -> 2: forecast 3.5 / target 4, rate-limited")),
        (5, 5, 5, _reading(19.0, 20.0), None, (5, "normal", "steady at 5: forecast 20 / target 4")),
        (5, 1, 5, _reading(3.0, 3.5), None, (5, "normal", "steady at 5: stabilising, max 5 over 60 s (now 1)")),
        (5, 10, 10, _reading(40.0, 41.0, panic=True), None,
         (10, "panic", "panic: demand 40 >= 2 x capacity 20 -> 10")),
        (5, 10, 10, _reading(40.0, 41.0, panic=True, capacity=0.0), None,
         (10, "panic", "panic: demand 40 > 0 with nothing ready -> 10")),
        (5, 10, 10, _reading(40.0, 41.0, panic=True), RATES,
         (10, "panic",
          "panic: demand 40 >= 2 x capacity 20 -> 10; need 12.5 req/s x 1.5 s / target 4 + backlog 3 (+0.5)")),
    ],
)  # fmt: skip
def test_scale_says_why(
    desired: int, rec: int, stabilised: int, reading: detector.Pulse, needs: need.Need | None,
    want: tuple[int, str, str],
) -> None:  # fmt: skip
    """Each outcome of rules 4 and 5 with its reason, the figures in it as the decision saw them."""
    now = T0 + 1000.0
    got = _scale(SPEC, reading, rec, stabilised, _state(desired=desired), 2.0, now, scale_in(KEDA, 2.0), needs)
    assert got == want


def test_scale_says_when_panic_will_be_left() -> None:
    """Panic held after its condition: the seconds to calm count from when the condition last held."""
    now = T0 + 1000.0
    st = _state(desired=5)
    st = dataclasses.replace(st, pulse=dataclasses.replace(st.pulse, panic_condition_at=now - 10.0))
    got = _scale(SPEC, _reading(3.0, 3.0, panic=True, condition=False), 1, 1, st, 2.0, now, scale_in(KEDA, 2.0))
    assert got == (5, "panic", "panic: holding, 50 s until calm -> 5")
    never = dataclasses.replace(st, pulse=dataclasses.replace(st.pulse, panic_condition_at=None))
    got = _scale(SPEC, _reading(3.0, 3.0, panic=True, condition=False), 1, 1, never, 2.0, now, scale_in(KEDA, 2.0))
    assert got == (5, "panic", "panic: holding, 60 s until calm -> 5")


def test_scale_says_which_scale_down_rule_holds_the_count() -> None:
    """Steady above the recommendation: scale-down disabled, or the period's steps used up."""
    now = T0 + 1000.0
    disabled = PolicySpec.of(make_spec(advanced={"scale_down_select_policy": "Disabled"}))
    got = _scale(disabled, _reading(3.0, 3.5), 1, 1, _state(desired=5), 2.0, now, scale_in(disabled.keda, 2.0))
    assert got == (5, "normal", "steady at 5: scale-down disabled (scaleDownSelectPolicy), policy wants 1")
    used = _state(desired=5, scale_downs=((now - 10.0, 6),))  # the period started at 11: 50 % keeps 5
    got = _scale(SPEC, _reading(3.0, 3.5), 1, 1, used, 2.0, now, scale_in(KEDA, 2.0))
    assert got == (5, "normal", "steady at 5: scale-down rate 50 %/60 s used")


def test_fresh_says_when_the_initial_cooldown_lets_the_idle_drop_happen() -> None:
    """Inactive past cooldownPeriod but inside initialCooldownPeriod: the normal rules, and how long until idle."""
    spec = PolicySpec.of(make_spec(min_replica_count=0))
    got = _fresh(spec, _reading(0.0, 0.0), 0, 0, _state(spec, desired=5), None, 2.0, T0 + 1000.0, 0.5,
                 scale_in(spec.keda, 2.0))  # fmt: skip
    why = "down 5 -> 2: forecast 0 / target 4, rate-limited; idle at 0 in 0.5 s (initialCooldownPeriod)"
    assert got == (2, "normal", why)


def test_the_restart_hold_says_how_much_of_the_window_was_seen() -> None:
    """After a restart the count held is a floor until a stable window of demand was seen; the reason says how
    much was, and what the policy wanted (from 5, the rate limit's 2)."""
    st = initial_state(SPEC, now=T0, current_replicas=5)
    _, st = decide(SPEC, Observation(demand=4.0, ready=5), st, T0 + 1.0)
    d, _ = decide(SPEC, Observation(demand=4.0, ready=5), st, T0 + 13.5)
    assert (d.desired, d.mode, d.reason) == (5, "hold", "hold 5 after restart: 12.5 of 60 s window seen (policy: 2)")


def test_scale_reasons_at_their_edges() -> None:
    """The figures a reason quotes where the reading lacks one (no current demand: 0; no panic peak: the demand), a
    backlog under one request, panic's calm already past, capacity under one, and a step down within the rate."""
    now, windows = T0 + 1000.0, scale_in(KEDA, 2.0)

    def why(desired: int, rec: int, stabilised: int, reading: detector.Pulse, needs: need.Need | None = None,
            state: PolicyState | None = None) -> tuple[int, str, str]:  # fmt: skip
        return _scale(SPEC, reading, rec, stabilised, state or _state(desired=desired), 2.0, now, windows, needs)

    blank = dataclasses.replace(_reading(0.0, 0.0), current=None, forecast_demand=None)
    assert why(2, 7, 7, blank) == (7, "normal", "up 2 -> 7: forecast 0 in 2 s / target 4")
    small = dataclasses.replace(RATES, backlog=0.5, drain_replicas=0.25)
    assert why(2, 7, 7, _reading(10.0, 26.0), small)[2] == (
        "up 2 -> 7: need 12.5 req/s x 1.5 s / target 4 + backlog 0.5 (+0.2)"
    )
    no_peak = dataclasses.replace(_reading(40.0, 41.0, panic=True), panic_demand=None)
    assert why(5, 10, 10, no_peak)[2] == "panic: demand 40 >= 2 x capacity 20 -> 10"
    assert why(5, 10, 10, _reading(40.0, 41.0, panic=True, peak=50.0))[2] == (
        "panic: demand 50 >= 2 x capacity 20 -> 10"
    )
    assert why(5, 10, 10, _reading(40.0, 41.0, panic=True, capacity=0.5))[2] == (
        "panic: demand 40 >= 2 x capacity 0.5 -> 10"
    )
    st = _state(desired=5)
    calm_past = dataclasses.replace(st, pulse=dataclasses.replace(st.pulse, panic_condition_at=now - 70.0))
    assert why(5, 1, 1, _reading(3.0, 3.0, panic=True, condition=False), state=calm_past)[2] == (
        "panic: holding, 0 s until calm -> 5"
    )
    # Down within the rate: 50 % of 5 keeps 2, the recommendation 3 is above it; of 4 keeps 2, the same as asked.
    assert why(5, 3, 3, _reading(11.0, 11.0)) == (3, "normal", "down 5 -> 3: forecast 11 / target 4")
    assert why(4, 2, 2, _reading(7.0, 7.0)) == (2, "normal", "down 4 -> 2: forecast 7 / target 4")


def _learnt(arrivals: float = 10.0, in_flight: float = 20.0, seconds: float = 20.0) -> tuple[PolicyState, float]:
    """A state that learnt a service time: `arrivals` req/s arriving and completing with `in_flight` in flight
    (Little: in flight / rate = 2 s by default), 5 ready, decided every 0.1 s; and the time of its last decision."""
    st = initial_state(SPEC, now=T0, current_replicas=5)
    now = T0
    for _ in range(round(seconds * 10)):
        now += 0.1
        obs = Observation(demand=in_flight, ready=5, lead_time_s=0.5, queued=0.0, arrival_rate=arrivals,
                          completion_rate=arrivals)  # fmt: skip
        _, st = decide(SPEC, obs, st, now)
    return st, now


def test_a_load_that_stopped_recommends_nothing_on_rates() -> None:
    """Rates fallen to zero for a panic window: the recommendation and what the stabilisation window holds are
    0 (the bounds keep the count), not one replica rounded up from nothing."""
    st, now = _learnt()
    assert st.need is not None and st.need.service_s == pytest.approx(2.0)
    for _ in range(80):
        now += 0.1
        obs = Observation(demand=0.0, ready=5, lead_time_s=0.5, queued=0.0, arrival_rate=0.0, completion_rate=0.0)
        _, st = decide(SPEC, obs, st, now)
    assert (st.rec, st.held) == (0, 0)


def test_the_need_on_rates_is_bounded_by_the_demand_there_is() -> None:
    """A rate of 5 replicas' work, but only 2 requests are there now: what exists when the capacity lands (the
    demand and the lead time's arrivals) bounds the recommendation, and the reason names no backlog."""
    st, now = _learnt()
    d, st = decide(SPEC, Observation(demand=2.0, ready=5, lead_time_s=0.1, queued=0.0, arrival_rate=10.0,
                                     completion_rate=10.0), st, now + 0.1)  # fmt: skip
    assert st.rec == 1  # (2 + at most 10 req/s x 0.1 s) / 4 <= 0.75; unbounded, ~7.4 req/s x 2 s / 4 = 3.7
    assert "backlog" not in d.reason and d.reason.startswith("steady at 5: stabilising"), d.reason


def test_rates_without_a_service_time_recommend_on_the_stable_mean() -> None:
    """From idle nothing has completed yet: the recommendation is the stable window's mean demand (its peak in
    panic), not the current demand, whose rise is the backlog of the first seconds."""
    st = initial_state(SPEC, now=T0, current_replicas=20)
    now = T0
    for _ in range(50):
        now += 0.1
        obs = Observation(demand=4.0, ready=20, lead_time_s=0.5, queued=4.0, arrival_rate=5.0, completion_rate=0.0)
        _, st = decide(SPEC, obs, st, now)
    d, st = decide(SPEC, Observation(demand=40.0, ready=20, lead_time_s=0.5, queued=40.0, arrival_rate=5.0,
                                     completion_rate=0.0), st, now + 0.1)  # fmt: skip
    assert not d.panic and st.need is not None and st.need.service_s is None
    assert d.stable_demand is not None and d.stable_demand < 10.0
    assert st.rec == math.ceil(d.stable_demand / 4.0 - 1e-9) < 10


def test_fresh_in_the_initial_cooldown_runs_the_normal_rules_with_their_lead_time_and_clock() -> None:
    """Inactive inside initialCooldownPeriod: `_scale` runs as outside it, with the lead time (an up step's reason
    quotes it) and the clock (the period's steps are counted from now)."""
    spec = PolicySpec.of(make_spec(min_replica_count=0))
    now = T0 + 1000.0
    up = _fresh(spec, _reading(0.0, 0.0), 7, 7, _state(spec, desired=5), None, 2.0, now, 0.5, scale_in(spec.keda, 2.0))
    assert up == (7, "normal", "up 5 -> 7: forecast 0 in 2 s / target 4; idle at 0 in 0.5 s (initialCooldownPeriod)")
    stepped = _state(spec, desired=5, scale_downs=((now - 10.0, 1),))  # the period began at 6: 50 % keeps 3
    down = _fresh(spec, _reading(0.0, 0.0), 0, 0, stepped, None, 2.0, now, 0.5, scale_in(spec.keda, 2.0))
    assert down[:2] == (3, "normal")


def test_a_rise_outside_panic_waits_for_the_lowest_recommendation_of_the_panic_window() -> None:
    """On rates, outside panic, the count goes up only to the lowest recommendation of the last panic window (its
    negated peak in `lows`): one replica's recommendation a second ago holds a count of 1 where the rates now ask
    for more; the decision records the new one, and the window still says 1."""
    st, now = _learnt()
    assert st.rec >= 3  # ~7.4 req/s x 2 s / 4 target
    lows = _lows_window(SPEC).record(now - 1.0, -1)
    recs = _recommendation_window(SPEC)
    low = dataclasses.replace(st, desired=1, lows=lows, recommendations=recs, hold_replicas=None)
    d, after = decide(SPEC, Observation(demand=20.0, ready=5, lead_time_s=0.5, queued=0.0, arrival_rate=10.0,
                                        completion_rate=10.0), low, now + 0.1)  # fmt: skip
    assert (d.desired, d.mode) == (1, "normal")
    assert d.reason.startswith("steady at 1: need "), d.reason
    assert after.lows is not None and after.lows.peak(now + 0.1, 6.0) == -1
