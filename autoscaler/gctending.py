"""The daemon's tending of the cyclic garbage collector (`AutoscalerSettings.gc_freeze_every_s` says why).

Housekeeping calls `GcTending.tend` every tick with the settings in force: the survivors of the young generations
are frozen out of the collector's sight every `freeze_every_s` (and once as soon as the ScaledObjects are followed:
the controllers are the bulk of them), and once per `full_every_s` everything is handed back and collected in full,
so cyclic garbage frozen with the rest is reclaimed, not leaked. It acts on the whole process.
"""

from __future__ import annotations

import gc
import time

__all__ = ["GcTending"]


class GcTending:
    """When the collector was last frozen and last run in full (monotonic)."""

    def __init__(self) -> None:
        self.frozen_at = self.full_at = time.monotonic()
        self.frozen_once = False

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
