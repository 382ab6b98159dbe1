"""The pulse detector: time-indexed windows, the trend forecast and the panic flag, on a hand-advanced clock."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from autoscaler import detector
from autoscaler.detector import MAX_BUCKETS, DetectorConfig, TimeWindow

T0 = 1_700_000_000.0


def _window(records: list[tuple[float, float]], *, span_s: float = 6.0, carry_s: float = 0.0) -> TimeWindow:
    w = TimeWindow.empty(span_s, carry_s=carry_s)
    for at_s, value in records:
        w = w.record(T0 + at_s, value)
    return w


BURST = [(0.1 + i * 0.001, 50.0) for i in range(40)]


@pytest.mark.parametrize(
    ("name", "records", "carry_s", "at_s", "mean", "peak"),
    [
        ("one sample", [(0.0, 8.0)], 0.0, 0.0, 8.0, 8.0),
        ("one bucket per 100 ms", [(0.0, 2.0), (0.1, 4.0), (0.2, 6.0)], 0.0, 0.2, 4.0, 6.0),
        # A burst of samples inside one bucket is one value (the latest): it cannot outweigh the other buckets.
        ("burst keeps the latest", [(0.0, 2.0), *BURST, (0.15, 4.0)], 0.0, 0.2, 3.0, 4.0),
        # A level holds between samples: 10 for 0.5 s then 20 is five buckets of 10 and one of 20.
        ("carried over a short gap", [(0.0, 10.0), (0.5, 20.0)], 1.0, 0.5, 70.0 / 6, 20.0),
        # Longer than the carry limit: the gap is "no data", never zeros.
        ("not carried past the limit", [(0.0, 10.0), (3.0, 20.0)], 1.0, 3.0, (11 * 10.0 + 20.0) / 12, 20.0),
        ("no carry: gaps are empty", [(0.0, 10.0), (3.0, 20.0)], 0.0, 3.0, 15.0, 20.0),
        # A late tick: buckets that fell out of the window no longer count.
        ("old buckets leave the window", [(0.0, 100.0), (5.0, 4.0)], 0.0, 6.5, 4.0, 4.0),
        ("whole window old: no data", [(0.0, 100.0)], 0.0, 7.0, None, None),
        # A ring slot reused on a later lap is recognised by its key, not by being cleared.
        ("earlier lap ignored", [(0.0, 100.0), (6.0, 4.0)], 0.0, 6.0, 4.0, 4.0),
    ],
)
def test_time_window(
    name: str, records: list[tuple[float, float]], carry_s: float, at_s: float, mean: float | None, peak: float | None
) -> None:
    w = _window(records, carry_s=carry_s)
    got_mean = w.mean(T0 + at_s, 6.0)
    assert (got_mean is None) == (mean is None), name
    if mean is not None:
        assert got_mean == pytest.approx(mean), name
    assert w.peak(T0 + at_s, 6.0) == peak, name


def test_window_is_copy_on_write() -> None:
    before = _window([(0.0, 1.0)])
    after = before.record(T0 + 0.1, 9.0)
    assert before.peak(T0 + 0.1, 6.0) == 1.0
    assert after.peak(T0 + 0.1, 6.0) == 9.0
    with pytest.raises(ValueError, match="read-only"):
        after.values[0] = 3.0


def test_window_max_combine_keeps_the_highest_in_a_bucket() -> None:
    w = TimeWindow.empty(60.0, combine="max")
    for value in (3.0, 7.0, 5.0):
        w = w.record(T0, value)
    assert w.peak(T0, 60.0) == 7.0


def test_late_record_older_than_the_ring_is_ignored() -> None:
    w = _window([(10.0, 4.0)])
    assert w.record(T0, 99.0) is w


def test_long_window_caps_bucket_count() -> None:
    w = TimeWindow.empty(3600.0)
    assert len(w.keys) == MAX_BUCKETS
    assert w.bucket_s == pytest.approx(3.0)


def test_trend_of_a_ramp() -> None:
    # 2 per second for 5 s: level 10 at t=5, slope 2.
    w = _window([(i * 0.1, i * 0.2) for i in range(51)])
    line = w.trend(T0 + 5.0, 6.0)
    assert line is not None
    assert line[0] == pytest.approx(10.0)
    assert line[1] == pytest.approx(2.0)


CFG = DetectorConfig(stable_window_s=60.0, panic_window_s=6.0, panic_threshold=2.0, target_queue_depth=4.0)


def _feed(samples: Sequence[tuple[float, float | None, int]], *, lead_s: float = 2.5) -> list[detector.Pulse]:
    """(seconds after T0, demand, ready) -> the detector's reading after each."""
    state = detector.initial(CFG)
    out = []
    for at_s, demand, ready in samples:
        pulse, state = detector.observe(CFG, state, now=T0 + at_s, demand=demand, ready=ready, lead_time_s=lead_s)
        out.append(pulse)
    return out


