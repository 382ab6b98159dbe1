"""The scaling policy as tables on a hand-advanced clock, in the manner of Knative's autoscaler_test.go.

Each scenario starts at T0 from `initial_state` and feeds rows: ``Row(dt, demand, ready, ...)`` is one sample
`dt` seconds after the previous one (``repeat=n``: n samples `dt` apart, checks on the last). A row checks only
what it names; ``spec=`` edits the ScaledObject live from that row on; ``paused_in``/``paused_out``/``created_at``
are the ScaledObject record's (KEDA's pause annotations, its creation time). Defaults: targetQueueDepth 4, panic at 2x,
windows 60 s / 6 s, stabilisation 60 s, 50 %/60 s: `make_spec` sets revision 8's stabilisation and period (`SET`),
since these tables are about the windows' mechanics; `auto_spec` leaves them unset (the scale-in hold from the lead
time, revision 9), as a ScaledObject that does not name them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import pytest

from autoscaler.decide.policy import Decision, Observation, Override, PolicySpec, PolicyState, decide, initial_state
from autoscaler.decide.scalein import scale_in
from tests.helpers import HandClock
from warmpool.protocol import Advanced, Fallback, ScaledObjectSpec, ScaleTargetRef, Trigger, TriggerMetadata

T0 = 1_700_000_000.0


SET: dict[str, Any] = {
    "scale_down_stabilization_seconds": 60.0,
    "scale_down_period_seconds": 60.0,
    "scale_down_percent": 50.0,
}
"""Revision 8's defaults, spelled out."""


def auto_spec(**kw: Any) -> ScaledObjectSpec:
    """`make_spec` with the stabilisation and the period unset (the ScaledObject's defaults since revision 9)."""
    return make_spec(windows={}, **kw)


def make_spec(
    *,
    target: float = 4.0,
    activation: float = 0.0,
    advanced: dict[str, Any] | None = None,
    fallback: tuple[int, int] | None = None,
    windows: dict[str, Any] = SET,
    **kw: Any,
) -> ScaledObjectSpec:
    kw.setdefault("min_replica_count", 1)
    kw.setdefault("max_replica_count", 50)
    return ScaledObjectSpec(
        scale_target_ref=ScaleTargetRef(name="llm"),
        triggers=[
            Trigger(
                type="gateway-queue",
                metadata=TriggerMetadata(model="llm", target_queue_depth=target, activation_queue_depth=activation),
            )
        ],
        fallback=None if fallback is None else Fallback(failure_threshold=fallback[0], replicas=fallback[1]),
        advanced=Advanced(**{**windows, **(advanced or {})}),
        **kw,
    )


@dataclass(frozen=True)
class Row:
    dt: float
    demand: float | None
    ready: int
    want: int | None = None
    mode: str | None = None
    panic: bool | None = None
    reason: str | None = None
    at_least: int | None = None
    repeat: int = 1
    override: Override | None = None
    lead_s: float | None = None
    spec: ScaledObjectSpec | None = None
    stable_demand: float | None = None
    panic_demand: float | None = None
    forecast: float | None = None
    paused_in: bool = False
    paused_out: bool = False
    created_at: float | None = None


def run(
    spec: ScaledObjectSpec, rows: list[Row], *, current: int = 1, state: PolicyState | None = None
) -> tuple[Decision, PolicyState]:
    clock = HandClock(T0)
    state = state or initial_state(PolicySpec.of(spec), now=T0, current_replicas=current)
    decision: Decision | None = None
    for i, row in enumerate(rows):
        spec = row.spec or spec
        terms = PolicySpec.of(spec)
        for _ in range(row.repeat):
            obs = Observation(
                demand=row.demand,
                ready=row.ready,
                lead_time_s=row.lead_s,
                override=row.override,
                paused_scale_in=row.paused_in,
                paused_scale_out=row.paused_out,
                created_at=row.created_at,
            )
            decision, state = decide(terms, obs, state, clock.advance(row.dt))
        assert decision is not None
        where = f"row {i} at +{clock.now - T0:.1f} s: {decision}"
        if row.want is not None:
            assert decision.desired == row.want, where
        if row.at_least is not None:
            assert decision.desired >= row.at_least, where
        if row.mode is not None:
            assert decision.mode == row.mode, where
        if row.panic is not None:
            assert decision.panic == row.panic, where
        if row.reason is not None:
            assert row.reason in decision.reason, where
        for name in ("stable_demand", "panic_demand"):
            if getattr(row, name) is not None:
                assert getattr(decision, name) == pytest.approx(getattr(row, name)), where
        if row.forecast is not None:
            assert decision.forecast_demand == pytest.approx(row.forecast, abs=0.05), where
    assert decision is not None and state is not None
    return decision, state


