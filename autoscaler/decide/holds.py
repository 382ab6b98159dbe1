"""What holds a model's count against the policy's recommendation, before and after the rules on fresh demand.

An on-call override (``scale``, ``pause``: `apply_override`, exactly its count), no fresh demand (`blind`: never
down, or KEDA's fallback count past ``failureThreshold``) and KEDA's ``paused-scale-in`` / ``paused-scale-out``
annotations (`one_way`). `autoscaler.decide.policy.decide` applies them in the order its module docstring gives. Pure.
"""

from __future__ import annotations

import math

from autoscaler.decide.policystate import ROUNDING, Bounds, Mode, Observation, PolicyState
from autoscaler.decide.policystate import number_text as _n
from warmpool.protocol import Override, ScaledObjectSpec

__all__ = ["apply_override", "blind", "describe", "live", "one_way"]


def live(override: Override, now: float) -> bool:
    return override.expires_at is None or now < override.expires_at


def describe(override: Override) -> str:
    count = "current" if override.replicas is None else str(override.replicas)
    by = f" by {override.by}" if override.by else ""
    return f"override {override.kind}={count}{by}"


def apply_override(override: Override, prev: int, bounds: Bounds, now: float) -> tuple[int, Mode, str]:
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


def blind(spec: ScaledObjectSpec, state: PolicyState, bounds: Bounds, now: float) -> tuple[int, Mode, str]:
    """No fresh demand: hold (never down), or the fallback count once enough intervals were missed."""
    prev = state.desired
    since = state.last_fresh_at if state.last_fresh_at is not None else state.started_at
    stale_s = max(now - since, 0.0)
    missed = math.floor(stale_s / spec.advanced.stale_after_seconds + ROUNDING)
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


def one_way(
    obs: Observation, prev: int, desired: int, mode: Mode, reason: str, bounds: Bounds
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
