"""Pulse detector: time-indexed demand windows, a trend forecast one lead time ahead, and Knative's panic flag.

Pure: numpy and the standard library only, time is always an argument, state goes in and comes out frozen.

Windows are rings of time buckets keyed by ``floor(ts / bucket_s)`` (Knative's ``aggregation`` package works the
same way), so a burst of samples lands in one bucket and a late tick leaves a gap instead of skewing an average.
The arrays of a stored window are read-only; recording copies them (copy-on-write, a few microseconds).
"""

from __future__ import annotations

import math
from collections import deque
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
_FIXED_BITS: Final = 1074
"""Running sums are exact integers in units of 2**-1074 (every finite float is a whole number of those): adding
and later subtracting a value leaves no drift, and a reading depends only on the buckets held, never on the order
they came and went in (a replayed state decides exactly as the original did)."""


def _fixed(value: float) -> int:
    num, den = value.as_integer_ratio()  # den is a power of two
    return num << (_FIXED_BITS - den.bit_length() + 1)


class _Track:
    """Running aggregates of the buckets with data in ``(anchor - m, anchor]``, anchor being the ring's newest key.

    `runs` holds those buckets as ``(first key, last key, fixed value)`` runs of consecutive keys with one value, in
    order (`count` buckets in all), `peaks` is a monotonic deque of ``(key, value)`` with decreasing values (its
    head is the peak), and the sums serve the mean and the least-squares line: exact integers (`_fixed`), keys
    relative to `origin`. A run enters and leaves in closed form, so a carried gap costs one step, not one per
    bucket; every write is O(1) amortised. A write into the past or a lowered newest bucket marks the track
    `dirty`, and the next read rebuilds it from the ring (rare: late records, several decisions in one bucket with
    falling demand).
    """

    __slots__ = ("count", "dirty", "m", "origin", "peaks", "runs", "su", "suu", "suy", "sy")

    def __init__(self, m: int) -> None:
        self.m = m
        self.dirty = True
        self.runs: deque[tuple[int, int, int]] = deque()
        self.peaks: deque[tuple[int, float]] = deque()
        self.origin = self.count = 0
        self.su = self.suu = self.sy = self.suy = 0

    def rebuild(self, ring: _Ring) -> None:
        self.runs.clear()
        self.peaks.clear()
        self.origin = ring.last
        self.count = self.su = self.suu = self.sy = self.suy = 0
        self.dirty = False
        if ring.last == _EMPTY_KEY:
            return
        n = ring.n
        for key in range(ring.last - self.m + 1, ring.last + 1):
            if ring.keys[key % n] == key:
                value = ring.values[key % n]
                self.advance(key, key, _fixed(value), value)

    def advance(self, first: int, last: int, y: int, value: float) -> None:
        """Keys `first..last` are newer than every key held and all hold `value` (`y` its `_fixed`): the window
        slides to end at `last`, and those of them inside it enter."""
        floor = last - (self.m or 1)  # width 0 still takes the newest key, as per-key advances always did
        runs, origin = self.runs, self.origin
        count, su, suu, sy, suy = self.count, self.su, self.suu, self.sy, self.suy
        while runs and runs[0][0] <= floor:
            a, b, ry = runs[0]
            if b > floor:  # the run straddles the floor: its older part leaves
                runs[0] = (floor + 1, b, ry)
                b = floor
            else:
                runs.popleft()
            c, s1, s2 = _key_sums(a - origin, b - origin)
            count, su, suu, sy, suy = count - c, su - s1, suu - s2, sy - c * ry, suy - s1 * ry
        if first <= floor:
            first = floor + 1
        if runs and runs[-1][1] == first - 1 and runs[-1][2] == y:
            runs[-1] = (runs[-1][0], last, y)  # fewer runs, fewer steps when they leave
        else:
            runs.append((first, last, y))
        c, s1, s2 = _key_sums(first - origin, last - origin)
        self.count, self.su, self.suu, self.sy, self.suy = count + c, su + s1, suu + s2, sy + c * y, suy + s1 * y
        peaks = self.peaks
        while peaks and peaks[0][0] <= floor:
            peaks.popleft()
        while peaks and peaks[-1][1] <= value:
            peaks.pop()
        peaks.append((last, value))  # the run's older keys are hidden by its newest, as per-key appends leave it

    def replace_newest(self, key: int, old: float, value: float) -> None:
        """The newest bucket's value changes from `old` to `value`."""
        y = _fixed(value)
        runs = self.runs
        if runs and runs[-1][1] == key:
            a, _, y_old = runs[-1]
            if a == key:
                runs[-1] = (key, key, y)
            else:  # split the newest key off its run
                runs[-1] = (a, key - 1, y_old)
                runs.append((key, key, y))
        else:
            y_old = _fixed(old)  # a width-0 track that holds nothing: its sums move all the same, as they always have
        u = key - self.origin
        dy = y - y_old
        self.sy += dy
        self.suy += u * dy
        peaks = self.peaks
        if value >= old:
            while peaks and peaks[-1][1] <= value:
                peaks.pop()
            peaks.append((key, value))
        else:
            self.dirty = True  # values it had hidden may be the peak again


