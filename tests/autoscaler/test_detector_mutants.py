"""Pinning tests for the pulse detector's details that the table and property tests leave loose (mutation survivors).

Fixed inputs, hand-computed expectations: the edges of a window read off the newest bucket (after it, or after the
clock stepped back), the least-squares line on both of its paths (running sums, one pass), the running aggregates
kept through rewritten, late and non-finite buckets, carry and ``max`` combine, older versions and equality, and every
field of `observe`'s reading and state on each of its branches.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Literal

import pytest

from autoscaler.decide import detector
from autoscaler.decide.detector import DetectorConfig, Pulse, PulseState, TimeWindow

T0 = 1_700_000_000.0


def _window(
    records: list[tuple[float, float]],
    *,
    span_s: float = 6.0,
    carry_s: float = 0.0,
    combine: Literal["last", "max"] = "last",
    read_span_s: float | None = None,
) -> TimeWindow:
    """Records (seconds after T0, value); with `read_span_s`, reads the window after each record (as `observe` does),
    so the running aggregates are kept up to date rather than built at the first read."""
    w = TimeWindow.empty(span_s, carry_s=carry_s, combine=combine)
    for at_s, value in records:
        w = w.record(T0 + at_s, value)
        if read_span_s is not None:
            w.mean(T0 + at_s, read_span_s)
    return w


def _observe(
    cfg: DetectorConfig,
    samples: list[tuple[float, float | None, int]],
    *,
    lead_s: float = 1.0,
    state: PulseState | None = None,
) -> tuple[list[Pulse], PulseState]:
    """(seconds after T0, demand, ready) -> every reading, and the last state."""
    state = detector.initial(cfg) if state is None else state
    pulses = []
    for at_s, demand, ready in samples:
        pulse, state = detector.observe(cfg, state, now=T0 + at_s, demand=demand, ready=ready, lead_time_s=lead_s)
        pulses.append(pulse)
    return pulses, state


# --- the window's shape -------------------------------------------------------------------------------------------


def test_a_window_has_one_bucket_per_tenth_of_a_second_keeping_the_last_value() -> None:
    """6 s is 60 buckets of 0.1 s (no spare one), 0.25 s rounds up to 3, 0.1 s wide up to 1200; "last" by default."""
    w = TimeWindow.empty(6.0)
    assert (w.n_buckets, w.bucket_s, w.span_s, w.carry_s, w.combine) == (60, 0.1, 6.0, 0.0, "last")
    assert TimeWindow.empty(0.25).n_buckets == 3
    tiny = TimeWindow.empty(0.05)  # never less than one bucket
    assert (tiny.n_buckets, tiny.span_s) == (1, 0.1)
    widest = TimeWindow.empty(119.95)  # 1200 buckets: still 0.1 s wide; only more would widen them
    assert (widest.n_buckets, widest.bucket_s) == (1200, 0.1)
    assert TimeWindow.empty(0.3).values.tolist() == [0.0, 0.0, 0.0]  # slots never written read as zero


def test_first_ts_is_the_earliest_sample_recorded_even_when_it_came_late() -> None:
    """`first_ts` is the earliest timestamp recorded, whatever order samples came in; an empty window has none."""
    w = TimeWindow.empty(6.0)
    assert w.first_ts is None
    w = w.record(T0 + 1.0, 4.0)
    assert w.first_ts == T0 + 1.0
    w = w.record(T0 + 0.5, 3.0)  # late
    assert w.first_ts == T0 + 0.5
    w = w.record(T0 + 2.0, 5.0)
    assert w.first_ts == T0 + 0.5


# --- reading off the newest bucket (the general path) -------------------------------------------------------------


def test_read_after_the_newest_bucket_the_window_ends_one_span_before_now() -> None:
    """Read after the newest sample, ``(now - span, now]`` drops the bucket one span old and keeps the next one."""
    w = _window([(0.0, 100.0), (0.1, 50.0)], span_s=12.0)
    keys, values = w.select(T0 + 6.0, 6.0)
    assert keys.tolist() == [w.key(T0 + 0.1)] and values.tolist() == [50.0]
    assert w.peak(T0 + 6.0, 6.0) == 50.0
    assert w.mean(T0 + 6.0, 6.0) == 50.0


def test_after_the_clock_stepped_back_the_window_still_starts_one_span_before_now() -> None:
    """Read at a time before the newest sample, the window is ``(now - span, now]``: nothing older, nothing newer."""
    w = _window([(0.0, 100.0), (3.0, 4.0), (7.0, 1.0)], span_s=12.0)
    keys, values = w.select(T0 + 6.5, 6.0)
    assert keys.tolist() == [w.key(T0 + 3.0)] and values.tolist() == [4.0]
    assert w.peak(T0 + 6.5, 6.0) == 4.0
    assert w.mean(T0 + 6.5, 6.0) == 4.0


# --- the least-squares line -----------------------------------------------------------------------------------------


def test_the_trend_of_one_bucket_is_its_value_and_flat_on_both_paths() -> None:
    """One bucket: the line is its value with slope 0, read at its own bucket or later."""
    w = _window([(0.0, 8.0)])
    assert w.trend(T0, 6.0) == (8.0, 0.0)
    assert w.trend(T0 + 0.3, 6.0) == (8.0, 0.0)


def test_the_trend_of_two_buckets_is_the_line_through_them() -> None:
    """Two buckets 2 then 4, 0.1 s apart: slope 20/s; the level at their newest bucket is 4 and one bucket later 6."""
    w = _window([(0.0, 2.0), (0.1, 4.0)])
    assert w.trend(T0 + 0.1, 6.0) == pytest.approx((4.0, 20.0), rel=1e-12)
    assert w.trend(T0 + 0.2, 6.0) == pytest.approx((6.0, 20.0), rel=1e-12)


def test_a_trend_read_after_the_newest_bucket_extrapolates_to_now() -> None:
    """1, 2, 3, 4 over 0.3 s (10/s): the level is 4 at the last bucket and 5 one bucket after it."""
    w = _window([(0.0, 1.0), (0.1, 2.0), (0.2, 3.0), (0.3, 4.0)])
    assert w.trend(T0 + 0.3, 0.6) == pytest.approx((4.0, 10.0), rel=1e-12)
    assert w.trend(T0 + 0.4, 0.6) == pytest.approx((5.0, 10.0), rel=1e-12)


def test_the_trend_kept_while_recording_is_the_fit_over_the_last_span() -> None:
    """Read after every record (running sums slid along): the fit over the last 0.5 s only, at the newest bucket."""
    values = [9.0] * 5 + [1.0, 5.0, 2.0, 8.0, 3.0]
    w = _window([(i * 0.1, v) for i, v in enumerate(values)], span_s=0.5, read_span_s=0.5)
    # 1, 5, 2, 8, 3 at -4 .. 0 buckets: mean 3.8, slope 0.7 per bucket (7/s), level 3.8 + 2 x 0.7 at the newest.
    assert w.trend(T0 + 0.9, 0.5) == pytest.approx((5.2, 7.0), rel=1e-12)
    assert w.trend(T0 + 0.95, 0.5) == pytest.approx((5.2, 7.0), rel=1e-12)  # the same bucket
    assert w.mean(T0 + 0.9, 0.5) == pytest.approx(3.8, rel=1e-12)
    assert w.peak(T0 + 0.9, 0.5) == 8.0
    # One bucket later the oldest has left: 5, 2, 8, 3 at -4 .. -1 fit a flat line at their mean.
    assert w.trend(T0 + 1.0, 0.5) == pytest.approx((4.5, 0.0), abs=1e-12)


def test_the_trend_kept_while_recording_tracks_a_falling_then_rising_series() -> None:
    """Each reading of a window read as it records equals the least-squares line over its last 0.4 s."""
    series = [4.0, 1.0, 7.0, 3.0, 3.0, 9.0]
    w = TimeWindow.empty(0.4)
    got = []
    for i, v in enumerate(series):
        w = w.record(T0 + i * 0.1, v)
        got.append(w.trend(T0 + i * 0.1, 0.4))
    # By hand: (level at the newest bucket, slope per second) over the up to 4 newest buckets.
    # e.g. 4, 1, 7, 3: mean 3.75 at -1.5 buckets, slope 1.5 / 5 = 0.3 per bucket (3/s), level 3.75 + 1.5 x 0.3.
    want = [(4.0, 0.0), (1.0, -30.0), (5.5, 15.0), (4.2, 3.0), (3.8, 2.0), (6.4, 6.0)]
    assert got == [pytest.approx(x, abs=1e-9) for x in want]


# --- the running aggregates ----------------------------------------------------------------------------------------


def test_rewriting_the_newest_bucket_updates_mean_peak_and_trend() -> None:
    """Samples landing in the newest bucket replace its value, up or down, in every reading taken at that bucket."""
    w = _window([(0.0, 2.0), (0.1, 4.0)], read_span_s=6.0)
    w = w.record(T0 + 0.15, 10.0)  # the same bucket as 0.1, higher
    assert (w.mean(T0 + 0.15, 6.0), w.peak(T0 + 0.15, 6.0)) == (6.0, 10.0)
    assert w.trend(T0 + 0.15, 6.0) == pytest.approx((10.0, 80.0), rel=1e-12)
    w = w.record(T0 + 0.17, 3.0)  # lower: the old peak must go
    assert (w.mean(T0 + 0.17, 6.0), w.peak(T0 + 0.17, 6.0)) == (2.5, 3.0)
    assert w.trend(T0 + 0.17, 6.0) == pytest.approx((3.0, 10.0), rel=1e-12)
    w = w.record(T0 + 0.18, 5.0)
    assert (w.mean(T0 + 0.18, 6.0), w.peak(T0 + 0.18, 6.0)) == (3.5, 5.0)
    assert w.trend(T0 + 0.18, 6.0) == pytest.approx((5.0, 30.0), rel=1e-12)


def test_a_late_sample_into_an_empty_bucket_counts_in_readings_taken_before_it() -> None:
    """A late sample filling an empty bucket is seen by a window that was already being read."""
    w = _window([(0.2, 5.0), (0.5, 7.0)], read_span_s=6.0)
    assert w.mean(T0 + 0.5, 6.0) == 6.0
    w = w.record(T0 + 0.3, 9.0)
    assert (w.mean(T0 + 0.5, 6.0), w.peak(T0 + 0.5, 6.0)) == (7.0, 9.0)


def test_a_late_max_into_an_old_bucket_reaches_only_the_spans_that_hold_it() -> None:
    """A late higher recommendation raises its own bucket: a span that holds it sees it, a shorter one does not."""
    w = _window([(i * 0.1, 1.0) for i in range(11)], combine="max", read_span_s=0.3)
    w = w.record(T0, 99.0)  # bucket 0, far outside the last 0.3 s
    assert (w.peak(T0 + 1.0, 0.3), w.mean(T0 + 1.0, 0.3)) == (1.0, 1.0)
    assert w.peak(T0 + 1.0, 6.0) == 99.0
    w = w.record(T0 + 0.9, 50.0)  # inside the last 0.3 s
    assert w.peak(T0 + 1.0, 0.3) == 50.0
    assert w.mean(T0 + 1.0, 0.3) == pytest.approx(52.0 / 3, rel=1e-12)


def test_a_max_window_does_not_combine_with_a_value_from_an_earlier_lap() -> None:
    """``max`` combines values of one bucket, never a new bucket with the slot's value from an earlier lap."""
    w = _window([(0.0, 10.0), (0.3, 2.0)], span_s=0.3, combine="max")  # 3 slots: 0.3 reuses the slot of 0.0
    assert w.peak(T0 + 0.3, 0.3) == 2.0
    assert w.values.max() == 2.0


