"""Progress of a long copy (staging 100 GB, verifying a model): bytes done of a total, rate, ETA, and when to say so.

Pure apart from a lock: time is passed in. `Progress` is shared by the copying threads (`add`) and whoever shows
it (the agent's log and status, the CLI's bar); `Gate` decides when a line is due, so a log shows a stage at a
bounded rate whatever the block size: every `interval_s` or every `step` of the total, whichever comes first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Gate", "Progress", "bar", "describe"]


@dataclass
class Gate:
    """Says when a progress line is due: every `interval_s` seconds or every `step` of the total."""

    interval_s: float = 5.0
    """Often enough that an operator watching a 100 GB stage sees it move, rarely enough to stay a few lines."""
    step: float = 0.1
    _last_at: float | None = None
    _last_fraction: float = 0.0

    def due(self, now: float, fraction: float) -> bool:
        if self._last_at is None:
            self._last_at, self._last_fraction = now, fraction
            return False  # the start is said by whoever starts
        if now - self._last_at >= self.interval_s or fraction - self._last_fraction >= self.step:
            self._last_at, self._last_fraction = now, fraction
            return True
        return False


@dataclass
class Progress:
    """Bytes done of `total_bytes` since `started_at`; `add` is called from any thread."""

    total_bytes: int
    started_at: float
    what: str = "staging"
    done_bytes: int = 0
    on_due: Callable[[Progress, float], None] | None = None
    """Called (in the adding thread) when `gate` says a line is due, with the time."""
    gate: Gate = field(default_factory=Gate)
    clock: Callable[[], float] = time.monotonic
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.done_bytes += nbytes
            if self.on_due is None:
                return
            now = self.clock()
            due = self.gate.due(now, self.fraction)
        if due:
            self.on_due(self, now)

    @property
    def fraction(self) -> float:
        if self.total_bytes <= 0:
            return 0.0  # not known yet (the sizes are being asked for), or nothing to write
        return max(0.0, min(1.0, self.done_bytes / self.total_bytes))

    def rate(self, now: float) -> float:
        """Bytes per second since the start (0 before any time has passed)."""
        took = now - self.started_at
        return self.done_bytes / took if took > 0 else 0.0

    def eta_s(self, now: float) -> float | None:
        rate = self.rate(now)
        if rate <= 0:
            return None
        return max(0.0, self.total_bytes - self.done_bytes) / rate


def _size(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def describe(p: Progress, now: float) -> str:
    """``staging tiny: 1.2 GB of 2.6 GB (45 %), 1.4 GB/s, ETA 1 s``"""
    eta = p.eta_s(now)
    tail = f", ETA {eta:.0f} s" if eta is not None and p.done_bytes < p.total_bytes else ""
    return (
        f"{p.what}: {_size(p.done_bytes)} of {_size(p.total_bytes)} ({100 * p.fraction:.0f} %), "
        f"{_size(p.rate(now))}/s{tail}"
    )


def bar(p: Progress, now: float, width: int = 30) -> str:
    """A one-line bar for a terminal: ``[#########.....]  45 %  1.2 GB of 2.6 GB  1.4 GB/s  ETA 1 s``"""
    filled = round(width * p.fraction)
    eta = p.eta_s(now)
    tail = f"  ETA {eta:.0f} s" if eta is not None and p.done_bytes < p.total_bytes else ""
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {100 * p.fraction:3.0f} %  {_size(p.done_bytes)} of "
        f"{_size(p.total_bytes)}  {_size(p.rate(now))}/s{tail}"
    )