# Past the restart hold, steady at demand 8 on 2 ready replicas (capacity 8), desired 2.
SETTLED = Row(0.1, 8, 2, repeat=650, want=2, mode="normal", panic=False, reason="steady at 2")


def test_3x_pulse_in_one_sample_panics_and_scales_up_on_that_sample() -> None:
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.1, 24, 2, want=6, mode="panic", panic=True, reason="panic: demand 24 >= 2 x capacity 8 -> 6"),
        ],
    )


def test_3x_pulse_ramped_over_1s_panics_on_the_sample_that_crosses_2x() -> None:
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.2, 10, 2, panic=False),
            Row(0.2, 13, 2, panic=False),
            Row(0.2, 15.9, 2, panic=False),
            Row(0.2, 20, 2, panic=True, mode="panic", at_least=5),
            Row(0.2, 24, 2, panic=True, mode="panic", at_least=6),
        ],
    )


def test_no_scale_down_in_panic_and_leaving_it_after_a_stable_window() -> None:
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.1, 24, 2, want=6, panic=True),
            # The pulse is gone at once and the new replicas are ready: still no step down for a stable window.
            Row(0.1, 4, 6, repeat=595, want=6, panic=True, mode="panic", reason="s until calm"),
            # The condition last held at the pulse sample; one stable window later panic ends. Its recommendations
            # (the panic window's peak, 6 s of them) are still in the stabilisation window for a few seconds ...
            Row(0.1, 4, 6, repeat=10, want=6, panic=False, mode="normal", reason="stabilising, max 6"),
            # ... then the step down, rate-limited to 50 % of 6.
            Row(0.1, 4, 6, repeat=60, want=3, panic=False, mode="normal"),
        ],
    )


@pytest.mark.parametrize("lead_s", [0.1, 2.55, 30.0])
def test_unset_windows_hold_for_a_lead_time_then_scale_in_at_once(lead_s: float) -> None:
    """Revision 9: with the stabilisation unset, panic is left one hold (a lead time, at least a panic window)
    after its condition, the panic's recommendations are held one more hold, then the count goes to the need in
    one step (100 % per hold). Bringing a replica back costs a lead time; HPA's windows price minutes."""
    hold = max(lead_s, 6.0)
    steps = round(hold / 0.1)
    run(
        auto_spec(),
        [
            dataclasses.replace(SETTLED, lead_s=lead_s),
            Row(0.1, 24, 2, want=6, panic=True, lead_s=lead_s),
            Row(0.1, 4, 6, repeat=steps - 1, want=6, panic=True, reason="s until calm", lead_s=lead_s),
            Row(
                0.1,
                4,
                6,
                want=6,
                panic=False,
                mode="normal",
                reason=f"stabilising, max 6 over {hold:g} s",
                lead_s=lead_s,
            ),
            # The panic window's peak (24: 6 replicas) was recorded until it left that window, 6 s after the pulse.
            Row(0.1, 4, 6, repeat=56, want=6, panic=False, lead_s=lead_s),
            Row(0.1, 4, 6, repeat=4, want=1, mode="normal", lead_s=lead_s),  # in one step: 100 % per hold
        ],
    )


@pytest.mark.parametrize(
    ("advanced", "lead_s", "want"),
    [
        ({}, 0.1, (6.0, 6.0, 100.0, 6.0)),  # at least a panic window: a fall needs the evidence a rise needs
        ({}, 30.0, (30.0, 30.0, 100.0, 30.0)),
        ({}, 600.0, (60.0, 60.0, 100.0, 60.0)),  # a cold path's minutes hold no longer than revision 8's window
        ({"stable_window_seconds": 20.0}, 30.0, (30.0, 30.0, 100.0, 20.0)),  # panic is never held past it
        ({"scale_down_period_seconds": 15.0, "scale_down_percent": 25.0}, 0.1, (6.0, 15.0, 25.0, 6.0)),
        ({"scale_down_stabilization_seconds": 10.0}, 0.1, (10.0, 60.0, 50.0, 60.0)),  # set: revision 8's meaning
        ({"scale_down_stabilization_seconds": 0.0}, 30.0, (0.0, 60.0, 50.0, 60.0)),
    ],
)
def test_the_scale_in_windows_in_force(advanced: dict[str, float], lead_s: float, want: tuple[float, ...]) -> None:
    windows = scale_in(make_spec(windows={}, advanced=advanced), lead_s)
    assert (windows.hold_s, windows.period_s, windows.percent, windows.calm_s) == want
    assert windows.auto == ("scale_down_stabilization_seconds" not in advanced)