def test_infinite_values_are_read_without_the_exact_sums() -> None:
    """A non-finite value has no exact running sum: mean and peak read it anyway, before and after it arrives."""
    w = _window([(0.0, 4.0)], read_span_s=6.0)
    w = w.record(T0 + 0.1, math.inf)
    assert w.peak(T0 + 0.1, 6.0) == math.inf
    assert w.mean(T0 + 0.1, 6.0) == math.inf
    fresh = _window([(0.0, 4.0), (0.1, math.inf)])  # never read before the infinity came
    assert (fresh.peak(T0 + 0.1, 6.0), fresh.mean(T0 + 0.1, 6.0)) == (math.inf, math.inf)
    first = _window([(0.0, math.inf)])  # the very first value of the window
    assert (first.peak(T0, 6.0), first.mean(T0, 6.0)) == (math.inf, math.inf)


def test_a_span_longer_than_the_ring_reads_only_what_the_ring_holds() -> None:
    """Over 2 s of a 1 s window read as it records, mean and peak cover the ring's last 1 s, not buckets it lost."""
    w = _window([(i * 0.1, float(i)) for i in range(20)], span_s=1.0, read_span_s=2.0)
    assert w.mean(T0 + 1.9, 2.0) == pytest.approx(14.5, rel=1e-12)  # 10 .. 19
    assert w.peak(T0 + 1.9, 2.0) == 19.0


