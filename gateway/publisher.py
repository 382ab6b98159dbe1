"""`pulse.queue.<model>` samples: every `every_s` (100 ms) and on change, for each model the gateway serves.

The contract (`warmpool.protocol.QueueSample`): per gateway run and model, `seq` increases by one per sample and
the counters never decrease (a queue reclaimed and made again starts both again: `forget`). "On change" is
coalesced: a change publishes at once unless a sample of that model went out less than `min_gap_s` ago, then at
that gap's end; so a gateway under 10,000 requests/s sends at most 1 / `min_gap_s` samples per model per second,
and a change is never later than `min_gap_s` on the wire.

`Schedule` is the pure part (time passed in); `Publisher` is the loop that publishes on NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

from gateway.queue import ModelQueue
from warmpool import protocol

__all__ = ["Publisher", "Schedule"]

log = logging.getLogger("pulsescale.gateway")


@dataclass
class Schedule:
    """When one model's next sample is due (monotonic seconds)."""

    every_s: float = 0.1
    """The contract's period: a sample at least this often, so the autoscaler can tell a live gateway from a dead
    one (it drops a gateway silent for its `stale_after_s`)."""
    min_gap_s: float = 0.01
    """Shortest gap between two samples of one model: bounds the message rate under heavy traffic."""
    last_at: float | None = None
    dirty: bool = True  # the first sample goes out at once

    def changed(self) -> None:
        self.dirty = True

    def due_at(self) -> float:
        """The time the next sample is due (in the past: now)."""
        if self.last_at is None:
            return float("-inf")
        return self.last_at + (self.min_gap_s if self.dirty else self.every_s)

    def published(self, now: float) -> None:
        self.last_at, self.dirty = now, False


class Publisher:
    """Publishes each queue's sample when its `Schedule` says so. `changed(model)` wakes it."""

    def __init__(
        self,
        nc: Client,
        gateway_id: str,
        queues: dict[str, ModelQueue[Any]],
        *,
        every_s: float = 0.1,
        min_gap_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_published: Callable[[str], None] | None = None,
    ) -> None:
        self._nc = nc
        self.gateway_id = gateway_id
        self._queues = queues
        self._every_s, self._min_gap_s = every_s, min_gap_s
        self._clock, self._wall = clock, wall
        self._schedules: dict[str, Schedule] = {}
        self._seq: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._on_published = on_published
        self.published_total = 0

    def changed(self, model: str) -> None:
        s = self._schedules.get(model)
        if s is not None and s.dirty:
            return  # already pending
        self._schedule(model).changed()
        self._wake.set()

    def forget(self, model: str) -> None:
        """`model`'s queue was reclaimed: no more samples of it. A new queue of it starts `seq` again with its
        counters, which the autoscaler reads as this gateway restarting for that model (the contract's rule)."""
        self._schedules.pop(model, None)
        self._seq.pop(model, None)

    def _schedule(self, model: str) -> Schedule:
        s = self._schedules.get(model)
        if s is None:
            s = self._schedules[model] = Schedule(self._every_s, self._min_gap_s)
        return s

    def sample(self, model: str) -> protocol.QueueSample:
        """The next sample of `model` (advances its `seq`)."""
        c = self._queues[model].counts()
        seq = self._seq[model] = self._seq.get(model, 0) + 1
        return protocol.QueueSample(
            gateway=self.gateway_id,
            model=model,
            seq=seq,
            ts=self._wall(),
            queue_depth=c.queue_depth,
            inflight=c.inflight,
            arrivals_total=c.arrivals_total,
            completions_total=c.completions_total,
            timeouts_total=c.timeouts_total,
        )

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self._wake.clear()  # before the pass: a change during it wakes the next one at once
            now = self._clock()
            for model in list(self._queues):
                if model not in self._queues:
                    continue  # reclaimed while an earlier sample of this pass was being sent
                sched = self._schedule(model)
                if sched.due_at() <= now:
                    await self._publish(model)
                    sched.published(now)
            next_at = min((s.due_at() for s in self._schedules.values()), default=now + self._every_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.0, next_at - self._clock()))

    async def _publish(self, model: str) -> None:
        try:
            await self._nc.publish(protocol.queue_subject(model), protocol.encode(self.sample(model)))
        except Exception as err:  # noqa: BLE001 - a sample lost is the next one's job; never stop the loop
            log.warning("queue sample for %s not published: %s", model, err)
            return
        self.published_total += 1
        if self._on_published is not None:
            self._on_published(model)