def _identical(a: float, b: float) -> bool:
    """The same float, bit for bit (0.0 is not -0.0, and an int is not a float)."""
    return type(a) is float and type(b) is float and a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _key_sums(u0: int, u1: int) -> tuple[int, int, int]:
    """Count, sum and sum of squares of the integers ``u0..u1`` (exact, closed form)."""
    if u0 == u1:
        return 1, u0, u0 * u0
    c = u1 - u0 + 1
    a = u0 - 1  # the sum of squares up to x is x(x + 1)(2x + 1) / 6, for negative x too
    return c, (u0 + u1) * c // 2, (u1 * (u1 + 1) * (2 * u1 + 1) - a * (a + 1) * (2 * a + 1)) // 6


class _Ring:
    """The mutable buckets behind the newest `TimeWindow` of one lineage (lists: scalar access is what it does)."""

    __slots__ = ("exact", "keys", "last", "n", "owner", "tracks", "values")

    def __init__(self, keys: list[int], values: list[float], last: int, owner: _Cell) -> None:
        self.keys, self.values, self.last, self.owner = keys, values, last, owner
        self.n = len(keys)
        self.tracks: dict[int, _Track] = {}
        self.exact = all(math.isfinite(v) for v in values)

    def fill(self, first: int, last: int, value: float, undo: list[tuple[int, int, float]]) -> None:
        """Write `value` into buckets `first..last`, all newer than the newest key: the tracks slide once."""
        if not math.isfinite(value):
            self.exact = False  # no exact sum of an infinity or NaN: this ring reads by the general path
            self.tracks.clear()
        keys, values, n = self.keys, self.values, self.n
        start = first
        while start <= last:  # one slice, or two where the run wraps round the ring
            p0 = start % n
            end = last if last - start < n - p0 else start + n - p0 - 1
            p1 = p0 + end - start + 1
            undo.extend(zip(range(p0, p1), keys[p0:p1], values[p0:p1], strict=True))
            keys[p0:p1] = range(start, end + 1)
            values[p0:p1] = [value] * (p1 - p0)
            start = end + 1
        self._slide(first, last, value)

    def put(self, key: int, value: float, undo: list[tuple[int, int, float]]) -> None:
        pos = key % self.n
        if not math.isfinite(value):
            self.exact = False  # as in `fill`
            self.tracks.clear()
        old_key, old_value = self.keys[pos], self.values[pos]
        undo.append((pos, old_key, old_value))
        self.keys[pos] = key
        self.values[pos] = value
        last = self.last
        if last == _EMPTY_KEY or key > last:
            self._slide(key, key, value)
        elif key == last and old_key == key:
            for t in self.tracks.values():
                if not t.dirty:
                    t.replace_newest(key, old_value, value)
        else:
            for t in self.tracks.values():
                t.dirty = True

    def _slide(self, first: int, last: int, value: float) -> None:
        """Buckets `first..last`, newer than the newest key, now hold `value`: the clean tracks take them in."""
        if self.tracks:
            y = _fixed(value)
            for t in self.tracks.values():
                if not t.dirty:
                    t.advance(first, last, y, value)
        self.last = last

    def track(self, m: int) -> _Track:
        t = self.tracks.get(m)
        if t is None:
            t = self.tracks[m] = _Track(m)
        if t.dirty:
            t.rebuild(self)
        return t