def test_a_bucket_exactly_one_span_old_leaves_the_running_aggregates() -> None:
    """Read as it records, a 0.3 s window drops each bucket as the third one after it arrives."""
    w = TimeWindow.empty(6.0)
    got = []
    for i, v in enumerate([9.0, 1.0, 2.0, 3.0, 0.5]):
        w = w.record(T0 + i * 0.1, v)
        got.append((w.peak(T0 + i * 0.1, 0.3), w.mean(T0 + i * 0.1, 0.3)))
    assert got == [(9.0, 9.0), (9.0, 5.0), (9.0, 4.0), (3.0, 2.0), (3.0, pytest.approx(5.5 / 3, rel=1e-12))]


def test_a_mean_read_at_the_newest_bucket_is_the_exact_mean_rounded_once() -> None:
    """The running sums are exact: 0.1, 0.2, 0.3 average to 0.2 exactly, over the ring's whole 0.3 s and over less.

    Summing the floats first (0.1 + 0.2 is 0.30000000000000004) gives 0.20000000000000004 or 0.19999999999999998,
    whatever the order; the reference is the exact rational mean of the three doubles, rounded once."""
    w = _window([(0.0, 0.1), (0.1, 0.2), (0.2, 0.3)], span_s=0.3)
    exact = float(sum(map(Fraction, [0.1, 0.2, 0.3])) / 3)
    assert exact == 0.2
    assert w.mean(T0 + 0.2, 0.3) == exact  # the span is the whole ring: 3 buckets of 3
    assert w.mean(T0 + 0.2, 0.2) == float((Fraction(0.2) + Fraction(0.3)) / 2)  # 0.25


