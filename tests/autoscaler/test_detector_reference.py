"""The O(1) detector against the implementation it replaced (tests/_detector_reference.py, the whole-window numpy
scans) on random sample streams: the same readings within float tolerance."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.decide import detector
from tests import _detector_reference as ref

T0 = 1_700_000_000.0

steps = st.lists(
    st.tuples(
        st.sampled_from([0.0, 0.001, 0.05, 0.1, 0.1, 0.1, 0.2, 0.7, 3.0, -0.3]),
        st.none() | st.integers(0, 400).map(float) | st.floats(0.0, 500.0),
        st.integers(0, 12),
    ),
    min_size=1,
    max_size=400,
)


def _same(a: float | None, b: float | None) -> bool:
    return (a is None) == (b is None) and (a is None or b is None or a == pytest.approx(b, rel=1e-7, abs=1e-7))


@settings(max_examples=150, deadline=None)
@given(trace=steps, stable_s=st.sampled_from([2.0, 6.0, 60.0, 120.0]), carry_s=st.sampled_from([0.0, 0.3, 1.0]))
def test_observe_matches_the_reference(
    trace: list[tuple[float, float | None, int]], stable_s: float, carry_s: float
) -> None:
    cfg = detector.DetectorConfig(stable_window_s=stable_s, panic_window_s=stable_s / 10, carry_s=carry_s)
    rcfg = ref.DetectorConfig(stable_window_s=stable_s, panic_window_s=stable_s / 10, carry_s=carry_s)
    new, old = detector.initial(cfg), ref.initial(rcfg)
    now = T0
    for dt, demand, ready in trace:
        now += dt
        p, new = detector.observe(cfg, new, now=now, demand=demand, ready=ready, lead_time_s=2.5)
        q, old = ref.observe(rcfg, old, now=now, demand=demand, ready=ready, lead_time_s=2.5)
        for field in ("stable_demand", "panic_demand", "forecast_demand", "slope_per_s"):
            assert _same(getattr(p, field), getattr(q, field)), (field, getattr(p, field), getattr(q, field))
        assert (p.panic, p.panic_condition, p.entered_panic, p.left_panic) == (
            q.panic, q.panic_condition, q.entered_panic, q.left_panic)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(trace=steps, span_s=st.sampled_from([1.0, 6.0, 300.0]))
def test_max_window_matches_the_reference(trace: list[tuple[float, float | None, int]], span_s: float) -> None:
    # The stabilisation window's use: max-combine, no carry, the peak read at each record.
    new, old = detector.TimeWindow.empty(span_s, combine="max"), ref.TimeWindow.empty(span_s, combine="max")
    now = T0
    for dt, value, _ in trace:
        now += dt
        if value is not None:
            new, old = new.record(now, value), old.record(now, value)
        for span in (span_s, span_s / 3):
            assert new.peak(now, span) == old.peak(now, span)
            assert _same(new.mean(now, span), old.mean(now, span))
