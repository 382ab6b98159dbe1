"""`autoscaler.decide.holds` by fixed values: KEDA's fallback behaviours, the pause annotations one way, and what an
override's reason says (events, status and logs carry it to on-call)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from autoscaler.decide.holds import apply_override, blind, describe, one_way
from autoscaler.decide.policy import PolicySpec, initial_state
from autoscaler.decide.policystate import Bounds, Observation
from tests.autoscaler.test_policy import T0, make_spec
from warmpool.protocol import Fallback, Override

BOUNDS = Bounds(min=1, max=10, idle=1, active_floor=1)


@pytest.mark.parametrize(
    ("behavior", "current", "want", "how"),
    [
        ("static", 5, 7, "static"),
        ("currentReplicas", 5, 5, "currentReplicas: current 5"),
        ("currentReplicasIfHigher", 8, 8, "currentReplicasIfHigher: current 8 > fallback 7"),
        ("currentReplicasIfHigher", 7, 7, "currentReplicasIfHigher: current 7 <= fallback 7"),
        ("currentReplicasIfHigher", 5, 7, "currentReplicasIfHigher: current 5 <= fallback 7"),
        ("currentReplicasIfLower", 5, 5, "currentReplicasIfLower: current 5 < fallback 7"),
        ("currentReplicasIfLower", 7, 7, "currentReplicasIfLower: current 7 >= fallback 7"),
        ("currentReplicasIfLower", 9, 7, "currentReplicasIfLower: current 9 >= fallback 7"),
    ],
)
def test_fallback_behaviours_as_keda(behavior: str, current: int, want: int, how: str) -> None:
    """Past failureThreshold (2 missed intervals of 1 s, threshold 1) each KEDA behaviour gives its count."""
    keda = msgspec.structs.replace(
        make_spec(advanced={"stale_after_seconds": 1.0}),
        fallback=Fallback(failure_threshold=1, replicas=7, behavior=behavior),  # type: ignore[arg-type]
    )
    state = dataclasses.replace(initial_state(PolicySpec.of(keda), now=T0, current_replicas=current), last_fresh_at=T0)
    got = blind(keda, state, BOUNDS, T0 + 2.0)
    assert got == (want, "fallback", f"fallback {want} ({how}): metrics stale 2 s, 2 missed intervals > "
                                     "failureThreshold 1")  # fmt: skip


def test_blind_before_any_fresh_metrics_says_so() -> None:
    keda = make_spec(advanced={"stale_after_seconds": 1.0})
    state = initial_state(PolicySpec.of(keda), now=T0, current_replicas=3)
    assert blind(keda, state, BOUNDS, T0 + 0.5) == (3, "hold", "no fresh metrics since restart 0.5 s: holding 3")


@pytest.mark.parametrize(
    ("paused_in", "paused_out", "prev", "desired", "want"),
    [
        (True, False, 5, 3, (5, "paused", "paused scale-in: holding 5 (policy wants 3: why)")),
        (True, False, 5, 5, (5, "normal", "why")),  # not a step in: nothing held
        (True, False, 5, 7, (7, "normal", "why")),  # out is not paused
        (False, True, 5, 7, (5, "paused", "paused scale-out: holding 5 (policy wants 7: why)")),
        (False, True, 5, 5, (5, "normal", "why")),
        (False, True, 5, 3, (3, "normal", "why")),  # in is not paused
        (False, False, 5, 3, (3, "normal", "why")),
        (True, False, 12, 10, (10, "normal", "why")),  # held at 12 the bounds make 10: the bounds alone moved it
    ],
)
def test_one_way_holds_only_the_paused_direction(
    paused_in: bool, paused_out: bool, prev: int, desired: int, want: tuple[int, str, str]
) -> None:
    obs = Observation(demand=1.0, ready=1, paused_scale_in=paused_in, paused_scale_out=paused_out)
    assert one_way(obs, prev, desired, "normal", "why", BOUNDS) == want


def test_an_override_says_what_who_how_long_and_whether_outside_the_bounds() -> None:
    scale = Override(kind="scale", replicas=4, expires_at=T0 + 90.0, by="alice")
    assert describe(scale) == "override scale=4 by alice"
    assert describe(Override(kind="pause", replicas=None, expires_at=None, by="")) == "override pause=current"
    assert apply_override(scale, 2, BOUNDS, T0 + 30.0) == (4, "override", "override scale=4 by alice, 60 s left")
    pause = Override(kind="pause", replicas=None, expires_at=None, by="")
    assert apply_override(pause, 6, BOUNDS, T0) == (6, "paused", "paused at 6, until resumed")
    assert apply_override(Override(kind="scale", replicas=1, expires_at=None, by=""), 5, BOUNDS, T0)[2] == (
        "override scale=1, until resumed"  # at the lower bound: inside
    )
    assert apply_override(Override(kind="scale", replicas=10, expires_at=None, by=""), 5, BOUNDS, T0)[2] == (
        "override scale=10, until resumed"  # at the upper bound: inside
    )
    assert apply_override(Override(kind="scale", replicas=12, expires_at=None, by=""), 5, BOUNDS, T0)[2] == (
        "override scale=12, until resumed, outside bounds 1..10"
    )