def test_panic_from_zero_ready() -> None:
    run(
        make_spec(min_replica_count=0),
        [
            Row(0.1, 0, 0, want=0, mode="idle", panic=False),
            Row(0.1, 3, 0, want=1, mode="panic", panic=True, reason="with nothing ready -> 1"),
            Row(0.1, 30, 0, want=8, mode="panic", panic=True),
        ],
        current=0,
    )


def test_activation_depth_gates_the_step_from_zero() -> None:
    run(
        make_spec(min_replica_count=0, activation=5),
        [
            Row(0.1, 3, 0, want=0, mode="idle", reason="idle at 0: demand 3 <= activation 5"),
            Row(10.0, 5, 0, want=0, mode="idle"),
            Row(0.1, 6, 0, want=2, mode="panic", panic=True),
        ],
        current=0,
    )


def test_idle_after_cooldown() -> None:
    spec = make_spec(min_replica_count=0, cooldown_period=30.0)
    run(
        spec,
        [
            SETTLED,
            # No demand: the stabilisation window (60 s) would hold 2 longer than the cooldown (30 s) ...
            Row(0.1, 0, 2, repeat=299, want=2, mode="normal", reason="stabilising"),
            # ... but going idle is not a policy step down: it is KEDA's cooldown, straight to the idle count.
            Row(0.1, 0, 2, want=0, mode="idle", reason="idle 2 -> 0: no demand above 0 for 30 s"),
            Row(5.0, 0, 0, want=0, mode="idle"),
            Row(0.1, 1, 0, want=1, mode="panic", panic=True),
        ],
    )


def test_idle_replica_count_below_min() -> None:
    spec = make_spec(min_replica_count=3, idle_replica_count=1, cooldown_period=10.0)
    run(
        spec,
        [
            Row(0.1, 8, 3, repeat=650, want=3, mode="normal", reason="steady at 3"),
            Row(0.1, 0, 3, repeat=99, want=3),
            Row(0.1, 0, 3, want=1, mode="idle"),
            # Waking from idle lands inside [min, max] at once.
            Row(0.1, 2, 1, want=3, mode="normal", reason="up 1 -> 3"),
        ],
    )


def test_stale_or_missing_gateways_never_scale_down() -> None:
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, None, 10, want=10, mode="stale", reason="metrics stale 0.1 s: holding 10"),
            Row(0.1, None, 10, repeat=600, want=10, mode="stale"),
            Row(0.1, float("nan"), 10, want=10, mode="stale"),
            Row(0.1, -3, 10, want=10, mode="stale"),
            # Fresh again, and low: what was held blind is left only after a stabilisation window of fresh data.
            Row(0.1, 4, 10, repeat=590, want=10, mode="normal", reason="stabilising"),
            Row(0.1, 4, 10, repeat=20, want=5),
        ],
    )


def test_stale_during_panic_keeps_panic_and_count() -> None:
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.1, 24, 2, want=6, panic=True),
            Row(0.1, None, 2, repeat=1000, want=6, panic=True, mode="stale"),
        ],
    )


def test_fallback_after_n_missed_intervals() -> None:
    spec = make_spec(fallback=(3, 7), advanced={"stale_after_seconds": 1.0})
    run(
        spec,
        [
            Row(0.1, 20, 5, repeat=650, want=5),
            Row(0.5, None, 5, want=5, mode="stale"),
            Row(2.4, None, 5, want=5, mode="stale"),  # 2.9 s: two intervals missed
            Row(0.1, None, 5, want=5, mode="stale", reason="3 missed intervals of failureThreshold 3"),  # tolerated
            Row(0.9, None, 5, want=5, mode="stale"),  # 3.9 s
            Row(
                0.1,
                None,
                5,
                want=7,
                mode="fallback",
                reason="fallback 7 (static): metrics stale 4 s, 4 missed intervals > failureThreshold 3",
            ),
            Row(30.0, None, 5, want=7, mode="fallback"),
            # Metrics back: the fallback count is left through the stabilisation window, like any other.
            Row(0.1, 20, 7, want=7, mode="normal", reason="stabilising"),
        ],
    )


def test_fallback_applies_to_a_lower_count_too() -> None:
    # KEDA's static fallback: the operator's explicit blind count, the one way stale metrics lower the count.
    run(make_spec(fallback=(2, 2)), [Row(0.1, 40, 10, repeat=650, want=10), Row(3.0, None, 10, want=2)])


def test_fallback_without_any_data_after_restart() -> None:
    run(
        make_spec(fallback=(3, 4)),
        [
            Row(1.0, None, 2, repeat=3, want=2, mode="hold", reason="no fresh metrics since restart"),
            Row(1.0, None, 2, want=4, mode="fallback"),
        ],
        current=2,
    )


