"""The daemon's tending of the cyclic garbage collector (`AutoscalerSettings.gc_freeze_every_s` says why).

`GcTending.keep`, a task of the daemon's, calls `GcTending.tend` with the settings in force every `freeze_every_s`,
each time in a step of the loop of its own: the survivors of the young generations are frozen out of the collector's
sight (and once as soon as the ScaledObjects are followed: the controllers are the bulk of them), and once per
`full_every_s` everything is handed back and collected in full, so cyclic garbage frozen with the rest is reclaimed,
not leaked. It acts on the whole process.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Awaitable, Callable

__all__ = ["GcTending"]


class GcTending:
    """When the collector was last frozen and last run in full (monotonic)."""

    def __init__(self) -> None:
        self.frozen_at = self.full_at = time.monotonic()
        self.frozen_once = False

    async def keep(
        self, stop: asyncio.Event, every: Callable[[], float | None], tend: Callable[[], Awaitable[None]]
    ) -> None:
        """Until `stop`: `tend()` every `every()` seconds (read each time: a live daemon's setting may change), in a
        step of the loop of its own after a yield, so the young collection's stop neither waits behind other work
        nor adds to a slice of it. With `every()` None (the collector left as Python sets it) it looks again each
        second."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every() or 1.0)
            if stop.is_set() or every() is None:
                continue
            await tend()

    def tend(self, freeze_every_s: float | None, full_every_s: float, *, followed: bool) -> None:
        """Freeze or collect if due; `freeze_every_s` None leaves the collector as Python sets it. `followed`: the
        ScaledObjects have been applied (the first freeze waits for them)."""
        if freeze_every_s is None:
            return
        mono = time.monotonic()
        if mono - self.full_at >= full_every_s:
            self.full_at = self.frozen_at = mono
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        elif mono - self.frozen_at >= freeze_every_s or (followed and not self.frozen_once):
            self.frozen_once = followed
            self.frozen_at = mono
            gc.collect(1)  # young cyclic garbage is collected, not frozen (a few ms)
            gc.freeze()
