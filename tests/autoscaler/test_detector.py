"""The pulse detector: time-indexed windows, the trend forecast and the panic flag, on a hand-advanced clock."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import pytest

from autoscaler.decide import detector
from autoscaler.decide.detector import MAX_BUCKETS, DetectorConfig, TimeWindow

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


# --- the edges of the windows ---


def test_a_bucket_exactly_one_span_old_has_left_the_window() -> None:
    # Windows are (now - span, now]: at +6 s the bucket of +0 s is out of a 6 s window, the one after it is in.
    w = _window([(0.0, 100.0), (0.1, 50.0), (6.0, 4.0)], span_s=12.0)
    assert w.peak(T0 + 6.0, 6.0) == 50.0
    assert w.mean(T0 + 6.0, 6.0) == pytest.approx(27.0)


def test_a_record_exactly_one_ring_older_than_the_newest_is_ignored() -> None:
    # Its ring slot is the newest bucket's: writing it would overwrite the newest value with an old one.
    w = _window([(6.0, 4.0)])
    late = T0 + 6.0 - 6.0
    assert w.key(late) == w.last_key - len(w.keys)
    assert w.record(late, 99.0) is w


def test_a_late_record_fills_its_own_empty_bucket_but_never_overwrites_one() -> None:
    w = _window([(0.2, 5.0), (0.5, 7.0)])
    late_into_empty = w.record(T0 + 0.3, 6.0)
    assert late_into_empty.mean(T0 + 0.5, 6.0) == pytest.approx(6.0)  # 5, 6, 7
    late_into_filled = w.record(T0 + 0.2, 99.0)
    assert late_into_filled.peak(T0 + 0.5, 6.0) == 7.0  # the bucket of 0.2 keeps the value it had


def test_a_one_bucket_gap_is_carried_too() -> None:
    assert _window([(0.0, 10.0), (0.2, 20.0)], carry_s=1.0).mean(T0 + 0.2, 6.0) == pytest.approx(40.0 / 3)


def test_a_carry_longer_than_the_window_fills_all_of_it() -> None:
    # A 1 s window, a 5 s carry: after 3 s of silence every bucket of the window holds the carried level.
    w = _window([(0.0, 10.0), (3.0, 20.0)], span_s=1.0, carry_s=5.0)
    assert w.mean(T0 + 3.0, 1.0) == pytest.approx((9 * 10.0 + 20.0) / 10)


def test_a_window_made_without_carry_leaves_gaps_empty() -> None:
    # The stabilisation window is made so: a recommendation must not be stretched into the silence after it.
    w = TimeWindow.empty(6.0, combine="max").record(T0, 10.0).record(T0 + 0.5, 2.0)
    assert w.carry_s == 0.0
    assert w.mean(T0 + 0.5, 6.0) == pytest.approx(6.0)


def test_after_the_clock_stepped_back_only_buckets_up_to_now_count() -> None:
    w = _window([(i * 0.1, float(i)) for i in range(11)])  # 0 .. 10 over the first second
    assert w.peak(T0 + 0.5, 6.0) == 5.0
    assert w.mean(T0 + 0.5, 6.0) == pytest.approx(2.5)  # 0 .. 5, no empty slot read as a zero, nothing newer


def test_trend_of_one_bucket_is_flat() -> None:
    assert _window([(0.0, 8.0)]).trend(T0 + 1.0, 6.0) == (8.0, 0.0)


def test_no_demand_in_the_panic_window_is_no_panic_condition() -> None:
    assert not detector.panic_condition(CFG, None, 0)


# --- the detector's readings ---


def test_forecast_of_a_falling_trend_stops_at_zero() -> None:
    # Over 4 s of history (enough for a trend), falling 20/s: the line one lead time ahead is far below zero.
    fall = [(i * 0.1, max(80.0 - i * 2.0, 0.0), 5) for i in range(40)]
    last = _feed(fall, lead_s=5.0)[-1]
    assert last.slope_per_s < 0 and last.forecast_demand == 0.0


def test_the_trend_needs_half_the_panic_window_of_history() -> None:
    cfg = DetectorConfig(panic_window_s=2.0)
    state = detector.initial(cfg)
    pulses = []
    for i in range(11):  # +1/s, over exactly 1 s: half of the 2 s panic window
        pulse, state = detector.observe(cfg, state, now=T0 + i * 0.1, demand=10.0 + i, ready=50, lead_time_s=1.0)
        pulses.append(pulse)
    assert pulses[-2].slope_per_s == 0.0 and pulses[-2].forecast_demand == 19.0  # 0.9 s: the level
    assert pulses[-1].slope_per_s == pytest.approx(10.0) and pulses[-1].forecast_demand == pytest.approx(30.0)


def _flags(pulses: list[detector.Pulse]) -> list[str]:
    return [
        ("P" if p.panic else "-") + ("c" if p.panic_condition else "") + ("+" if p.entered_panic else "")
        + ("x" if p.left_panic else "")
        for p in pulses
    ]  # fmt: skip


def test_panic_entry_and_exit_are_flagged_once() -> None:
    samples: list[tuple[float, float | None, int]] = [
        (0.0, 8.0, 2),
        (0.1, 24.0, 2),  # enters
        (0.2, 24.0, 2),  # still the condition
        (0.3, 4.0, 8),  # calm, but within a stable window
        (60.2, 4.0, 8),  # a stable window after the last condition: leaves
        (60.3, 4.0, 8),
    ]
    assert _flags(_feed(samples)) == ["-", "Pc+", "Pc", "P", "-x", "-"]


def test_panic_since_is_when_it_began() -> None:
    state = detector.initial(CFG)
    since = []
    for at_s, demand, ready in [(0.0, 24.0, 2), (0.1, 30.0, 2), (0.2, None, 2), (0.3, 4.0, 8), (60.1, 4.0, 8)]:
        _, state = detector.observe(CFG, state, now=T0 + at_s, demand=demand, ready=ready, lead_time_s=2.5)
        since.append(None if state.panic_since is None else round(state.panic_since - T0, 3))
    assert since == [0.0, 0.0, 0.0, 0.0, None]


def test_a_tick_without_demand_keeps_the_time_of_the_last_panic_condition() -> None:
    # Missing metrics are no evidence the pulse is over: panic still ends one stable window after the condition
    # last held, not at the first fresh sample after the gap.
    samples: list[tuple[float, float | None, int]] = [(0.0, 24.0, 2), (0.1, None, 2), (0.2, 4.0, 8), (59.9, 4.0, 8)]
    assert [p.panic for p in _feed(samples)] == [True, True, True, True]


def test_a_reading_without_demand_reports_the_windows_and_changes_nothing() -> None:
    samples: list[tuple[float, float | None, int]] = [(i * 0.1, 8.0 + i, 2) for i in range(40)]
    fresh = _feed(samples)[-1]
    blind = _feed([*samples, (4.0, None, 2)])[-1]
    assert fresh.fresh and not blind.fresh and blind.current is None
    # What status shows while metrics are missing: the last readings of the windows, not blanks.
    assert blind.stable_demand == pytest.approx(fresh.stable_demand)
    assert blind.panic_demand == fresh.panic_demand == 47.0
    assert blind.forecast_demand is not None and blind.forecast_demand > 47.0 and blind.slope_per_s > 0
    assert blind.capacity == 8.0 and blind.panic  # 47 >= 2 x 8: the panic it was in
    assert not (blind.panic_condition or blind.entered_panic or blind.left_panic)


def test_lengthening_the_stable_window_live_reads_over_the_new_length() -> None:
    short, long = DetectorConfig(stable_window_s=20.0), DetectorConfig(stable_window_s=60.0)
    state = detector.initial(short)
    for i in range(300):
        _, state = detector.observe(short, state, now=T0 + i * 0.1, demand=100.0, ready=50, lead_time_s=2.5)
    # Edited to 60 s, then 40 s of 4 and 20 s of 12: the stable demand is their mean over the new 60 s
    # (not 12, the mean of a window that kept its old 20 s length).
    pulse = None
    for i in range(600):
        value = 4.0 if i < 400 else 12.0
        pulse, state = detector.observe(long, state, now=T0 + 30.0 + i * 0.1, demand=value, ready=50, lead_time_s=2.5)
    assert pulse is not None and pulse.stable_demand == pytest.approx((400 * 4.0 + 200 * 12.0) / 600)


# --- a carry written as one run reads as the same buckets recorded one by one ----------------------------------------


def _replayed(w: TimeWindow) -> TimeWindow:
    """`w`'s buckets recorded afresh, oldest first, into a window never read: its aggregates start from the buckets."""
    fresh = TimeWindow.empty(w.span_s, combine=w.combine)
    for key, value in sorted(zip(w.keys.tolist(), w.values.tolist(), strict=True)):
        if key >= 0:  # a bucket never written
            fresh = fresh.record(key * w.bucket_s, value)
    return fresh


