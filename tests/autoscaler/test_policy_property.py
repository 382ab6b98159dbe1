"""Properties of `decide` over random specs and sample sequences (hypothesis).

- Within bounds: without a live override, desired is in ``[minReplicaCount, maxReplicaCount]`` or is the idle
  count. A live override is exact and deliberately not clamped (KEDA's paused-replicas is not either).
- Never down in panic, never down on stale metrics (unless the spec's own fallback count says so, or the bounds
  moved below the count).
- Pure: the same inputs give equal outputs, and the input state is not mutated.
- KEDA's fields (revision 5): the one-way pauses, ``scaleDownSelectPolicy: Disabled`` and
  ``initialCooldownPeriod`` never let the count move the way they forbid, and the bounds still hold.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from autoscaler.decide.policy import Observation, Override, PolicySpec, PolicyState, decide, initial_state
from warmpool.protocol import Advanced, Fallback, ScaledObjectSpec, ScaleTargetRef, Trigger, TriggerMetadata

T0 = 1_700_000_000.0


@st.composite
def specs(draw: st.DrawFn) -> ScaledObjectSpec:
    min_count = draw(st.integers(0, 5))
    max_count = draw(st.integers(max(min_count, 1), 30))
    idle = draw(st.none() | st.integers(0, max(min_count - 1, 0) if min_count > 0 else 3))
    fallback = draw(st.none() | st.builds(Fallback, failure_threshold=st.integers(1, 5), replicas=st.integers(0, 40)))
    advanced = Advanced(
        stable_window_seconds=draw(st.floats(1.0, 60.0)),
        panic_window_seconds=draw(st.floats(0.5, 10.0)),
        panic_threshold=draw(st.floats(1.0, 4.0)),
        scale_down_stabilization_seconds=draw(st.sampled_from([0.0, 1.0, 10.0, 60.0])),
        scale_down_percent=draw(st.floats(1.0, 100.0)),
        scale_down_period_seconds=draw(st.floats(1.0, 60.0)),
        stale_after_seconds=draw(st.floats(0.2, 3.0)),
        lead_time_seconds=draw(st.floats(0.1, 10.0)),
    )
    meta = TriggerMetadata(
        model="llm",
        target_queue_depth=draw(st.floats(0.5, 10.0)),
        activation_queue_depth=draw(st.sampled_from([0.0, 0.5, 5.0])),
    )
    return ScaledObjectSpec(
        scale_target_ref=ScaleTargetRef(name="llm"),
        triggers=[Trigger(type="gateway-queue", metadata=meta)],
        min_replica_count=min_count,
        max_replica_count=max_count,
        idle_replica_count=idle,
        cooldown_period=draw(st.sampled_from([0.0, 5.0, 60.0])),
        fallback=fallback,
        advanced=advanced,
    )


overrides = st.builds(
    Override,
    kind=st.sampled_from(["scale", "pause"]),
    replicas=st.none() | st.integers(0, 60),
    expires_at=st.none() | st.floats(0.0, 300.0).map(lambda s: T0 + s),
    by=st.sampled_from(["", "alice"]),
)

steps = st.tuples(
    st.sampled_from([0.0, 0.001, 0.05, 0.1, 0.1, 0.1, 0.5, 2.0, 10.0, 70.0]),
    st.none() | st.floats(0.0, 1000.0) | st.just(math.nan),
    st.integers(0, 50),
    st.none() | st.floats(0.05, 20.0),
    st.none() | st.none() | st.none() | overrides,
)


def same(a: Any, b: Any) -> bool:
    """Deep equality that compares numpy arrays by value (dataclass `==` cannot)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _live(override: Override | None, now: float) -> bool:
    return override is not None and (override.expires_at is None or now < override.expires_at)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), current=st.integers(0, 40), trace=st.lists(steps, min_size=1, max_size=40))