def test_hold_after_restart_until_a_stable_window_has_data() -> None:
    run(
        make_spec(),
        [
            Row(0.1, 4, 10, want=10, mode="hold", reason="hold 10 after restart"),
            Row(0.1, 4, 10, repeat=590, want=10, mode="hold", reason="(policy: 5)"),
            # Scale-ups are not held back.
            Row(0.1, 48, 10, want=12, mode="normal"),
            Row(0.1, 4, 10, want=12, mode="normal", reason="stabilising"),
            # One stable window after the first sample the hold ends; the stabilisation window still holds 12.
            Row(0.1, 4, 10, repeat=20, mode="normal", panic=False, want=12),
        ],
        current=10,
    )


def test_hold_after_restart_then_policy_steps_down() -> None:
    run(
        make_spec(),
        [
            Row(0.1, 4, 10, repeat=599, want=10, mode="hold"),
            Row(0.1, 4, 10, repeat=2, want=5, mode="normal", reason="down 10 -> 5: forecast 4 / target 4, rate-"),
        ],
        current=10,
    )


def test_counter_reset_does_not_move_the_count() -> None:
    # A gateway restart: its queue reads 0 for a few samples (the policy reads demand levels, never rates).
    rows = [
        Row(0.1, 40, 10, repeat=650, want=10),
        Row(0.1, 0, 10, repeat=5, want=10, mode="normal"),
        Row(0.1, 0, 10, want=10),
        Row(0.1, 40, 10, want=10, panic=False),
    ]
    run(make_spec(), rows)


def test_scale_down_stabilisation_and_rate_limit() -> None:
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 8, 10, repeat=590, want=10, reason="steady at 10: stabilising, max 10 over 60 s (now 2)"),
            # The 10s leave the window over a few seconds as the trend falls: 10 -> 9 -> ... -> 5, where 50 % of
            # the count at the start of the period (10) is used up.
            Row(0.1, 8, 10, repeat=20, want=5, reason="steady at 5: scale-down rate 50 %/60 s used"),
            # A period later: int(5 x 50 %) = 2 (rounded down, as HPA's), which is the need, ceil(8 / 4).
            Row(0.1, 8, 5, repeat=600, want=2),
            Row(0.1, 8, 2, repeat=700, want=2),
        ],
    )


def test_scale_down_rate_removes_at_least_one() -> None:
    spec = make_spec(advanced={"scale_down_percent": 1.0, "scale_down_stabilization_seconds": 0.0})
    run(
        spec,
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 4, 10, repeat=70, want=9),  # 1 % of 10 rounds to nothing: one replica
            Row(10.0, 4, 9, want=9),
            Row(60.0, 4, 9, want=8, reason="down 9 -> 8: forecast 4 / target 4, rate-limited"),
        ],
    )


def settled_at(spec: ScaledObjectSpec, replicas: int) -> PolicyState:
    """A state holding `replicas` at T0 in normal mode, past the restart hold, with no scale step in the period."""
    return dataclasses.replace(
        initial_state(PolicySpec.of(spec), now=T0, current_replicas=replicas), hold_replicas=None, mode="normal"
    )


# HPA's Percent policy keeps int32(periodStartReplicas * (1 - value/100)): rounded down, so it keeps fewer than a
# ceiling would (kubernetes pkg/controller/podautoscaler/horizontal.go, calculateScaleDownLimitWithBehaviors).
@pytest.mark.parametrize(
    ("percent", "start", "keep"),
    [
        (25.0, 10, 7),  # 7.5
        (25.0, 7, 5),  # 5.25
        (50.0, 7, 3),  # 3.5
        (50.0, 3, 1),  # 1.5
        (10.0, 25, 22),  # 22.5
        (50.0, 10, 5),  # exact: no rounding
        (1.0, 10, 9),  # 9.9: rounding down still removes one
        (100.0, 10, 1),  # all of them, but the active floor keeps one
    ],
)
def test_scale_down_percent_rounds_the_kept_count_down_as_hpa(percent: float, start: int, keep: int) -> None:
    spec = make_spec(advanced={"scale_down_percent": percent, "scale_down_stabilization_seconds": 0.0})
    run(spec, [Row(0.1, 0, start, want=keep, reason=f"down {start} -> {keep}")], state=settled_at(spec, start))