class _Cell:
    """One version's handle on the buckets (Baker's persistent arrays): the newest version owns the ring and writes
    it in place; an older one keeps the writes that turn the next version's buckets back into its own, and
    rebuilds a ring of its own only when it is read or written again (tests and replays do that; the policy never
    does). The chain points from old to new, so a version nobody holds is freed."""

    __slots__ = ("next", "ring", "undo")

    def __init__(self) -> None:
        self.ring: _Ring | None = None
        self.next: _Cell | None = None
        self.undo: list[tuple[int, int, float]] = []

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        """Versions are equal when their buckets are (what a frozen window's `==` always meant)."""
        if not isinstance(other, _Cell):
            return NotImplemented
        a, b = self.own(), other.own()
        return a.keys == b.keys and a.values == b.values

    def own(self) -> _Ring:
        ring = self.ring
        if ring is not None and ring.owner is self:
            return ring
        chain: list[_Cell] = []
        cell: _Cell | None = self
        while cell is not None and (cell.ring is None or cell.ring.owner is not cell):
            chain.append(cell)
            cell = cell.next
        assert cell is not None and cell.ring is not None  # the newest version of a lineage owns its ring
        keys, values = list(cell.ring.keys), list(cell.ring.values)
        for c in reversed(chain):
            for pos, key, value in reversed(c.undo):
                keys[pos], values[pos] = key, value
        last = max(keys)
        self.ring, self.next, self.undo = _Ring(keys, values, last, self), None, []
        return self.ring


