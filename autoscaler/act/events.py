"""One model's events on the wire: ``pulse.events.<model>``, published without awaiting the broker.

`Events` is made by the controller (`autoscaler.controller`) and shared with its scaler: the controller publishes
``scale.decision``, the scaler (`autoscaler.act.scaler`) and its slot actions (`autoscaler.act.slotactions`) the slots'
claims, readiness, failures and releases, the pool's exhaustion and the cold path's starts. A publish that fails
is logged at debug and forgotten: an event explains, it never holds up the path that caused it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client

from warmpool import protocol
from warmpool.protocol import EventType

__all__ = ["Events"]

log = logging.getLogger("pulsescale.scaler")


class Events:
    """Publishes `protocol.Event`s on ``pulse.events.<model>`` without awaiting the broker; `close()` cancels
    what is still in flight."""

    def __init__(self, nc: Client, model: str, clock: Callable[[], float]) -> None:
        self.nc = nc
        self.model = model
        self.subject = protocol.events_subject(model)
        self.clock = clock
        self._tasks: set[asyncio.Future[None]] = set()

    def publish(self, type_: EventType, **fields: Any) -> None:
        event = protocol.Event(type=type_, model=self.model, ts=self.clock(), **fields)
        task = asyncio.ensure_future(self.nc.publish(self.subject, protocol.encode(event)))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Future[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: event not published: %s", self.model, task.exception())

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