def test_a_span_shorter_than_a_bucket_holds_nothing_at_the_newest_bucket() -> None:
    """``(now - 0, now]`` holds no bucket: mean, peak and trend read None at the newest bucket and after it."""
    w = _window([(0.0, 5.0), (0.1, 7.0)])
    assert (w.mean(T0 + 0.1, 0.0), w.peak(T0 + 0.1, 0.0), w.trend(T0 + 0.1, 0.0)) == (None, None, None)
    assert (w.mean(T0 + 0.3, 0.0), w.peak(T0 + 0.3, 0.0), w.trend(T0 + 0.3, 0.0)) == (None, None, None)
    tiny = _window([(0.0, 5.0)])
    assert (tiny.mean(T0, 1e-12), tiny.peak(T0, 1e-12)) == (None, None)  # under one bucket: none of it


def test_a_carry_longer_than_the_ring_fills_only_the_buckets_the_ring_keeps() -> None:
    """A 0.3 s ring carrying 1 s: 5 at 0.0, then 7 at 1.2. The 5 is carried to 1.0, but of the carried buckets only
    1.0 is still inside the ring when 1.2 arrives (1.1 is past the carry); nothing older, such as 0.8, is left in it.

    Read over 1 s (longer than the ring: what it holds), the window is 1.0 -> 5 and 1.2 -> 7."""
    w = _window([(0.0, 5.0), (1.2, 7.0)], span_s=0.3, carry_s=1.0)
    held = sorted(k - w.key(T0) for k in w.keys.tolist() if k >= w.key(T0))
    assert held == [10, 12]
    assert w.mean(T0 + 1.2, 1.0) == 6.0
    assert w.peak(T0 + 1.2, 1.0) == 7.0
    assert sorted(w.values.tolist()) == [0.0, 5.0, 7.0]  # the third slot was never written


# --- versions ------------------------------------------------------------------------------------------------------


def test_an_older_version_reads_and_compares_as_it_did_before_the_newer_record() -> None:
    """Recording leaves the older window as it was: its readings, its buckets and its equality."""
    before = _window([(0.0, 1.0)])
    after = before.record(T0 + 0.1, 9.0)
    assert before.peak(T0, 6.0) == 1.0 and before.mean(T0, 6.0) == 1.0
    assert before.trend(T0, 6.0) == (1.0, 0.0)
    assert before == _window([(0.0, 1.0)])
    assert after == _window([(0.0, 1.0), (0.1, 9.0)])
    assert before != after
    again = before.record(T0 + 0.1, 2.0)  # an older version recorded into again
    assert again.mean(T0 + 0.1, 6.0) == 1.5 and after.mean(T0 + 0.1, 6.0) == 5.0


def test_windows_are_equal_when_their_buckets_are() -> None:
    """Equality compares buckets: the same records give equal windows, one different value does not."""
    assert _window([(0.0, 1.0), (0.1, 2.0)]) == _window([(0.0, 1.0), (0.1, 2.0)])
    assert _window([(0.0, 1.0), (0.1, 2.0)]) != _window([(0.0, 1.0), (0.1, 3.0)])