@dataclass(frozen=True, slots=True)
class TimeWindow:
    """A ring of `n_buckets` time buckets of `bucket_s` seconds covering `span_s` seconds.

    `keys[i]` is the absolute bucket index slot `i` holds (so a slot left over from an earlier lap of the ring is
    recognised as old by its key, not by clearing it). `combine` says what one bucket keeps when several values land
    in it: the ``last`` (a level signal such as queue depth: the newest value is the truth) or the ``max``
    (recommendations, where the stabilisation window wants the highest). Over a gap between records of up to
    `carry_s` the previous value is carried forward (a level holds until the next sample says otherwise); a longer
    gap stays empty, which queries treat as "no data", never as zero.

    Persistent: `record` returns a new window and leaves this one as it was. The newest window writes the shared
    ring in place and keeps running aggregates per queried span (`_Track`), so recording and reading at the newest
    bucket are O(1) amortised, whatever the window's length. Reading at another time (no sample this bucket, a
    clock that stepped back) takes the general path: a pass over the ring.
    """

    span_s: float
    bucket_s: float
    _cell: _Cell
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
        cell = _Cell()
        cell.ring = _Ring([_EMPTY_KEY] * n, [0.0] * n, _EMPTY_KEY, cell)
        return cls(span_s, bucket_s, cell, carry_s=carry_s, combine=combine)

    @property
    def n_buckets(self) -> int:
        return self._cell.own().n

    @property
    def keys(self) -> _Keys:
        """The bucket keys, slot by slot (a read-only copy)."""
        keys = np.array(self._cell.own().keys, dtype=np.int64)
        keys.flags.writeable = False
        return keys

    @property
    def values(self) -> _Values:
        """The bucket values, slot by slot (a read-only copy)."""
        values = np.array(self._cell.own().values, dtype=np.float64)
        values.flags.writeable = False
        return values

    def key(self, ts: float) -> int:
        return math.floor(ts / self.bucket_s + _KEY_SLACK)

    @property
    def has_data(self) -> bool:
        return self.last_key != _EMPTY_KEY

    def record(self, ts: float, value: float) -> TimeWindow:
        """A new window with `value` recorded at `ts`; this one is unchanged."""
        ring = self._cell.own()
        n = ring.n
        k = self.key(ts)
        last = self.last_key
        if last != _EMPTY_KEY and k <= last - n:
            return self  # older than the whole ring: nothing it could still change
        undo: list[tuple[int, int, float]] = []
        joined = False  # the new bucket was written as the end of a carried run
        if last != _EMPTY_KEY and k > last + 1 and self.carry_s > 0:
            carried = ring.values[last % n]
            fill_to = min(k - 1, last + math.floor(self.carry_s / self.bucket_s + _KEY_SLACK))
            fill_from = max(last + 1, k - n + 1)  # buckets that stay inside the ring
            if fill_to == k - 1 and _identical(carried, value):
                fill_to, joined = k, True  # the level held: the new bucket ends the carried run (one slide)
            if fill_from <= fill_to:
                ring.fill(fill_from, fill_to, carried, undo)
        pos = k % n
        if not joined and ring.keys[pos] == k and self.combine == "max":
            ring.put(k, max(ring.values[pos], value), undo)
        elif not joined and (ring.keys[pos] != k or k >= last):  # a late value never overwrites a newer one
            ring.put(k, value, undo)
        cell = _Cell()
        cell.ring, ring.owner = ring, cell
        old = self._cell
        old.ring, old.next, old.undo = None, cell, undo
        return TimeWindow(
            self.span_s,
            self.bucket_s,
            cell,
            max(last, k),
            ts if self.first_ts is None else min(self.first_ts, ts),
            self.carry_s,
            self.combine,
        )

    def _track(self, now: float, span_s: float) -> _Track | None:
        """The running aggregates for `span_s` when reading at the newest bucket (the O(1) path); else None."""
        if self.last_key == _EMPTY_KEY or self.key(now) != self.last_key:
            return None
        ring = self._cell.own()
        m = math.ceil(span_s / self.bucket_s - 1e-9)
        return ring.track(m) if m <= ring.n and ring.exact else None

    def select(self, now: float, span_s: float) -> tuple[_Keys, _Values]:
        """Keys and values of the buckets with data in ``(now - span_s, now]``."""
        ring = self._cell.own()
        keys = np.array(ring.keys, dtype=np.int64)
        values = np.array(ring.values, dtype=np.float64)
        k_now = self.key(now)
        m = math.ceil(span_s / self.bucket_s - 1e-9)
        mask = keys > k_now - m
        if k_now < self.last_key:  # only after the clock stepped back; usually nothing is newer than now
            mask &= keys <= k_now
        return keys[mask], values[mask]

    def mean(self, now: float, span_s: float) -> float | None:
        t = self._track(now, span_s)
        if t is not None:
            return t.sy / (t.count << _FIXED_BITS) if t.count else None
        _, values = self.select(now, span_s)
        return float(values.sum()) / values.size if values.size else None

    def peak(self, now: float, span_s: float) -> float | None:
        t = self._track(now, span_s)
        if t is not None:
            return t.peaks[0][1] if t.peaks else None
        _, values = self.select(now, span_s)
        return float(values.max()) if values.size else None

    def trend(self, now: float, span_s: float) -> tuple[float, float] | None:
        """Least-squares line over the buckets in the window: ``(level at now, slope per second)``."""
        t = self._track(now, span_s)
        if t is not None:
            return _track_line(t, self._cell.own(), self.key(now), self.bucket_s)
        keys, values = self.select(now, span_s)
        return _line(keys, values, self.key(now), self.bucket_s)


