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

__all__ = ["FLUSH_WAIT_S", "SampleSubscriptions", "flush_without_cancel"]

log = logging.getLogger("pulsescale.autoscaler")

FLUSH_WAIT_S = 2.0
"""How long a re-subscription waits for the server's PONG before going on (the flush goes on meanwhile)."""
FLUSH_KEEP_S = 300
"""The flush's own timeout: past the connection's ping interval, so the PONG comes or the connection is made anew
(nats-py then drops its queued PONG futures) before it."""


async def flush_without_cancel(nc: Client, wait_s: float, background: set[asyncio.Task[None]]) -> bool:
    """`nc.flush()`, waited for at most `wait_s`; True when the PONG came in that time. A flush that has not is left
    to finish in `background` (held there, so it is not collected) instead of timing out: nats-py's
    ``flush(timeout)`` cancels its PONG's future on a timeout but leaves it queued, and the PONG that comes later
    raises in the connection's read loop (``InvalidStateError``), which ends it. The connection then hears nothing
    more while it looks connected: in `bench decide --models 3000 --replicas 3` on a loaded machine, replicas whose
    2 s flush after a takeover's re-subscription timed out took no sample again (6 of 16 runs logged the error;
    in 3, no model of the killed replica was claimed again and the ingest counted 0 samples)."""

    async def flush() -> None:
        with contextlib.suppress(nats.errors.Error, TimeoutError):
            await nc.flush(timeout=FLUSH_KEEP_S)

    task = asyncio.ensure_future(flush())
    done, _ = await asyncio.wait([task], timeout=wait_s)
    if not done:
        background.add(task)
        task.add_done_callback(background.discard)
    return bool(done)


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
                # The server has the new subscriptions once the round trip is back, and nats-py has queued every
                # message the server sent an old one before it.
                await flush_without_cancel(nc, FLUSH_WAIT_S, self._flushing)
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
