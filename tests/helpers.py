"""The one helpers module of the tests: waiting on a condition, clocks a test moves by hand, event collection.

Doubles of what cannot run here live beside it and say so in their names (`agent_double`); everything else the
tests use is real.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

__all__ = ["HandClock", "ShiftedClock", "wait_for"]


async def wait_for(
    pred: Callable[[], object | Awaitable[object]], timeout_s: float = 15.0, what: str = "condition"
) -> float:
    """Poll `pred` (plain or async) every 10 ms until it is truthy; the seconds it took. Fails the test with
    `what` after `timeout_s`: a generous bound that only catches a hang, never a speed assertion."""
    t0 = time.monotonic()
    while True:
        result = pred()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class HandClock:
    """Time that moves only when the test says so (Knative's autoscaler tests do the same). Kept in tenths of a
    millisecond, so a thousand 0.1 s steps land exactly on 100.0 s."""

    start: float = 1_700_000_000.0
    ticks: int = 0
    now: float = field(init=False)

    def __post_init__(self) -> None:
        self.now = self.start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> float:
        self.ticks += round(dt * 10_000)
        self.now = self.start + self.ticks / 10_000
        return self.now


class ShiftedClock:
    """Wall time plus a shift the test controls: for code whose requests must carry real `expires_at`."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __call__(self) -> float:
        return time.time() + self.shift