def _fit(c: int, su: int, suu: int, sy: int, suy: int, bucket_s: float) -> tuple[float, float]:
    """The least-squares line through `c` >= 2 buckets from exact sums, keys relative to the bucket of `now`:
    ``(level at now, slope per second)``. Both readings (`_line`, `_track_line`) end here with the same integers,
    so a decision does not depend on which one served it, down to the last bit."""
    one = 1 << _FIXED_BITS
    slope = (c * suy - su * sy) / ((c * suu - su * su) * one) / bucket_s
    return sy / (c * one) - slope * (su / c * bucket_s), slope


def _line(keys: _Keys, values: _Values, k_now: int, bucket_s: float) -> tuple[float, float] | None:
    n = values.size
    if n == 0:
        return None
    if n == 1:
        return float(values[0]), 0.0
    su = suu = sy = suy = 0
    for key, value in zip(keys.tolist(), values.tolist(), strict=True):
        u, y = key - k_now, _fixed(value)
        su += u
        suu += u * u
        sy += y
        suy += u * y
    return _fit(n, su, suu, sy, suy, bucket_s)


def _track_line(t: _Track, ring: _Ring, k_now: int, bucket_s: float) -> tuple[float, float] | None:
    """`_line` from a track's running sums: the same fit, O(1). The track's keys are relative to its `origin`:
    moved to `k_now` exactly (the slope's numerator and denominator do not change under the move)."""
    c = t.count
    if c == 0:
        return None
    if c == 1:
        return ring.values[t.runs[0][0] % ring.n], 0.0
    d = t.origin - k_now
    return _fit(c, t.su + c * d, t.suu + 2 * d * t.su + c * d * d, t.sy, t.suy + d * t.sy, bucket_s)


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
    calm_s: float | None = None
    """Panic is left this long after its condition last held; None: `stable_window_s` (Knative's rule)."""

    @property
    def window_s(self) -> float:
        return max(self.stable_window_s, self.panic_window_s)


@dataclass(frozen=True, slots=True)
class PulseState:
    window: TimeWindow
    panic: bool = False
    panic_since: float | None = None
    panic_condition_at: float | None = None
    """The last time the panic condition held; panic ends `DetectorConfig.calm_s` after it."""


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


def _calm_s(config: DetectorConfig) -> float:
    return config.stable_window_s if config.calm_s is None else config.calm_s


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
    k_now = window.key(now)
    slope = 0.0
    forecast: float | None = None
    line: tuple[float, float] | None
    track = window._track(now, config.panic_window_s)
    if track is not None:  # read at the newest bucket: the running aggregates, O(1)
        ring = window._cell.own()
        panic_demand = track.peaks[0][1] if track.peaks else None
        oldest = track.runs[0][0] if track.runs else None
        newest = ring.values[k_now % ring.n] if track.runs else 0.0  # the newest key held is k_now
    else:
        keys, values = window.select(now, config.panic_window_s)  # one selection serves the peak and the trend
        panic_demand = float(values.max()) if values.size else None
        oldest = int(keys.min()) if keys.size else None
        newest = float(values[keys.argmax()]) if keys.size else 0.0
    if oldest is not None and (k_now - oldest) * window.bucket_s < config.panic_window_s * TREND_MIN_COVER:
        # Too little history for a slope (two samples 0.1 s apart would extrapolate 0 -> 3 into 78): the level.
        forecast = float(demand) if demand is not None else newest
        line = None
    elif track is not None:
        line = _track_line(track, window._cell.own(), k_now, window.bucket_s)
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
    elif panic and (condition_at is None or now - condition_at >= _calm_s(config)):
        panic, since, left = False, None, True
    pulse = Pulse(True, demand, stable, panic_demand, forecast, slope, capacity, panic, condition, entered, left)
    return pulse, PulseState(window, panic, since, condition_at)
