"""How late the event loop runs what is due: the one figure that says whether a lease renewal can be late.

A replica acts for its shards only until ``sent + lease_s * stop_fraction`` of its last renewal (1.6 s at the
defaults, `autoscaler.shards.leases`); a renewal whose reply waits behind a busy loop, or a process the kernel does not
schedule, loses the lease although the broker answered in time. `probe` sleeps `every_s` over and over and reports
the overshoot of each sleep (what every other task scheduled then waited too) to `observe`, and logs a warning,
at most once per `warn_every_s`, when one passes `warn_over_s`. Measured here on 2 cores: a few ms with 1,000
models; a lost lease in the 3,000-model bench needs a stall of over a second, which this makes visible.

No I/O and no metrics library: the caller passes what to do with a reading (the autoscaler observes
``pulsescale_event_loop_lag_seconds``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["LagSettings", "probe"]

log = logging.getLogger("pulsescale.looplag")


@dataclass(frozen=True)
class LagSettings:
    every_s: float = 0.1
    """Between two readings. Ten a second costs nothing measurable and catches any stall a lease could feel
    (the shortest that matters is the fence's slack of several hundred ms)."""
    warn_over_s: float = 0.5
    """A stall this long is logged: a third of the default 1.6 s fence, so a warning comes well before a loss."""
    warn_every_s: float = 10.0
    """At most one warning in this long (it names the longest stall since the last one), so a starved process
    does not also flood its log."""

    def __post_init__(self) -> None:
        if self.every_s <= 0 or self.warn_over_s <= 0 or self.warn_every_s < 0:
            raise ValueError(f"LagSettings wants positive durations, got {self}")


async def probe(observe: Callable[[float], None], stop: asyncio.Event, settings: LagSettings = LagSettings()) -> None:
    """Until `stop` is set: every `settings.every_s`, `observe(lag_s)` with how late the sleep ended (>= 0)."""
    every = settings.every_s
    warned_at = -float("inf")
    worst = 0.0
    stopped = asyncio.ensure_future(stop.wait())  # asyncio.wait, not wait_for: no task made per reading
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            await asyncio.wait([stopped], timeout=every)
            if stop.is_set():
                return
            now = time.monotonic()
            lag = max(0.0, now - t0 - every)
            observe(lag)
            worst = max(worst, lag)
            if worst > settings.warn_over_s and now - warned_at >= settings.warn_every_s:
                log.warning(
                    "the event loop stalled %.2f s (warned over %.2f s, at most every %.0f s): lease renewals, "
                    "claims and decisions waited that long; the process is short of CPU or something blocks the loop",
                    worst,
                    settings.warn_over_s,
                    settings.warn_every_s,
                )
                warned_at, worst = now, 0.0
    finally:
        stopped.cancel()
