"""Pulse detector: time-indexed demand windows, a trend forecast one lead time ahead, and Knative's panic flag.

Pure: numpy and the standard library only, time is always an argument, state goes in and comes out frozen.

Windows are rings of time buckets keyed by ``floor(ts / bucket_s)`` (Knative's ``aggregation`` package works the
same way), so a burst of samples lands in one bucket and a late tick leaves a gap instead of skewing an average.
The arrays of a stored window are read-only; recording copies them (copy-on-write, a few microseconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "BUCKET_S",
    "MAX_BUCKETS",
    "TREND_MIN_COVER",
    "DetectorConfig",
    "Pulse",
    "PulseState",
    "TimeWindow",
    "initial",
    "observe",
    "panic_condition",
]

BUCKET_S: Final = 0.1
"""Bucket width: gateways publish every <= 100 ms, so one bucket holds about one sample per gateway."""
MAX_BUCKETS: Final = 1200
"""Caps the copy-on-write cost of a long window: a window over 120 s gets wider buckets instead of more."""

TREND_MIN_COVER: Final = 0.5
"""The trend needs data over at least this share of the panic window; with less, the forecast is the level."""

_EMPTY_KEY: Final = -(2**62)  # a bucket never written; below every real key
_KEY_SLACK: Final = 1e-3  # of a bucket: `t0 + 0.1 * i` must land in bucket i despite float rounding

_Keys = npt.NDArray[np.int64]
_Values = npt.NDArray[np.float64]


def _read_only(array: npt.NDArray[np.generic]) -> None:
    array.flags.writeable = False


@dataclass(frozen=True, slots=True)
class TimeWindow:
    """A ring of `len(keys)` time buckets of `bucket_s` seconds covering `span_s` seconds.

    `keys[i]` is the absolute bucket index slot `i` holds (so a slot left over from an earlier lap of the ring is
    recognised as old by its key, not by clearing it). `combine` says what one bucket keeps when several values land
    in it: the ``last`` (a level signal such as queue depth: the newest value is the truth) or the ``max``
    (recommendations, where the stabilisation window wants the highest). Over a gap between records of up to
    `carry_s` the previous value is carried forward (a level holds until the next sample says otherwise); a longer
    gap stays empty, which queries treat as "no data", never as zero.
    """

    span_s: float
    bucket_s: float
    keys: _Keys
    values: _Values
    last_key: int = _EMPTY_KEY
    first_ts: float | None = None
    carry_s: float = 0.0
    combine: Literal["last", "max"] = "last"

    @classmethod
    def empty(
        cls,
        span_s: float,
        *,
        carry_s: float = 0.0,
        combine: Literal["last", "max"] = "last",
        bucket_s: float = BUCKET_S,
    ) -> TimeWindow:
        span_s = max(span_s, bucket_s)
        n = math.ceil(span_s / bucket_s - 1e-9)
        if n > MAX_BUCKETS:
            n, bucket_s = MAX_BUCKETS, span_s / MAX_BUCKETS
        keys = np.full(n, _EMPTY_KEY, dtype=np.int64)
        values = np.zeros(n, dtype=np.float64)
        _read_only(keys)
        _read_only(values)
        return cls(span_s, bucket_s, keys, values, carry_s=carry_s, combine=combine)

    def key(self, ts: float) -> int:
        return math.floor(ts / self.bucket_s + _KEY_SLACK)

    @property
    def has_data(self) -> bool:
        return self.last_key != _EMPTY_KEY

    def record(self, ts: float, value: float) -> TimeWindow:
        """A new window with `value` recorded at `ts`; this one is unchanged."""
        n = len(self.keys)
        k = self.key(ts)
        last = self.last_key
        if last != _EMPTY_KEY and k <= last - n:
            return self  # older than the whole ring: nothing it could still change
        keys = self.keys.copy()
        values = self.values.copy()
        if last != _EMPTY_KEY and k > last + 1 and self.carry_s > 0:
            carried = float(values[last % n])
            fill_to = min(k - 1, last + math.floor(self.carry_s / self.bucket_s + _KEY_SLACK))
            fill_from = max(last + 1, k - n + 1)  # buckets that stay inside the ring
            if fill_to >= fill_from:
                filled = np.arange(fill_from, fill_to + 1, dtype=np.int64)
                keys[filled % n] = filled
                values[filled % n] = carried
        pos = k % n
        if keys[pos] == k and self.combine == "max":
            values[pos] = max(float(values[pos]), value)
        elif keys[pos] != k or k >= last:  # a late value never overwrites a newer one in its bucket
            keys[pos] = k
            values[pos] = value
        _read_only(keys)
        _read_only(values)
        return TimeWindow(
            self.span_s,
            self.bucket_s,
            keys,
            values,
            max(last, k),
            ts if self.first_ts is None else min(self.first_ts, ts),
            self.carry_s,
            self.combine,
        )

    def select(self, now: float, span_s: float) -> tuple[_Keys, _Values]:
        """Keys and values of the buckets with data in ``(now - span_s, now]``."""
        k_now = self.key(now)
        m = math.ceil(span_s / self.bucket_s - 1e-9)
        mask = self.keys > k_now - m
        if k_now < self.last_key:  # only after the clock stepped back; usually nothing is newer than now
            mask &= self.keys <= k_now
        return self.keys[mask], self.values[mask]

    def mean(self, now: float, span_s: float) -> float | None:
        _, values = self.select(now, span_s)
        return float(values.sum()) / values.size if values.size else None

    def peak(self, now: float, span_s: float) -> float | None:
        _, values = self.select(now, span_s)
        return float(values.max()) if values.size else None

    def trend(self, now: float, span_s: float) -> tuple[float, float] | None:
        """Least-squares line over the buckets in the window: ``(level at now, slope per second)``."""
        keys, values = self.select(now, span_s)
        return _line(keys, values, self.key(now), self.bucket_s)


def _line(keys: _Keys, values: _Values, k_now: int, bucket_s: float) -> tuple[float, float] | None:
    n = values.size
    if n == 0:
        return None
    if n == 1:
        return float(values[0]), 0.0
    x = (keys - k_now).astype(np.float64) * bucket_s
    x_mean = float(x.sum()) / n
    y_mean = float(values.sum()) / n
    dx = x - x_mean
    slope = float(dx @ (values - y_mean)) / float(dx @ dx)
    if abs(slope) < 1e-9:
        # Float noise of a flat line (9e-17 for 1, 0, 1 at one time): the detector sums exactly and reads 0, and
        # the sign decides whether the forecast is held at the demand.
        slope = 0.0
    return y_mean - slope * x_mean, slope


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    """What the detector reads from a ScaledObject (`policy` builds it from `spec.advanced` and the trigger)."""

    stable_window_s: float = 60.0
    """Stable demand is the mean over this; panic is left only after this long without the panic condition."""
    panic_window_s: float = 6.0
    """Panic demand and the trend are taken over this (Knative's 10 % of the stable window)."""
    panic_threshold: float = 2.0
    """Panic when panic demand >= this x ready capacity (Knative's 200 %)."""
    target_queue_depth: float = 4.0
    """Queue + in-flight one ready replica carries: ready capacity = ready x this."""
    activation_queue_depth: float = 0.0
    """With no ready replica, any panic demand above this is panic-worthy (there is no capacity to compare with)."""
    carry_s: float = 1.0
    """A level is carried over gaps between samples up to this long (the staleness limit), not longer."""

    @property
    def window_s(self) -> float:
        return max(self.stable_window_s, self.panic_window_s)


@dataclass(frozen=True, slots=True)
class PulseState:
    window: TimeWindow
    panic: bool = False
    panic_since: float | None = None
    panic_condition_at: float | None = None
    """The last time the panic condition held; panic ends one stable window after it."""


@dataclass(frozen=True, slots=True)
class Pulse:
    """One reading of the detector at `now`."""

    fresh: bool
    """False when this observation carried no demand (missing or stale metrics): nothing was recorded."""
    current: float | None
    stable_demand: float | None
    panic_demand: float | None
    """The peak of the panic window (see `observe` for why not its mean)."""
    forecast_demand: float | None
    slope_per_s: float
    capacity: float
    panic: bool
    panic_condition: bool
    entered_panic: bool
    left_panic: bool


def initial(config: DetectorConfig) -> PulseState:
    return PulseState(TimeWindow.empty(config.window_s, carry_s=config.carry_s))


def panic_condition(config: DetectorConfig, panic_demand: float | None, ready: int) -> bool:
    """Knative's rule: panic demand >= threshold x ready capacity; with nothing ready, any demand above the
    activation depth (there is no capacity to be a multiple of, and that demand is waiting on us)."""
    if panic_demand is None:
        return False
    if ready <= 0:
        return panic_demand > config.activation_queue_depth
    return panic_demand >= config.panic_threshold * ready * config.target_queue_depth


def observe(
    config: DetectorConfig,
    state: PulseState,
    *,
    now: float,
    demand: float | None,
    ready: int,
    lead_time_s: float,
) -> tuple[Pulse, PulseState]:
    """Record `demand` (None: nothing fresh to record) at `now` and read the windows.

    - stable demand: mean over the stable window (time-weighted: buckets, not samples).
    - panic demand: the *peak* bucket of the panic window. Queue depth already integrates excess arrivals, so one
      sample at 2x capacity is a real backlog, and DESIGN asks for a reaction within one gateway sample; the
      window's mean would need ~3 s of a 3x pulse to cross 2x.
    - forecast: the least-squares trend over the panic window, one lead time ahead; never negative, and never
      below the current demand while rising. With less than `TREND_MIN_COVER` of the window seen, the level.
    - panic: entered on the condition, left only after a full stable window without it. Without fresh demand the
      flag is kept as it is: missing metrics are no evidence that the pulse is over.
    """
    window = state.window
    if window.span_s != max(config.window_s, BUCKET_S) or window.carry_s != config.carry_s:
        window = TimeWindow.empty(config.window_s, carry_s=config.carry_s)  # the spec's windows changed
    capacity = max(ready, 0) * config.target_queue_depth
    if demand is not None:
        window = window.record(now, demand)
    stable = window.mean(now, config.stable_window_s)
    keys, values = window.select(now, config.panic_window_s)  # one selection serves the peak and the trend
    panic_demand = float(values.max()) if values.size else None
    k_now = window.key(now)
    slope = 0.0
    forecast: float | None = None
    if keys.size and (k_now - int(keys.min())) * window.bucket_s < config.panic_window_s * TREND_MIN_COVER:
        # Too little history for a slope (two samples 0.1 s apart would extrapolate 0 -> 3 into 78): the level.
        forecast = float(demand) if demand is not None else float(values[keys.argmax()])
        line = None
    else:
        line = _line(keys, values, k_now, window.bucket_s)
    if line is not None:
        level, slope = line
        forecast = level + slope * lead_time_s
        if slope > 0 and demand is not None:
            forecast = max(forecast, float(demand))
        forecast = max(forecast, 0.0)
    if demand is None:
        pulse = Pulse(False, None, stable, panic_demand, forecast, slope, capacity, state.panic, False, False, False)
        return pulse, PulseState(window, state.panic, state.panic_since, state.panic_condition_at)

    condition = panic_condition(config, panic_demand, ready)
    panic, since, condition_at = state.panic, state.panic_since, state.panic_condition_at
    entered = left = False
    if condition:
        entered = not panic
        panic, condition_at = True, now
        since = now if entered else since
    elif panic and (condition_at is None or now - condition_at >= config.stable_window_s):
        panic, since, left = False, None, True
    pulse = Pulse(True, demand, stable, panic_demand, forecast, slope, capacity, panic, condition, entered, left)
    return pulse, PulseState(window, panic, since, condition_at)
