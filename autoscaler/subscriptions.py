"""The sample subscriptions: which ``pulse.queue`` subjects this replica listens on, as its shards come and go.

While it holds every shard, one wildcard; else one subscription per model it owns, so a replica of three receives
a third of the fleet's samples. Every subscription's messages go to one queue, taken by one task
(`SampleIntake.consume`), not to a callback task per subscription. `SampleSubscriptions.follow_subjects`
re-subscribes each time the daemon says the models it owns changed, new subscriptions first; what the server sent
a dropped one before it was dropped is in the queue already, so a move loses no sample. The daemon composes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from autoscaler.intake import SampleIntake
from autoscaler.models import Models
from warmpool import protocol
from warmpool.connect import flush_without_cancel

__all__ = ["FLUSH_WAIT_S", "QUEUED_MAX", "SampleSubscriptions"]

log = logging.getLogger("pulsescale.autoscaler")

QUEUED_MAX = 1_000_000
"""Samples nats-py may queue for the taker, over every subscription: generous, since one it drops (its slow-consumer
error) is counted nowhere of ours, and the taker is cheap and coalesces into the intake's buffer."""
FLUSH_WAIT_S = 2.0
"""How long a re-subscription waits for the server's PONG before going on (the flush goes on meanwhile)."""


class SampleSubscriptions:
    """The samples' subscriptions for the models of the shards held (`models`, the daemon's `Models`)."""

    def __init__(self, intake: SampleIntake, models: Models) -> None:
        self.intake = intake
        self.models = models
        """The shards held and their models (`Models.held`, `Models.owned`); `Models.subjects_changed` says when
        they change."""
        self._flushing: set[asyncio.Task[None]] = set()  # flushes past `FLUSH_WAIT_S`, left to finish
        self.sample_subjects: frozenset[str] = frozenset()
        """The sample subjects subscribed to now (`follow_subjects`): the wildcard while this replica holds every
        shard."""
        self.queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=QUEUED_MAX)
        """Every sample subscription's messages, in the order nats-py read them (`SampleIntake.consume` takes
        them)."""

    async def follow_subjects(self, nc: Client, stop: asyncio.Event) -> None:
        """Subscribe to the samples this replica needs on `nc` (the samples' connection): while it holds every
        shard, one wildcard subscription; else one per model it owns, so a replica of three receives a third of
        the fleet's samples instead of all of them. The new subscriptions are in place at the server before the
        old are dropped, and what nats-py had queued for an old one is taken as the callback would take it, so a
        move loses no sample (a duplicate is counted as such, and folded once)."""
        subs: dict[str, Subscription] = {}
        self.sample_subjects = frozenset()
        changed = self.models.subjects_changed
        try:
            while not stop.is_set():
                await changed.wait()
                changed.clear()
                if len(self.models.held) == protocol.SHARDS:
                    want = {protocol.QUEUE_WILDCARD}
                else:
                    want = {protocol.QUEUE_PREFIX + m for m in self.models.owned()}
                failed = False
                for subject in sorted(want - set(subs)):
                    try:
                        subs[subject] = await self._subscribe(nc, subject)
                    except nats.errors.Error as err:  # disconnected: try again shortly
                        log.warning("cannot subscribe to %s: %s", subject, err)
                        failed = True
                        break
                # The server has the new subscriptions once the round trip is back, and every message it sent an
                # old one before it is in the queue: what was queued for a dropped one is taken all the same (and
                # counted `not_owned` where its model moved on).
                await flush_without_cancel(nc, FLUSH_WAIT_S, self._flushing)
                if not failed:
                    for subject in sorted(set(subs) - want):
                        with contextlib.suppress(nats.errors.Error):
                            await subs.pop(subject).unsubscribe()
                self.sample_subjects = frozenset(subs)
                if failed:
                    changed.set()
                    await asyncio.sleep(0.25)
        finally:
            for sub in subs.values():
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def _subscribe(self, nc: Client, subject: str) -> Subscription:
        """Subscribe to `subject` with no callback (nats-py starts no task for it) and point its queue at ours.
        nats-py keeps a subscription's messages only in ``_pending_queue``; its byte count per subscription is
        turned off (0), since nothing of nats-py takes them out to count them down: `QUEUED_MAX` bounds them."""
        sub = await nc.subscribe(subject, pending_msgs_limit=QUEUED_MAX, pending_bytes_limit=0)
        own, sub._pending_queue = sub._pending_queue, self.queue
        while not own.empty():  # none can have come yet (no read since the SUB), but none is lost if one did
            self.queue.put_nowait(own.get_nowait())
        return sub
