"""A replica warms up before it campaigns for shards, so its first seconds as an owner run as its steady state does.

Before this, the campaign began at once: a replica took its shards (and subscribed to their samples) within a
second of starting, while it was still applying the ScaledObjects (a second or more at 1,000 models, longer on a
busy machine), before the first freeze of the garbage collector's long-lived objects (a full collection over them
stops the loop for ~100 ms), and before ``/metrics`` had ever been rendered (the first scrape renders every series:
seconds of CPU at 1,000 models). `bench decide --pulses-after 1.5` timed pulses in those first seconds: 78 of 100
answered within 2 s, p99 1.9 s. Now `warm_then_campaign` waits until the replica can decide (`ready`: connected,
the slot and agent views listed, the ScaledObjects followed), freezes what survived the start, renders the metrics
once, and only then campaigns; the replica record, and so the shards, come after. Meanwhile the other replicas keep
acting for every model (a joining replica takes nothing from them until it announces itself).

The wait is bounded (`max_s`): a replica that cannot get ready campaigns anyway, and says so, so that a fleet of one
whose views are slow still acts rather than not at all. The daemon composes it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from autoscaler.exposition import Exposition
from autoscaler.gctending import GcTending

__all__ = ["WARM_POLL_S", "warm_then_campaign"]

log = logging.getLogger("pulsescale.autoscaler")

WARM_POLL_S = 0.05
"""How often readiness is looked at while warming (a start of 1,000 models takes seconds: this is noise)."""


async def warm_then_campaign(
    ready: Callable[[], bool],
    campaign: Callable[[asyncio.Event], Awaitable[None]],
    stop: asyncio.Event,
    *,
    gc: GcTending,
    freeze_every_s: float | None,
    exposition: Exposition,
    max_s: float,
) -> None:
    """Wait for `ready()` (at most `max_s`), freeze the garbage collector's survivors (when the daemon tends it:
    `freeze_every_s`), render `exposition` once, then run `campaign(stop)`."""
    began = time.monotonic()
    while not stop.is_set() and not ready():
        if time.monotonic() - began >= max_s:
            log.warning("not ready after %.0f s of warming up; campaigning for shards anyway", max_s)
            break
        await asyncio.sleep(WARM_POLL_S)
    if stop.is_set():
        return
    gc.tend(freeze_every_s, float("inf"), followed=True)
    await exposition.render()  # in slices; every series a scrape would otherwise render at once
    log.info("warmed up in %.1f s; campaigning for shards", time.monotonic() - began)
    await campaign(stop)