def test_forecast_looks_one_lead_time_ahead_and_never_below_current_when_rising() -> None:
    ramp = [(i * 0.1, 10.0 + i * 0.2, 5) for i in range(60)]  # +2/s
    short, long = _feed(ramp, lead_s=1.0)[-1], _feed(ramp, lead_s=10.0)[-1]
    assert short.current is not None and short.forecast_demand is not None and long.forecast_demand is not None
    assert short.forecast_demand == pytest.approx(short.current + 2.0, abs=0.01)
    assert long.forecast_demand == pytest.approx(short.current + 20.0, abs=0.01)
    # A jump at the newest sample: the fitted line lags it, the forecast does not.
    jump = _feed([*[(i * 0.1, 8.0, 2) for i in range(30)], (3.0, 30.0, 2)])[-1]
    assert jump.forecast_demand is not None and jump.forecast_demand >= 30.0


def test_forecast_is_never_negative() -> None:
    fall = [(i * 0.1, max(50.0 - i * 2.0, 0.0), 5) for i in range(30)]
    last = _feed(fall, lead_s=30.0)[-1]
    assert last.forecast_demand == 0.0


@pytest.mark.parametrize(
    ("name", "samples", "panic"),
    [
        ("below threshold", [(0.0, 8.0, 2), (0.1, 15.9, 2)], [False, False]),
        ("at threshold (>=)", [(0.0, 8.0, 2), (0.1, 16.0, 2)], [False, True]),
        ("3x pulse: panic on that sample", [(0.0, 8.0, 2), (0.1, 24.0, 2)], [False, True]),
        ("nothing ready, demand above activation", [(0.0, 0.0, 0), (0.1, 1.0, 0)], [False, True]),
        ("missing metrics keep panic", [(0.0, 24.0, 2), (0.1, None, 2), (30.0, None, 2)], [True, True, True]),
        # Left only after a full stable window without the condition (last seen at 0.0: 8 ready carry the peak).
        ("stays within the stable window", [(0.0, 24.0, 2), (0.1, 4.0, 8), (59.9, 4.0, 8)], [True, True, True]),
        ("leaves after it", [(0.0, 24.0, 2), (0.1, 4.0, 8), (60.0, 4.0, 8)], [True, True, False]),
        ("a new pulse restarts the clock", [(0.0, 24.0, 2), (50.0, 24.0, 2), (100.0, 4.0, 8)], [True, True, True]),
    ],
)
def test_panic_flag(name: str, samples: list[tuple[float, float | None, int]], panic: list[bool]) -> None:
    assert [p.panic for p in _feed(samples)] == panic, name


def test_panic_demand_is_the_peak_of_the_panic_window() -> None:
    pulses = _feed([(0.0, 24.0, 2), (0.1, 4.0, 2), (5.9, 4.0, 2), (6.1, 4.0, 2)])
    assert [p.panic_demand for p in pulses] == [24.0, 24.0, 24.0, 4.0]


def test_stable_demand_is_time_weighted() -> None:
    # 4 for 30 s then 12 for 30 s (sampled every 0.1 s) averages 8, however many samples each half had.
    samples: list[tuple[float, float | None, int]] = [(i * 0.1, 4.0, 1) for i in range(300)]
    samples += [(30.0 + i * 0.01, 12.0, 1) for i in range(3000)]  # ten times the sample rate
    last = _feed(samples)[-1]
    assert last.stable_demand == pytest.approx(8.0, abs=0.1)
