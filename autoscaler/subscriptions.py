"""The sample subscriptions: which ``pulse.queue`` subjects this replica listens on, as its shards come and go.

While it holds every shard, one wildcard; else one subscription per model it owns, so a replica of three receives
a third of the fleet's samples. `SampleSubscriptions.follow_subjects` re-subscribes each time the daemon says the
models it owns changed, new subscriptions first, and hands what nats-py had queued for a dropped one to the
intake (`autoscaler.intake`), so a move loses no sample. The daemon composes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from autoscaler.intake import Queued, SampleIntake
from autoscaler.models import Models
from warmpool import protocol

__all__ = ["SampleSubscriptions"]

log = logging.getLogger("pulsescale.autoscaler")


class SampleSubscriptions:
    """The samples' subscriptions for the models of the shards held (`models`, the daemon's `Models`)."""

    def __init__(self, intake: SampleIntake, models: Models) -> None:
        self.intake = intake
        self.models = models
        """The shards held and their models (`Models.held`, `Models.owned`); `Models.subjects_changed` says when
        they change."""
        self.sample_subjects: frozenset[str] = frozenset()
        """The sample subjects subscribed to now (`follow_subjects`): the wildcard while this replica holds every
        shard."""

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
                        # nats-py's own queue in front of the callback: generous, since a message it drops is
                        # counted nowhere of ours (the callback is cheap and coalesces into `samples`).
                        queued = Queued()  # the callback reads its own queue's length (catching up)
                        subs[subject] = queued.sub = await nc.subscribe(
                            subject,
                            cb=functools.partial(self.intake.on_queue_msg, queued=queued),
                            pending_msgs_limit=1_000_000,
                        )
                    except nats.errors.Error as err:  # disconnected: try again shortly
                        log.warning("cannot subscribe to %s: %s", subject, err)
                        failed = True
                        break
                with contextlib.suppress(nats.errors.Error, TimeoutError):
                    # The server has the new subscriptions once the round trip is back, and nats-py has queued
                    # every message the server sent an old one before it.
                    await nc.flush(timeout=2)
                left: list[Msg] = []
                if not failed:
                    for subject in sorted(set(subs) - want):
                        sub = subs.pop(subject)
                        left += _queued(sub)  # an unsubscribe drops them uncounted; no await until it has
                        with contextlib.suppress(nats.errors.Error):
                            await sub.unsubscribe()
                self.sample_subjects = frozenset(subs)
                await self.intake.take_backlog(left)  # folded, or counted `not_owned`
                if failed:
                    changed.set()
                    await asyncio.sleep(0.25)
        finally:
            for sub in subs.values():
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()


def _queued(sub: Subscription) -> list[Msg]:
    """The messages nats-py has read for `sub` and not yet handed to its callback, taken out of its queue."""
    queue = sub._pending_queue  # nats-py keeps them only here (its `drain` waits on the queue, with no bound)
    out: list[Msg] = []
    while True:
        try:
            out.append(queue.get_nowait())
        except asyncio.QueueEmpty:
            return out
