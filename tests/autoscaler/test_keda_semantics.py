"""KEDA's ScaledObject fields that protocol revision 5 added, as the policy and the decider honour them: the
``paused-scale-in``/``paused-scale-out`` annotations, ``paused-replicas: 0``, ``fallback.behavior``,
``initialCooldownPeriod``, and the HPA-style scale-down policies (``scaleDownPods``, ``scaleDownSelectPolicy``).

Tables on a hand clock, as tests/autoscaler/test_policy.py (whose `Row`/`run` drive the pure policy here).
"""

from __future__ import annotations

import msgspec
import pytest

from autoscaler.decide.decider import DeciderSettings, ModelDecider
from tests.autoscaler.test_policy import SETTLED, T0, Row, make_spec, run, settled_at
from tests.helpers import HandClock
from warmpool import protocol
from warmpool.protocol import Fallback, QueueSample, ScaledObjectSpec, ScalerRecord

# --- paused-scale-in / paused-scale-out ---------------------------------------------------------------------------


def test_paused_scale_in_holds_the_count_but_scales_out() -> None:
    spec = make_spec()
    run(
        spec,
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            # Demand falls to 8 (2 replicas' worth) for 70 s: the policy would be down at 5 by now.
            Row(
                0.1,
                8,
                10,
                repeat=700,
                paused_in=True,
                want=10,
                mode="paused",
                reason="paused scale-in: holding 10 (policy wants 5: down 10 -> 5",
            ),
            # Lifting the annotation: the policy's own count at once.
            Row(0.1, 8, 10, want=5, mode="normal", reason="down 10 -> 5"),
        ],
    )


def test_paused_scale_in_still_scales_out_in_a_pulse() -> None:
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 80, 10, paused_in=True, at_least=20, mode="panic", panic=True),
        ],
    )


def test_paused_scale_in_blocks_the_idle_drop() -> None:
    run(
        make_spec(min_replica_count=0, cooldown_period=10.0),
        [
            SETTLED,
            Row(0.1, 0, 2, repeat=300, paused_in=True, want=2, mode="paused", reason="policy wants 0: idle 2 -> 0"),
        ],
    )


def test_paused_scale_in_yields_to_a_lowered_max() -> None:
    # As an HPA clamps to maxReplicas before its behavior: the bound applies, the pause does not hold it off.
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 40, 10, paused_in=True, spec=make_spec(max_replica_count=4), want=4, reason="(bounds 1..4)"),
        ],
    )


def test_paused_scale_out_holds_the_count_but_scales_in() -> None:
    run(
        make_spec(),
        [
            SETTLED,
            Row(
                0.1,
                24,
                2,
                paused_out=True,
                want=2,
                mode="paused",
                reason="paused scale-out: holding 2 (policy wants 6: panic",
            ),
            # No demand for 80 s: down to the minimum, the direction not paused.
            Row(0.1, 0, 2, repeat=800, paused_out=True, want=1),
        ],
    )


def test_paused_scale_out_keeps_an_idle_model_at_zero() -> None:
    run(
        make_spec(min_replica_count=0),
        [Row(0.1, 8, 0, repeat=5, paused_out=True, want=0, mode="paused", reason="paused scale-out: holding 0")],
        current=0,
    )


def test_an_on_call_override_beats_the_scale_in_pause() -> None:
    until = T0 + 500.0
    run(
        make_spec(),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(
                0.1,
                40,
                10,
                paused_in=True,
                override=protocol.Override(kind="scale", replicas=3, expires_at=until),
                want=3,
                mode="override",
            ),
        ],
    )


# --- fallback.behavior --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold", [0, 1, 3])
def test_fallback_when_failures_exceed_the_threshold(threshold: int) -> None:
    """KEDA (pkg/fallback/fallback.go): ``NumberOfFailures > FailureThreshold``, so threshold N tolerates N failures
    and falls back on failure N+1. A failure here: an interval of `advanced.staleAfterSeconds`, counted from the
    last decision that had fresh demand, that passed without it (KEDA's failed poll, one per polling period)."""
    spec = make_spec(fallback=(threshold, 9), advanced={"stale_after_seconds": 1.0})
    run(
        spec,
        [
            Row(0.1, 20, 5, repeat=650, want=5),
            Row(threshold + 0.5, None, 5, want=5, mode="stale"),  # N failures: tolerated
            Row(0.4, None, 5, want=5, mode="stale", reason=f"{threshold} missed intervals"),
            Row(
                0.1,
                None,
                5,
                want=9,
                mode="fallback",
                reason=f"{threshold + 1} missed intervals > failureThreshold {threshold}",
            ),
        ],
    )