def _carried_and_explicit(
    records: Sequence[tuple[float, float]], *, span_s: float, carry_s: float, spans: Sequence[float], combine: str
) -> tuple[list[TimeWindow], list[TimeWindow], list[tuple[list[object], list[object], list[object]]]]:
    """Both windows after each record: one carrying gaps (the carry is written as a run), one without carry that is
    given every carried bucket the ring keeps as a record of its own (`_Track` takes those key by key); and both
    readings over `spans` right after each record, while each is the newest version (the running aggregates), with
    those of a window given the same buckets afresh (its aggregates built from them at the read)."""
    kind: Literal["last", "max"] = "max" if combine == "max" else "last"
    carried, explicit = TimeWindow.empty(span_s, carry_s=carry_s, combine=kind), TimeWindow.empty(span_s, combine=kind)
    reach, n = round(carry_s / carried.bucket_s), carried.n_buckets
    cs, es, readings = [], [], []
    for at_s, value in records:
        ts = 1000.0 + at_s
        last, k = carried.last_key, carried.key(ts)
        if carried.has_data and k > last + 1:
            level = carried.values[last % n]
            for key in range(max(last + 1, k - n + 1), min(k - 1, last + reach) + 1):
                explicit = explicit.record(key * carried.bucket_s, float(level))
        carried, explicit = carried.record(ts, value), explicit.record(ts, value)
        fresh = _readings(_replayed(carried), ts, spans)
        readings.append((_readings(carried, ts, spans), _readings(explicit, ts, spans), fresh))
        cs.append(carried)
        es.append(explicit)
    return cs, es, readings