# --- the panic condition --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("demand", "ready", "want"),
    [
        (0.0, 0, False),  # nothing ready, no demand above the activation depth (2)
        (2.0, 0, False),  # at the activation depth: not above it
        (2.5, 0, True),
        (4.0, 1, False),  # one ready: 2 x 1 x 4 = 8 is the line
        (8.0, 1, True),
        (23.9, 3, False),  # 2 x 3 x 4 = 24
        (24.0, 3, True),
    ],
)
def test_the_panic_condition_is_a_multiple_of_capacity_or_above_activation_with_none_ready(
    demand: float, ready: int, want: bool
) -> None:
    """Panic demand >= threshold x ready x target; with none ready, above the activation depth."""
    cfg = DetectorConfig(panic_threshold=2.0, target_queue_depth=4.0, activation_queue_depth=2.0)
    assert detector.panic_condition(cfg, demand, ready) is want


# --- observe: every field of the reading ---------------------------------------------------------------------------


def test_a_flat_fit_forecasts_its_level_even_below_the_current_demand() -> None:
    """20, 10, 20 fit slope 0 exactly: the forecast is the level 50/3, under the current 20 (only a rise lifts it)."""
    cfg = DetectorConfig(panic_window_s=0.4)
    pulses, _ = _observe(cfg, [(0.0, 20.0, 3), (0.1, 10.0, 3), (0.2, 20.0, 3)])
    assert pulses[-1] == Pulse(
        fresh=True,
        current=20.0,
        stable_demand=50.0 / 3,
        panic_demand=20.0,
        forecast_demand=50.0 / 3,
        slope_per_s=0.0,
        capacity=12.0,
        panic=False,
        panic_condition=False,
        entered_panic=False,
        left_panic=False,
    )


def test_a_gentle_rise_forecasts_at_least_the_current_demand() -> None:
    """0, 0, 0.125 (slope 0.625/s): the line one short lead ahead is below 0.125, so the forecast is the demand."""
    cfg = DetectorConfig(panic_window_s=0.4)
    pulses, _ = _observe(cfg, [(0.0, 0.0, 3), (0.1, 0.0, 3), (0.2, 0.125, 3)], lead_s=0.01)
    assert pulses[-1].slope_per_s == pytest.approx(0.625, rel=1e-12)
    assert pulses[-1].forecast_demand == 0.125


def test_the_initial_state_is_out_of_panic_with_an_empty_window_shaped_by_the_config() -> None:
    """`initial`: no panic, and an empty window over the longer of the two windows, carrying gaps by `carry_s`."""
    state = detector.initial(DetectorConfig(stable_window_s=2.0, panic_window_s=3.0, carry_s=0.5))
    assert (state.panic, state.panic_since, state.panic_condition_at) == (False, None, None)
    w = state.window
    assert (w.span_s, w.carry_s, w.combine, w.n_buckets, w.has_data, w.first_ts) == (3.0, 0.5, "last", 30, False, None)


def test_capacity_is_ready_replicas_times_the_target_never_negative() -> None:
    """capacity = max(ready, 0) x target queue depth (4 here)."""
    cfg = DetectorConfig()
    got = [_observe(cfg, [(0.0, 1.0, ready)])[0][-1].capacity for ready in (0, 3, -1)]
    assert got == [0.0, 12.0, 0.0]


def test_a_first_reading_without_demand_reads_nothing() -> None:
    """No sample ever: no demand, no forecast, flat, nothing flagged."""
    pulses, state = _observe(DetectorConfig(), [(0.0, None, 2)])
    assert pulses[-1] == Pulse(False, None, None, None, None, 0.0, 8.0, False, False, False, False)
    assert (state.panic, state.panic_since, state.panic_condition_at) == (False, None, None)
    assert not state.window.has_data


def test_a_blind_reading_in_the_last_samples_bucket_forecasts_its_level() -> None:
    """Without demand, in the bucket of a lone sample of 7: forecast 7 (the level), panic demand 7."""
    pulses, _ = _observe(DetectorConfig(), [(0.0, 7.0, 2), (0.05, None, 2)])
    assert pulses[-1] == Pulse(False, None, 7.0, 7.0, 7.0, 0.0, 8.0, False, False, False, False)