def test_scale_ups_within_the_period_do_not_raise_the_period_start() -> None:
    # HPA: periodStartReplicas = currentReplicas - replicasAddedInCurrentPeriod + replicasDeletedInCurrentPeriod.
    # At 10, a raised minReplicaCount steps up to 14 (the policy's own step, as HPA's clamp to minReplicas is its
    # own rescale), then it is lowered again: the period began at 10, so 50 % keeps 5, not 7.
    spec = make_spec(advanced={"scale_down_stabilization_seconds": 0.0})
    raised = make_spec(min_replica_count=14, advanced={"scale_down_stabilization_seconds": 0.0})
    run(
        spec,
        [
            Row(0.1, 0, 10, spec=raised, want=14, reason="(bounds 14..50)"),
            Row(0.1, 0, 14, spec=spec, want=5, reason="down 14 -> 5: forecast 0 / target 4, rate-limited"),
        ],
        state=settled_at(spec, 10),
    )


def test_scale_ups_and_downs_within_the_period_both_count() -> None:
    # 10 -> 5 (50 %), up to 8 (minReplicaCount), then down again: the period still began at 10 (8 - 3 + 5).
    spec = make_spec(advanced={"scale_down_stabilization_seconds": 0.0})
    raised = make_spec(min_replica_count=8, advanced={"scale_down_stabilization_seconds": 0.0})
    run(
        spec,
        [
            Row(0.1, 0, 10, want=5),
            Row(0.1, 0, 5, spec=raised, want=8),
            Row(0.1, 0, 8, spec=spec, want=5, reason="rate-limited"),
            Row(0.1, 0, 5, repeat=10, want=5, reason="scale-down rate 50 %/60 s used"),
        ],
        state=settled_at(spec, 10),
    )


def test_a_scale_up_a_period_ago_no_longer_counts() -> None:
    # The step up at +0.1 s is exactly one scaleDownPeriodSeconds old at +60.1 s: the period starts at 14 then.
    spec = make_spec(advanced={"scale_down_stabilization_seconds": 0.0})
    raised = make_spec(min_replica_count=14, advanced={"scale_down_stabilization_seconds": 0.0})
    run(
        spec,
        [
            Row(0.1, 0, 10, spec=raised, want=14),
            Row(1.0, 0, 14, repeat=59, want=14),
            Row(1.0, 0, 14, spec=spec, want=7, reason="down 14 -> 7"),
        ],
        state=settled_at(spec, 10),
    )


def test_an_on_call_overrides_steps_are_not_the_policys() -> None:
    # As HPA counts only its own rescales (a `kubectl scale` is no scale event): after a `scale 14` override ends,
    # the period starts at 14 and 50 % keeps 7, where counting the override's step up would allow 5.
    spec = make_spec(advanced={"scale_down_stabilization_seconds": 0.0})
    fourteen = Override(kind="scale", replicas=14, expires_at=T0 + 0.2)
    run(
        spec,
        [
            Row(0.1, 0, 10, override=fourteen, want=14, mode="override"),
            Row(0.1, 0, 14, override=fourteen, want=7, reason="expired, policy resumed: down 14 -> 7"),
        ],
        state=settled_at(spec, 10),
    )


def test_bounds() -> None:
    run(
        make_spec(min_replica_count=3, max_replica_count=5),
        [
            Row(0.1, 0, 3, repeat=650, want=3, mode="normal"),
            Row(0.1, 100, 3, want=5, mode="panic", reason="(bounds 3..5)"),
            Row(0.1, 1000, 5, want=5, mode="panic"),
        ],
        current=3,
    )


def test_restart_above_max_is_clamped() -> None:
    run(make_spec(max_replica_count=4), [Row(0.1, 4, 8, want=4, mode="hold")], current=8)


def test_scale_override_wins_unclamped_and_expires() -> None:
    until = T0 + 75.0
    scale = Override(kind="scale", replicas=80, expires_at=until, by="alice")
    run(
        make_spec(max_replica_count=50),
        [
            SETTLED,
            Row(0.1, 8, 2, override=scale, want=80, mode="override", panic=False, reason="override scale=80 by alice"),
            Row(0.1, 8, 80, override=scale, want=80, reason="outside bounds 1..50"),
            # Expiry: the policy resumes from 80 and steps down within the bounds at its own pace (the override's
            # step up is not the policy's: it does not lower the period's start, which is 80).
            Row(10.0, 8, 80, override=scale, want=40, mode="normal", reason="override scale=80 by alice expired"),
        ],
    )


def test_pause_holds_the_count_even_in_panic() -> None:
    pause = Override(kind="pause", replicas=None, expires_at=None, by="bob")
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.1, 100, 2, override=pause, want=2, mode="paused", panic=True, reason="paused at 2 by bob, until"),
            Row(60.0, 100, 2, override=pause, want=2, mode="paused"),
            Row(0.1, 100, 2, want=25, mode="panic"),  # resumed
        ],
    )