def _readings(w: TimeWindow, now: float, spans: Sequence[float]) -> list[object]:
    return [(w.mean(now, s), w.peak(now, s), w.trend(now, s)) for s in spans]


CARRY_TRACES = [
    # (name, records as (seconds, value), span_s, carry_s, combine)
    # The last record raises the newest bucket of a run carried at one level (the run splits in the aggregates).
    ("steady level, 1 s apart", [(i * 1.0, 3.0) for i in range(20)] + [(19.02, 6.0)], 6.0, 1.0, "last"),
    ("level changes every record", [(i * 1.0, float(i % 4)) for i in range(20)], 6.0, 1.0, "last"),
    (
        "gaps past the carry",
        [(0.0, 1.0), (0.35, 2.5), (2.0, 4.0), (5.3, 0.5), (5.4, 9.0), (9.9, 1.0)],
        6.0,
        1.0,
        "last",
    ),
    (
        "dense records after a carry",
        [(0.0, 4.0), (1.0, 2.0)] + [(1.0 + i * 0.1, float(i)) for i in range(1, 9)],
        6.0,
        1.0,
        "last",
    ),
    ("carry longer than the ring", [(0.0, 5.0), (2.5, 7.0), (2.6, 1.0), (6.0, 2.0), (6.05, 8.0)], 1.0, 3.0, "last"),
    ("max combine", [(0.0, 5.0), (0.02, 1.0), (1.0, 7.0), (1.05, 9.0), (2.1, 2.0), (3.0, 2.0)], 2.0, 1.0, "max"),
    # A lowered newest bucket and a late record mark the tracks dirty just before a carry passes over them.
    (
        "dirty before a carry",
        [(0.0, 6.0), (0.5, 9.0), (0.52, 2.0), (1.5, 3.0), (1.2, 8.0), (2.5, 4.0)],
        6.0,
        1.0,
        "last",
    ),
    ("a long stable window", [(i * 1.0, float((7 * i) % 5)) for i in range(90)], 60.0, 1.0, "last"),
]


@pytest.mark.parametrize(
    ("name", "records", "span_s", "carry_s", "combine"), CARRY_TRACES, ids=[t[0] for t in CARRY_TRACES]
)
def test_a_carried_gap_reads_exactly_as_each_bucket_recorded(
    name: str, records: list[tuple[float, float]], span_s: float, carry_s: float, combine: str
) -> None:
    kept = [0.1, 0.3, span_s / 3, span_s]  # read after every record: their aggregates slide through the gaps
    fresh = [0.2, 0.7, span_s / 2, span_s * 2]  # first read at the end: built from the buckets
    cs, es, readings = _carried_and_explicit(records, span_s=span_s, carry_s=carry_s, spans=kept, combine=combine)
    for c, e, (got, explicitly, afresh) in zip(cs, es, readings, strict=True):
        assert (c.keys.tolist(), c.values.tolist()) == (e.keys.tolist(), e.values.tolist())  # the same buckets
        assert got == explicitly == afresh  # bit for bit: the sums are exact
    for (at_s, _), c in zip(records, cs, strict=True):  # older versions, rebuilt from the newer ones' undo
        now = 1000.0 + at_s
        assert _readings(c, now, kept + fresh) == _readings(_replayed(c), now, kept + fresh)
    last = 1000.0 + records[-1][0]
    assert _readings(cs[-1], last, fresh) == _readings(_replayed(cs[-1]), last, fresh)