def test_a_blind_reading_after_a_short_history_forecasts_the_newest_level() -> None:
    """Without demand, 0.4 s after 3 then 7 (too little history for a slope): the forecast is the newest value, 7."""
    pulses, _ = _observe(DetectorConfig(), [(0.0, 3.0, 2), (0.1, 7.0, 2), (0.5, None, 2)])
    assert pulses[-1] == Pulse(False, None, 5.0, 7.0, 7.0, 0.0, 8.0, False, False, False, False)


def test_a_blind_reading_after_a_long_history_forecasts_the_line_to_now() -> None:
    """Without demand, 0.1 s after a ramp of 1/s over 0.4 s of a 0.4 s panic window, the line read at now, ahead."""
    cfg = DetectorConfig(panic_window_s=0.4, carry_s=0.0)
    samples: list[tuple[float, float | None, int]] = [(i * 0.1, 1.0 + i * 0.1, 9) for i in range(5)]
    pulses, _ = _observe(cfg, [*samples, (0.5, None, 9)], lead_s=2.0)
    blind = pulses[-1]
    # Buckets 0.2 .. 0.4 hold 1.2, 1.3, 1.4: at 0.5 the line reads 1.5, two seconds ahead 3.5.
    assert blind.slope_per_s == pytest.approx(1.0, rel=1e-9)
    assert blind.forecast_demand == pytest.approx(3.5, rel=1e-9)
    assert (blind.panic_demand, blind.fresh, blind.current) == (1.4, False, None)


def test_a_blind_reading_long_after_the_panic_window_has_no_panic_demand_or_forecast() -> None:
    """Without demand, 10 s after the only sample: the panic window is empty, the stable one still holds it."""
    pulses, _ = _observe(DetectorConfig(), [(0.0, 5.0, 2), (10.0, None, 2)])
    assert pulses[-1] == Pulse(False, None, 5.0, None, None, 0.0, 8.0, False, False, False, False)


def test_after_the_clock_stepped_back_a_short_history_forecasts_the_demand_just_seen() -> None:
    """A sample for a bucket already filled (clock stepped back) keeps the bucket, but the level forecast is it."""
    pulses, _ = _observe(DetectorConfig(), [(0.0, 5.0, 2), (0.1, 9.0, 2), (0.0, 20.0, 2)])
    assert pulses[-1].forecast_demand == 20.0 and pulses[-1].current == 20.0
    assert pulses[-1].panic_demand == 5.0  # only buckets up to now, and the filled one kept its value


def test_a_panic_window_shorter_than_a_bucket_sees_no_demand_at_the_first_reading() -> None:
    """A panic window under one bucket (the spec allows any positive length) covers ``(now, now]``: no bucket. The
    first reading has a stable demand but no panic demand, no forecast and no panic, whatever the demand."""
    for panic_window_s in (0.0, 1e-12):
        cfg = DetectorConfig(panic_window_s=panic_window_s)
        pulses, state = _observe(cfg, [(0.0, 100.0, 1)])
        assert pulses[-1] == Pulse(True, 100.0, 100.0, None, None, 0.0, 4.0, False, False, False, False)
        assert (state.panic, state.panic_since, state.panic_condition_at) == (False, None, None)


def test_a_blind_reading_in_panic_keeps_the_state_and_flags_nothing() -> None:
    """Missing demand while in panic: the reading says panic, no condition, no entry or exit; the state is kept."""
    cfg = DetectorConfig()
    pulses, state = _observe(cfg, [(0.0, 24.0, 2), (0.1, None, 2)])
    assert pulses[-1] == Pulse(False, None, 24.0, 24.0, 24.0, 0.0, 8.0, True, False, False, False)
    assert (state.panic, state.panic_since, state.panic_condition_at) == (True, T0, T0)
    assert state.window.last_key == state.window.key(T0)


def test_entering_and_staying_in_panic_sets_the_state_exactly() -> None:
    """Entering panic records when; a later condition moves only the condition time; a calm reading flags nothing."""
    cfg = DetectorConfig()
    pulses, state = _observe(cfg, [(0.0, 8.0, 2), (0.1, 24.0, 2)])
    assert (pulses[0].panic, pulses[0].panic_condition, pulses[0].entered_panic, pulses[0].left_panic) == (
        False, False, False, False)  # fmt: skip
    assert (pulses[1].panic, pulses[1].panic_condition, pulses[1].entered_panic, pulses[1].left_panic) == (
        True, True, True, False)  # fmt: skip
    assert (state.panic, state.panic_since, state.panic_condition_at) == (True, T0 + 0.1, T0 + 0.1)
    pulses, state = _observe(cfg, [(0.2, 30.0, 2), (0.3, 4.0, 50)], state=state)
    assert pulses[0].entered_panic is False and pulses[0].left_panic is False
    assert (pulses[1].panic, pulses[1].panic_condition, pulses[1].entered_panic, pulses[1].left_panic) == (
        True, False, False, False)  # fmt: skip
    assert (state.panic, state.panic_since, state.panic_condition_at) == (True, T0 + 0.1, T0 + 0.2)