def test_pause_at_a_count() -> None:
    pause = Override(kind="pause", replicas=0, expires_at=T0 + 100.0)
    run(make_spec(), [SETTLED, Row(0.1, 8, 2, override=pause, want=0, mode="paused", reason="paused at 0, ")])


@pytest.mark.parametrize(
    ("lead_s", "want"),
    [
        (0.1, 8),  # ceil((31.6 + 0.4) / 4)
        (None, 11),  # advanced.leadTimeSeconds 2.5: ceil((31.6 + 10) / 4)
        (5.0, 13),  # ceil((31.6 + 20) / 4)
        (600.0, 14),  # capped at the panic window (6 s) the slope was fitted on: ceil((31.6 + 24) / 4)
    ],
)
def test_forecast_claims_for_the_demand_one_lead_time_ahead(lead_s: float | None, want: int) -> None:
    # +4 requests/s for 6 s on plenty of ready capacity (no panic): the policy claims for the demand a lead
    # time ahead.
    ramp = [Row(0.1, 8 + 0.4 * i, 40, lead_s=lead_s) for i in range(60)]
    decision, _ = run(make_spec(), [SETTLED, *ramp])
    assert decision.desired == want
    assert decision.panic is False
    ahead_s = min(2.5 if lead_s is None else lead_s, 6.0)
    assert decision.forecast_demand == pytest.approx(31.6 + 4 * ahead_s, abs=0.05)  # shown in status


def test_decide_is_cheap() -> None:
    """A generous guard, not a benchmark: DESIGN wants p99 <= 20 ms for 100 models; one call is ~0.1 ms."""
    spec = make_spec()
    _, state = run(spec, [SETTLED])
    obs = Observation(demand=24, ready=6)
    now = T0 + 100.0
    terms = PolicySpec.of(spec)
    start = time.perf_counter()
    for i in range(1000):
        _, state = decide(terms, obs, state, now + i * 0.05)
    per_call_s = (time.perf_counter() - start) / 1000
    assert per_call_s < 2e-3


@pytest.mark.parametrize("dt", [0.0, 0.001])
def test_burst_of_samples_in_one_bucket_does_not_skew(dt: float) -> None:
    # 500 samples of a stale-looking 0 within one bucket, then the true level: the bucket holds the latest.
    run(make_spec(), [SETTLED, Row(dt, 0, 2, repeat=500), Row(0.0, 8, 2, want=2, reason="steady at 2")])


# --- the spec's own settings reach the detector and the rules (every scenario above runs on the defaults) ---


def test_panic_threshold_from_the_spec() -> None:
    run(
        make_spec(advanced={"panic_threshold": 3.0}),
        [
            SETTLED,
            Row(0.1, 20, 2, panic=False, mode="normal"),  # 2.5x capacity: a panic at the default 2x, not at 3x
            Row(0.1, 24, 2, panic=True, mode="panic"),  # 3x
        ],
    )


def test_target_queue_depth_sets_the_detectors_capacity() -> None:
    # One replica carries 10 here: 2 ready are a capacity of 20, so 30 is no panic (it would be at 4 per replica).
    run(
        make_spec(target=10.0),
        [
            Row(0.1, 20, 2, repeat=650, want=2, mode="normal"),
            Row(0.1, 30, 2, panic=False, mode="normal", at_least=3),
            Row(0.1, 40, 2, panic=True, mode="panic", at_least=4),
        ],
    )


def test_a_target_below_one_wants_nothing_for_no_demand() -> None:
    # 0.5 per replica: no demand is no replica beyond the floor (not one "for the rounding").
    run(make_spec(target=0.5), [Row(0.1, 0, 1, repeat=650, want=1, mode="normal"), Row(0.1, 1, 1, want=2)])


def test_stable_window_from_the_spec_ends_the_hold_and_the_panic() -> None:
    run(
        make_spec(advanced={"stable_window_seconds": 20.0}),
        [
            Row(0.1, 8, 4, repeat=195, want=4, mode="hold"),  # restart hold: one stable window (20 s) of data
            Row(0.1, 8, 4, repeat=10, mode="normal", want=2),
            Row(0.1, 24, 2, want=6, panic=True, stable_demand=(199 * 8 + 24) / 200),  # the mean of 20 s
            Row(0.1, 4, 6, repeat=195, want=6, panic=True, mode="panic"),
            Row(0.1, 4, 6, repeat=10, panic=False),  # 20 s without the condition, not 60
        ],
        current=4,
    )


