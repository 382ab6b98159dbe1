"""Properties of the detector's windows and readings over random sample sequences (hypothesis)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from autoscaler.decide import detector
from autoscaler.decide.detector import DetectorConfig, TimeWindow

T0 = 1_700_000_000.0

samples = st.lists(
    st.tuples(st.sampled_from([0.0, 0.001, 0.05, 0.1, 0.1, 0.3, 1.5, 8.0]), st.none() | st.floats(0.0, 500.0)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(trace=samples, span_s=st.floats(0.5, 20.0), carry_s=st.sampled_from([0.0, 0.3, 1.0]))
def test_window_readings_stay_within_what_was_recorded(
    trace: list[tuple[float, float | None]], span_s: float, carry_s: float
) -> None:
    w = TimeWindow.empty(span_s, carry_s=carry_s)
    now = T0
    seen: list[float] = []
    for dt, value in trace:
        now += dt
        if value is None:
            continue
        keys, values = w.keys.copy(), w.values.copy()
        w2 = w.record(now, value)
        assert np.array_equal(w.keys, keys) and np.array_equal(w.values, values)  # copy-on-write
        w = w2
        seen.append(value)
        mean, peak = w.mean(now, span_s), w.peak(now, span_s)
        assert mean is not None and peak is not None  # the sample just recorded is in the window
        assert min(seen) - 1e-9 <= mean <= peak + 1e-9
        assert peak <= max(seen)
        assert peak >= value  # the newest bucket holds the newest value


@settings(max_examples=200, deadline=None)
@given(trace=samples, ready=st.integers(0, 20), lead_s=st.floats(0.05, 30.0))
def test_forecast_is_never_negative_and_panic_needs_the_condition_to_start(
    trace: list[tuple[float, float | None]], ready: int, lead_s: float
) -> None:
    cfg = DetectorConfig()
    state = detector.initial(cfg)
    now = T0
    for dt, demand in trace:
        now += dt
        pulse, new_state = detector.observe(cfg, state, now=now, demand=demand, ready=ready, lead_time_s=lead_s)
        assert pulse.forecast_demand is None or pulse.forecast_demand >= 0.0
        if pulse.panic and not state.panic:
            assert pulse.panic_condition and pulse.entered_panic
        if demand is None:
            assert pulse.panic == state.panic
        state = new_state