@pytest.mark.parametrize(
    ("behavior", "current", "want"),
    [
        ("static", 10, 4),
        ("static", 2, 4),
        ("currentReplicas", 10, 10),
        ("currentReplicas", 2, 2),
        ("currentReplicasIfHigher", 10, 10),
        ("currentReplicasIfHigher", 2, 4),
        ("currentReplicasIfLower", 10, 4),
        ("currentReplicasIfLower", 2, 2),
    ],
)
def test_fallback_behavior(behavior: str, current: int, want: int) -> None:
    spec = msgspec.structs.replace(
        make_spec(advanced={"stale_after_seconds": 1.0}),
        fallback=Fallback(failure_threshold=3, replicas=4, behavior=behavior),  # type: ignore[arg-type]
    )
    run(
        spec,
        [
            Row(0.1, 4 * current, current, repeat=650, want=current),
            Row(4.0, None, current, want=want, mode="fallback", reason=f"fallback {want} ({behavior}"),
            Row(30.0, None, want, want=want, mode="fallback"),
        ],
    )


# --- initialCooldownPeriod ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("created_at", [T0, None], ids=["created-at-start", "unknown-counts-from-first-seen"])
def test_initial_cooldown_keeps_a_new_scaled_object_off_zero(created_at: float | None) -> None:
    spec = make_spec(min_replica_count=0, cooldown_period=5.0, initial_cooldown_period=60.0)
    run(
        spec,
        [
            Row(0.1, 8, 2, repeat=100, created_at=created_at, want=2),
            # 20 s without demand: the cooldown (5 s) is over, the initial cooldown (60 s from creation) is not.
            Row(
                0.1,
                0,
                2,
                repeat=200,
                created_at=created_at,
                want=2,
                mode="normal",
                reason="idle at 0 in 30 s (initialCooldownPeriod)",
            ),
            Row(0.1, 0, 2, repeat=301, created_at=created_at, want=0, mode="idle"),
        ],
    )


def test_initial_cooldown_long_past_changes_nothing() -> None:
    spec = make_spec(min_replica_count=0, cooldown_period=5.0, initial_cooldown_period=60.0)
    run(
        spec,
        [
            Row(0.1, 8, 2, repeat=650, created_at=T0 - 3600, want=2),
            Row(0.1, 0, 2, repeat=51, created_at=T0 - 3600, want=0, mode="idle"),
        ],
    )


# --- scaleDownPods / scaleDownSelectPolicy ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pods", "select", "want"),
    [
        (None, "Max", 5),  # the percent policy alone: 50 % of 10
        (1, "Max", 5),  # Max: the larger removal (percent's 5 over pods' 1)
        (1, "Min", 9),  # Min: the smaller removal
        (8, "Max", 2),  # pods remove more than the percent
        (8, "Min", 5),
        (8, "Disabled", 10),  # never down
    ],
)
def test_scale_down_policies(pods: int | None, select: str, want: int) -> None:
    adv = {
        "scale_down_stabilization_seconds": 0.0,
        "stable_window_seconds": 6.0,
        "panic_window_seconds": 1.0,
        "scale_down_pods": pods,
        "scale_down_select_policy": select,
    }
    run(make_spec(advanced=adv), [Row(0.1, 40, 10, repeat=650, want=10), Row(0.1, 4, 10, repeat=100, want=want)])


@pytest.mark.parametrize(
    ("start", "percent", "pods", "select", "keep"),
    [
        # Percent keeps int(start x (1 - percent/100)), Pods keeps start - pods; Max keeps the fewer (the larger
        # removal), Min the more (HPA's selectPolicy: min/max over the kept counts).
        (10, 25.0, 2, "Max", 7),  # percent 7 (7.5 down), pods 8
        (10, 25.0, 2, "Min", 8),
        (10, 25.0, 4, "Max", 6),  # pods 6, percent 7
        (10, 25.0, 4, "Min", 7),
        (7, 50.0, 3, "Max", 3),  # percent 3 (3.5 down), pods 4
        (7, 50.0, 3, "Min", 4),
        (3, 50.0, 1, "Min", 2),  # percent 1 (1.5 down), pods 2
        (3, 50.0, 1, "Max", 1),
        (25, 10.0, 2, "Min", 23),  # percent 22 (22.5 down), pods 23
        (25, 10.0, 2, "Max", 22),
    ],
)
def test_scale_down_select_policy_over_both_policies_as_hpa(
    start: int, percent: float, pods: int, select: str, keep: int
) -> None:
    adv = {
        "scale_down_stabilization_seconds": 0.0,
        "scale_down_percent": percent,
        "scale_down_pods": pods,
        "scale_down_select_policy": select,
    }
    spec = make_spec(advanced=adv)
    run(spec, [Row(0.1, 0, start, want=keep), Row(0.1, 0, keep, repeat=5, want=keep)], state=settled_at(spec, start))


def test_scale_down_select_policy_counts_scale_ups_in_the_period() -> None:
    # Both policies count from the period's start (10, before the step up to 12 that a raised minReplicaCount
    # made): Min keeps max(5, 10 - 1) = 9.
    adv = {"scale_down_stabilization_seconds": 0.0, "scale_down_pods": 1, "scale_down_select_policy": "Min"}
    spec = make_spec(advanced=adv)
    raised = make_spec(min_replica_count=12, advanced=adv)
    run(
        spec,
        [Row(0.1, 0, 10, spec=raised, want=12), Row(0.1, 0, 12, spec=spec, want=9, reason="rate-limited")],
        state=settled_at(spec, 10),
    )