def test_decisions_hold_the_invariants(
    spec: ScaledObjectSpec, current: int, trace: list[tuple[float, float | None, int, float | None, Override | None]]
) -> None:
    now = T0
    terms = PolicySpec.of(spec)
    state: PolicyState = initial_state(terms, now=now, current_replicas=current)
    idle = spec.idle_replica_count if spec.idle_replica_count is not None else spec.min_replica_count
    for dt, demand, ready, lead_s, override in trace:
        now += dt
        obs = Observation(demand=demand, ready=ready, lead_time_s=lead_s, override=override)
        before = copy.deepcopy(state)
        decision, after = decide(terms, obs, state, now)

        # Pure: equal inputs, equal outputs; the input state is untouched.
        again, after_again = decide(terms, obs, state, now)
        assert again == decision
        assert same(after, after_again)
        assert same(state, before)

        prev, desired = state.desired, decision.desired
        assert isinstance(desired, int)
        assert decision.reason
        if _live(override, now):
            assert override is not None
            want = override.replicas if override.replicas is not None else (prev if override.kind == "pause" else None)
            assert want is None or desired == want, decision
        else:
            assert desired <= spec.max_replica_count, decision
            assert desired >= spec.min_replica_count or desired == idle, decision
            if decision.mode != "fallback" and (decision.panic or decision.mode in ("stale", "hold")):
                fresh = demand is not None and not math.isnan(demand)
                fresh_hold = decision.mode == "hold" and fresh and not decision.panic
                if not fresh_hold:  # the restart floor itself may sit below a count a pulse reached
                    assert desired >= min(prev, spec.max_replica_count), decision
        state = after


@st.composite
def keda_specs(draw: st.DrawFn) -> ScaledObjectSpec:
    """`specs` with revision 5's KEDA fields drawn too: fallback behavior, scale-down pods and select policy,
    initialCooldownPeriod."""
    spec = draw(specs())
    behavior = draw(st.sampled_from(["static", "currentReplicas", "currentReplicasIfHigher", "currentReplicasIfLower"]))
    fallback = None if spec.fallback is None else msgspec.structs.replace(spec.fallback, behavior=behavior)
    advanced = msgspec.structs.replace(
        spec.advanced,
        scale_down_pods=draw(st.none() | st.integers(0, 10)),
        scale_down_select_policy=draw(st.sampled_from(["Max", "Min", "Disabled"])),
    )
    icp = draw(st.sampled_from([0.0, 30.0, 600.0]))
    return msgspec.structs.replace(spec, fallback=fallback, advanced=advanced, initial_cooldown_period=icp)


keda_steps = st.tuples(steps, st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=keda_specs(), current=st.integers(0, 40), trace=st.lists(keda_steps, min_size=1, max_size=40))
def test_keda_fields_hold_their_invariants(
    spec: ScaledObjectSpec,
    current: int,
    trace: list[tuple[tuple[float, float | None, int, float | None, Override | None], bool, bool]],
) -> None:
    """Without a live override: ``paused-scale-in`` never lowers the count and ``paused-scale-out`` never raises it
    (but for the bounds); ``scaleDownSelectPolicy: Disabled`` never steps down in normal mode; no idle drop inside
    ``initialCooldownPeriod``; and the bounds hold whatever the fields say."""
    now = T0
    terms = PolicySpec.of(spec)
    state: PolicyState = initial_state(terms, now=now, current_replicas=current)
    idle = spec.idle_replica_count if spec.idle_replica_count is not None else spec.min_replica_count
    floor = max(spec.min_replica_count, 1)
    for (dt, demand, ready, lead_s, override), paused_in, paused_out in trace:
        now += dt
        obs = Observation(demand=demand, ready=ready, lead_time_s=lead_s, override=override,
                          paused_scale_in=paused_in, paused_scale_out=paused_out)  # fmt: skip
        decision, after = decide(terms, obs, state, now)
        prev, desired = state.desired, decision.desired
        if not _live(override, now):
            assert desired <= spec.max_replica_count, decision
            assert desired >= spec.min_replica_count or desired == idle, decision
            if paused_in:
                assert desired >= min(prev, spec.max_replica_count), decision
            if paused_out:
                assert desired <= max(prev, floor), decision
            if spec.advanced.scale_down_select_policy == "Disabled" and decision.mode == "normal":
                assert desired >= min(prev, spec.max_replica_count), decision
            if now < T0 + spec.initial_cooldown_period and desired < prev:
                assert decision.mode != "idle", decision
        state = after