def test_panic_window_from_the_spec() -> None:
    # The panic demand is the peak of the last 2 s, not of 6.
    run(
        make_spec(advanced={"panic_window_seconds": 2.0}),
        [
            Row(0.1, 8, 20, repeat=650, panic_demand=8),
            Row(0.1, 30, 20, panic_demand=30, panic=False),
            Row(0.1, 8, 20, repeat=19, panic_demand=30),
            Row(0.1, 8, 20, repeat=2, panic_demand=8),
        ],
    )


def test_stale_after_seconds_is_how_long_a_level_is_carried() -> None:
    # 10 for 1 s, then a 2.5 s silence, then 20: within staleAfterSeconds (3 s) the silence holds the last level,
    # so the stable demand is 34 buckets of 10 and one of 20 (at the default 1 s, only 10 would be carried).
    run(
        make_spec(advanced={"stale_after_seconds": 3.0}),
        [Row(0.1, 10, 2, repeat=10), Row(2.5, 20, 2, stable_demand=(34 * 10 + 20) / 35)],
    )


def test_missed_intervals_count_in_the_specs_stale_after_seconds() -> None:
    spec = make_spec(fallback=(3, 7), advanced={"stale_after_seconds": 0.5})
    run(
        spec,
        [
            Row(0.1, 20, 5, repeat=650, want=5),
            Row(1.9, None, 5, want=5, mode="stale"),  # three intervals of 0.5 s missed: tolerated
            Row(0.1, None, 5, want=7, mode="fallback", reason="4 missed intervals > failureThreshold 3"),
        ],
    )


def test_a_short_stabilisation_window_still_holds_for_its_length() -> None:
    run(
        make_spec(advanced={"scale_down_stabilization_seconds": 1.0}),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 4, 10, repeat=5, want=10, reason="stabilising"),
            Row(0.1, 4, 10, repeat=10, want=5),
        ],
    )


def test_the_stabilisation_window_remembers_a_peak_inside_one_bucket() -> None:
    # Two decisions within 100 ms: the higher recommendation is the one the window keeps.
    decision, _ = run(
        make_spec(),
        [Row(0.1, 40, 10, repeat=650, want=10), Row(0.1, 60, 10, panic=False, at_least=15)],
    )
    peak = decision.desired
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 60, 10, want=peak),
            Row(0.001, 40, 10, want=peak),
            Row(0.1, 40, 10, repeat=10, want=peak, reason="stabilising"),
        ],
    )


# --- live edits of the spec between decisions ---


def test_a_live_edit_of_the_stabilisation_window_starts_it_from_the_current_count() -> None:
    short = make_spec(advanced={"scale_down_stabilization_seconds": 5.0})
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 8, 10, repeat=300, want=10, reason="stabilising"),
            # The window is now 5 s: the count it held is where the new window starts, not forgotten ...
            Row(0.1, 8, 10, spec=short, repeat=45, want=10, reason="stabilising, max 10 over 5 s"),
            # ... and it steps down once 5 s have passed (rate-limited to half).
            Row(0.1, 8, 10, repeat=10, want=5),
        ],
    )


def test_a_live_edit_of_the_windows_keeps_a_panic_and_ends_it_on_the_new_window() -> None:
    short = make_spec(advanced={"stable_window_seconds": 20.0, "panic_window_seconds": 2.0})
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.1, 24, 2, want=6, panic=True),
            Row(0.1, 4, 6, repeat=100, want=6, panic=True),
            Row(0.1, 4, 6, spec=short, want=6, panic=True, mode="panic"),  # the edit is no reason to calm down
            Row(0.1, 4, 6, repeat=80, want=6, panic=True),
            Row(0.1, 4, 6, repeat=30, panic=False),  # 20 s after the last panic condition
        ],
    )


# --- edges a user relies on ---


def test_stale_metrics_while_idle_at_zero_keep_it_at_zero() -> None:
    # Missing metrics are no demand: an idle model must not wake (or be held at one replica) because a gateway
    # went quiet.
    run(
        make_spec(min_replica_count=0),
        [
            Row(0.1, 0, 0, repeat=650, want=0, mode="idle"),
            Row(0.1, None, 0, repeat=100, want=0, mode="stale"),
        ],
        current=0,
    )
    run(make_spec(min_replica_count=0), [Row(0.1, None, 0, repeat=30, want=0, mode="hold")], current=0)


def test_a_restart_between_the_idle_count_and_the_minimum_is_held_at_the_minimum() -> None:
    # 2 serving with minReplicaCount 3 and idleReplicaCount 1: the count is brought into bounds (3), never down to
    # the idle count, whether metrics are missing or the policy would go idle.
    spec = make_spec(min_replica_count=3, idle_replica_count=1, cooldown_period=0.0)
    run(spec, [Row(0.1, None, 2, repeat=20, want=3, mode="hold")], current=2)
    run(spec, [Row(0.1, 0, 2, repeat=20, want=3, mode="hold", reason="hold 3 after restart")], current=2)