def test_scale_down_disabled_still_scales_out_and_says_why() -> None:
    adv = {"scale_down_stabilization_seconds": 0.0, "scale_down_select_policy": "Disabled"}
    run(
        make_spec(advanced=adv),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 4, 10, repeat=5, want=10, reason="steady at 10: scale-down disabled (scaleDownSelectPolicy)"),
            Row(0.1, 80, 10, at_least=20),
        ],
    )


def test_the_rate_limit_reason_names_both_policies() -> None:
    adv = {"scale_down_stabilization_seconds": 0.0, "scale_down_pods": 1, "scale_down_select_policy": "Min"}
    run(
        make_spec(advanced=adv),
        [
            Row(0.1, 40, 10, repeat=650, want=10),
            Row(0.1, 4, 10, repeat=5, want=9, reason="scale-down rate min(50 %, 1 pods)/60 s used"),
        ],
    )


# --- through the decider: the record's annotations reach the policy -------------------------------------------


def so_record(*, min_replicas: int = 0, spec: dict[str, object] | None = None, **over: object) -> ScalerRecord:
    raw = {
        "scaleTargetRef": {"name": "m"},
        "minReplicaCount": min_replicas,
        "maxReplicaCount": 20,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": "m", "targetQueueDepth": 4}}],
        **(spec or {}),
    }
    spec = protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec)
    return ScalerRecord(namespace="team", name="so-m", spec=spec, **over)  # type: ignore[arg-type]


def sample(seq: int, depth: int, now: float) -> QueueSample:
    return QueueSample(gateway="gw", model="m", seq=seq, ts=now, queue_depth=depth, inflight=0,
                       arrivals_total=seq, completions_total=0, timeouts_total=0)  # fmt: skip


def test_paused_replicas_zero_parks_at_zero_below_min_replica_count() -> None:
    # KEDA: ``paused-replicas: "0"`` scales the target to zero whatever minReplicaCount says.
    clock = HandClock()
    d = ModelDecider(so_record(min_replicas=2, paused=True, paused_replicas=0), now=clock(), current_replicas=3)
    d.on_sample(sample(1, 40, clock()), clock())
    ev = d.decide(clock.advance(0.1), ready=3)
    assert (ev.decision.desired, ev.decision.mode) == (0, "paused"), ev.decision
    assert "paused at 0 by annotation" in ev.decision.reason
    row = d.status_row(ready=3, activating=0, warm=0, stale=0)
    assert row.paused and row.desired == 0 and row.key == "team.so-m"


def test_the_decider_passes_the_records_scale_in_pause_and_creation_time() -> None:
    clock = HandClock()
    d = ModelDecider(so_record(min_replicas=1), DeciderSettings(debounce_s=0.0), now=clock(), current_replicas=0)
    for seq in range(1, 700):  # settled at 10 past the restart hold
        d.on_sample(sample(seq, 40, clock()), clock())
        d.decide(clock(), ready=10)
        clock.advance(0.1)
    assert d.desired(0) == 10
    d.update_record(so_record(min_replicas=1, paused_scale_in=True), clock())
    for seq in range(700, 1500):
        d.on_sample(sample(seq, 4, clock()), clock())
        ev = d.decide(clock(), ready=10)
        clock.advance(0.1)
    assert (ev.decision.desired, ev.decision.mode) == (10, "paused"), ev.decision
    assert ev.decision.reason.startswith("paused scale-in: holding 10")
    row = d.status_row(ready=10, activating=0, warm=0, stale=0)
    assert not row.paused, "a one-way pause is not the Paused condition: the ScaledObject still scales out"
    assert row.mode == "paused" and "paused scale-in" in row.reason


@pytest.mark.parametrize(("age_s", "want"), [(3600.0, 0), (10.0, 2)], ids=["created-long-ago", "created-10s-ago"])
def test_the_decider_counts_the_initial_cooldown_from_the_records_creation(age_s: float, want: int) -> None:
    clock = HandClock()
    so = {"cooldownPeriod": 0, "initialCooldownPeriod": 600}
    rec = so_record(spec=so, created_at=clock() - age_s)
    d = ModelDecider(rec, DeciderSettings(debounce_s=0.0), now=clock(), current_replicas=0)
    for seq in range(1, 700):  # 70 s at 2 replicas' demand: past the pulse that woke it, settled at 2
        d.on_sample(sample(seq, 8, clock()), clock())
        d.decide(clock(), ready=2)
        clock.advance(0.1)
    assert d.desired(0) == 2
    d.on_sample(sample(700, 0, clock()), clock())
    decision = d.decide(clock(), ready=2).decision
    assert decision.desired == want, decision
    if want:
        assert "initialCooldownPeriod" in decision.reason