def test_calm_s_sets_how_long_panic_outlasts_its_condition() -> None:
    """With calm_s 5, panic ends 5 s after the condition last held, not a stable window (60 s) after."""
    cfg = DetectorConfig(calm_s=5.0)
    pulses, state = _observe(cfg, [(0.0, 24.0, 2), (4.9, 4.0, 50), (5.0, 4.0, 50)])
    assert [p.panic for p in pulses] == [True, True, False]
    assert pulses[-1].left_panic is True
    assert (state.panic, state.panic_since, state.panic_condition_at) == (False, None, T0)


def test_a_panic_with_no_recorded_condition_time_ends_at_the_first_calm_reading() -> None:
    """A state in panic without the time its condition last held (nothing to wait from) leaves at once."""
    cfg = DetectorConfig()
    start = PulseState(detector.initial(cfg).window, panic=True, panic_since=T0, panic_condition_at=None)
    pulses, state = _observe(cfg, [(1.0, 1.0, 8)], state=start)
    assert (pulses[0].panic, pulses[0].left_panic) == (False, True)
    assert (state.panic, state.panic_since) == (False, None)


def test_changing_only_the_carry_restarts_the_window_with_the_new_carry() -> None:
    """A new carry_s (same windows) starts an empty window that carries gaps by the new limit."""
    before = DetectorConfig(carry_s=0.0)
    after = DetectorConfig(carry_s=1.0)
    _, state = _observe(before, [(0.0, 100.0, 50)])
    pulses, state = _observe(after, [(0.5, 4.0, 50), (1.0, 8.0, 50)], state=state)
    assert state.window.carry_s == 1.0
    assert pulses[0].stable_demand == 4.0  # the 100 went with the old window
    assert pulses[1].stable_demand == pytest.approx((5 * 4.0 + 8.0) / 6, rel=1e-12)  # 4 carried over 0.6 .. 0.9


# --- carried runs and rewrites (the run-keeping track) --------------------------------------------------------------


def _kept_and_fresh(
    records: list[tuple[float, float]], span_s: float, *, carry_s: float = 0.0
) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    """(mean, peak, trend) over `span_s` after each record (at `ts`, value), read as the window records (its running
    track) and read from a copy recorded the same way but never read before (rebuilt from the buckets)."""
    kept, fresh = [], []
    w = TimeWindow.empty(6.0, carry_s=carry_s)
    for i, (ts, value) in enumerate(records):
        w = w.record(ts, value)
        kept.append((w.mean(ts, span_s), w.peak(ts, span_s), w.trend(ts, span_s)))
        f = TimeWindow.empty(6.0, carry_s=carry_s)
        for earlier in records[: i + 1]:
            f = f.record(*earlier)
        fresh.append((f.mean(ts, span_s), f.peak(ts, span_s), f.trend(ts, span_s)))
    return kept, fresh


def test_a_carried_run_longer_than_the_span_enters_only_as_far_as_the_span_reaches() -> None:
    """A 0.1 s span read as it records: 5 carried from bucket 0 over 1 and 2 (the level held, one run) leaves only
    bucket 2 in the span, so rewriting bucket 2 to 9 reads 9 alone, flat (not the carried 5 of bucket 1 as well)."""
    w = _window([(0.0, 5.0)], carry_s=0.1, read_span_s=0.1)
    w = w.record(T0 + 0.2, 5.0)
    assert w.mean(T0 + 0.2, 0.1) == 5.0
    w = w.record(T0 + 0.25, 9.0)  # the same bucket
    assert (w.mean(T0 + 0.25, 0.1), w.peak(T0 + 0.25, 0.1), w.trend(T0 + 0.25, 0.1)) == (9.0, 9.0, (9.0, 0.0))