def test_cooldown_after_a_restart_counts_from_the_restart() -> None:
    # A restarted autoscaler has no record of the last demand: the replicas it finds serving get a full cooldown
    # before going idle, not an instant scale to zero once the restart hold ends.
    spec = make_spec(min_replica_count=0, cooldown_period=120.0)
    run(
        spec,
        [
            Row(0.1, 0, 3, repeat=599, want=3, mode="hold"),
            Row(0.1, 0, 3, repeat=10, at_least=1, mode="normal"),
            Row(0.1, 0, 1, repeat=590, at_least=1, mode="normal"),
            Row(0.1, 0, 1, repeat=10, want=0, mode="idle"),
        ],
        current=3,
    )


def test_an_override_on_a_model_idle_since_the_restart_ends_in_idle() -> None:
    # Nothing to cool down from: the model was idle when the autoscaler started and has seen no demand since, so
    # when on-call's scale-up ends it goes back to idle at once, not a cooldown later.
    up = Override(kind="scale", replicas=3, expires_at=T0 + 10.0, by="dave")
    run(
        make_spec(min_replica_count=0, cooldown_period=300.0),
        [
            Row(0.1, 0, 0, override=up, repeat=99, want=3, mode="override"),
            Row(0.1, 0, 3, override=up, repeat=2, want=0, mode="idle"),
        ],
        current=0,
    )


def test_with_no_cooldown_idle_and_wake_follow_demand_at_once() -> None:
    # cooldownPeriod 0: idle as soon as the demand is gone, never while it is there (issue 7: it went idle under
    # demand on every other decision, flapping between the idle count and the need).
    run(
        make_spec(min_replica_count=3, idle_replica_count=1, cooldown_period=0.0),
        [
            Row(0.1, 4, 3, repeat=650, want=3, mode="normal"),
            Row(0.1, 0, 3, want=1, mode="idle"),
            Row(0.1, 0, 1, repeat=100, want=1, mode="idle"),
            Row(0.1, 2, 1, want=3, panic=False),  # above activation on the idle count: awake
        ],
    )


def test_scale_down_rate_period_ends_on_time() -> None:
    # A step down exactly one scaleDownPeriodSeconds ago no longer counts against the rate. (The step comes from
    # an expiring override so that it lands on an exact time.)
    ten = Override(kind="scale", replicas=10, expires_at=T0 + 66.0)
    run(
        make_spec(advanced={"scale_down_stabilization_seconds": 0.0}),
        [
            SETTLED,
            Row(0.5, 8, 2, override=ten, want=10),
            Row(0.5, 8, 10, override=ten, want=5, reason="rate-limited"),  # at +66 s: half of 10
            Row(1.0, 8, 5, repeat=59, want=5),  # the period's 50 % is used up
            Row(1.0, 8, 5, want=2),  # at +126 s: a new period, half of 5 rounded down (HPA's), the need
        ],
    )


def test_scale_override_to_zero_and_its_expiry_time() -> None:
    # `pulsescale scale llm 0` means zero, and an override ends at its expiry time, not one tick later.
    zero = Override(kind="scale", replicas=0, expires_at=T0 + 66.0, by="carol")
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.5, 8, 2, override=zero, want=0, mode="override"),
            Row(0.5, 8, 0, override=zero, reason="expired"),
        ],
    )


@pytest.mark.parametrize("lead_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_measured_lead_time_that_is_not_positive_uses_the_configured_one(lead_s: float) -> None:
    ramp = [Row(0.1, 8 + 0.4 * i, 40, lead_s=lead_s) for i in range(60)]
    configured = [Row(0.1, 8 + 0.4 * i, 40) for i in range(60)]
    got, _ = run(make_spec(), [SETTLED, *ramp])
    want, _ = run(make_spec(), [SETTLED, *configured])
    assert got.desired == want.desired == 11 and got.forecast_demand == want.forecast_demand


def test_a_gap_in_the_metrics_does_not_shorten_a_panic() -> None:
    # The panic runs one stable window from the last time its condition held, gap or not.
    run(
        make_spec(),
        [
            SETTLED,
            Row(0.1, 24, 2, want=6, panic=True),
            Row(0.1, None, 6, repeat=10, want=6, panic=True, mode="stale"),
            Row(0.1, 4, 6, want=6, panic=True, mode="panic"),
            Row(0.1, 4, 6, repeat=580, want=6, panic=True),
            Row(0.1, 4, 6, repeat=10, panic=False),
        ],
    )