def test_equal_values_either_side_of_an_empty_bucket_stay_two_runs() -> None:
    """Buckets 0 and 2 hold the same value, bucket 1 nothing: sliding a 0.3 s span past them reads as a rebuilt
    window does. The value is the least positive float, whose exact fixed-point sum is 1 (a key's size, not a
    value's: a run must be joined by adjacent keys and equal values, never by a value that happens to equal a key)."""
    tiny = math.ulp(0.0)
    kept, fresh = _kept_and_fresh([(0.0, tiny), (0.2, tiny), (0.3, 1.0), (0.4, 1.0), (0.5, 1.0)], 0.3)
    assert kept == fresh
    assert kept[3][0] == pytest.approx(2 / 3, rel=1e-12)  # tiny, 1, 1 at 0.2 .. 0.4


def test_rewriting_the_end_of_a_carried_run_and_sliding_past_it_reads_as_a_rebuilt_window() -> None:
    """5 carried over 0.1 and 0.2 (one run 0 .. 0.2), the newest bucket rewritten up to 9 (split off the run; a rewrite
    down would rebuild the track), then new buckets push the run out of a 0.4 s span: every reading equals that of a
    window never read before."""
    records = [(0.0, 5.0), (0.2, 5.0), (0.25, 9.0), *[(0.1 * i, float(i)) for i in range(3, 8)]]
    kept, fresh = _kept_and_fresh(records, 0.4, carry_s=0.2)
    assert kept == fresh
    assert kept[-1][0] == 5.5  # 4, 5, 6, 7


def test_rewriting_the_newest_bucket_under_a_zero_span_still_reads_nothing() -> None:
    """A zero span read at the newest bucket holds no bucket, and its mean and trend still none after that bucket is
    rewritten (the peak is left out: a width-0 track's peak after a rewrite is a known gap, not pinned here)."""
    w = _window([(0.0, 5.0)])
    assert w.mean(T0, 0.0) is None
    w = w.record(T0 + 0.05, 7.0)  # the same bucket
    assert (w.mean(T0 + 0.05, 0.0), w.trend(T0 + 0.05, 0.0)) == (None, None)


def test_a_level_equal_but_not_identical_to_the_carried_one_is_stored_as_recorded() -> None:
    """Carrying ends where a new value lands: -0.0 after a carried 0.0, or 5.0 after a carried int 5 (and the other
    way round), is kept as recorded (its sign, its type), not replaced by the carried value it compares equal to."""
    w = _window([(0.0, 0.0), (0.2, -0.0)], carry_s=0.1)
    assert math.copysign(1.0, w.values[w.key(T0 + 0.2) % w.n_buckets]) == -1.0
    for carried, value in ((5, 5.0), (5.0, 5)):
        w = _window([(0.0, carried), (0.2, value)], carry_s=0.1)
        assert type(w.peak(T0 + 0.2, 0.1)) is type(value)


def test_a_carried_finite_level_keeps_the_exact_mean() -> None:
    """Carrying 0.1 over a gap keeps the exact running sums: 0.1, 0.2, 0.3 still average to exactly 0.2 (a float sum,
    0.30000000000000004 + 0.3, would give 0.20000000000000004)."""
    w = _window([(0.0, 0.1), (0.2, 0.1), (0.3, 0.2), (0.4, 0.3)], carry_s=0.1, read_span_s=0.3)
    assert w.mean(T0 + 0.4, 0.3) == float(sum(map(Fraction, [0.1, 0.2, 0.3])) / 3) == 0.2


def test_a_carried_infinity_is_read_without_the_exact_sums() -> None:
    """An infinite level carried over a gap is read (mean and peak infinite), not summed exactly."""
    w = _window([(0.0, math.inf), (0.2, 1.0)], carry_s=0.1)
    assert (w.mean(T0 + 0.2, 0.3), w.peak(T0 + 0.2, 0.3)) == (math.inf, math.inf)


def test_a_late_sample_equal_to_the_newest_level_fills_its_empty_bucket() -> None:
    """With carrying on, a late sample into an empty bucket is recorded even when it equals the newest level."""
    w = _window([(0.0, 5.0), (0.3, 7.0)], carry_s=0.1)  # 5 carried into 0.1; 0.2 stays empty
    w = w.record(T0 + 0.2, 7.0)
    assert w.mean(T0 + 0.3, 0.4) == 6.0  # 5, 5, 7, 7


def test_a_gap_longer_than_the_carry_stays_empty_even_when_the_level_returns() -> None:
    """5, then 5 again 0.3 s later with a 0.1 s carry: 0.1 holds the carried 5, 0.2 stays empty."""
    w = _window([(0.0, 5.0), (0.3, 5.0)], carry_s=0.1)
    keys, _ = w.select(T0 + 0.3, 0.4)
    assert (keys - w.key(T0)).tolist() == [0, 1, 3]
