"""A view of one KV bucket of contract records, kept by a watch: snapshot, then deltas; re-listed after every reconnect.

`BucketView` holds key -> (record, revision) for a bucket and tells subscribers what changed (`Snapshot`, then
`Changed` / `Removed`). It is the registry's read side of both its buckets (`warmpool.registry`), and the autoscaler
follows `pulse_scalers` with one. `check_record` is the rule every record read from a bucket is held to.
On a cluster a watch can also go silent with the connection up (its consumer lived on a server that died, or
nats-py moved the watch to a new inbox and could not make the consumer for it): a view silent for `WATCH_PROBE_S`
asks the server about its consumer, and re-lists unless it delivers to the view and holds nothing the view missed.
Both the answer and what the consumer sent ahead of the view are waited for on the loop's own time
(`loop_time_wait`): a process that was off the CPU is late, not lost, and a re-list costs it more CPU still.
A re-list that is needed decodes and indexes again only what changed (same revision: the record held is kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import AgentLease, SlotRecord
from warmpool.rejects import Rejections

__all__ = [
    "BucketView",
    "Changed",
    "Clock",
    "Removed",
    "Snapshot",
    "SlotEvent",
    "ViewEvent",
    "check_record",
    "loop_time_wait",
    "PROBE_TICK_S",
    "PROBE_WALL_MAX_S",
    "SNAPSHOT_QUIET_S",
    "WATCH_PROBE_S",
    "WATCH_PROBE_TIMEOUT_S",
]

log = logging.getLogger("pulsescale.registry")  # the registry's logger: operators filter on it

Clock = Callable[[], float]


# --- watch events -----------------------------------------------------------------------------------------------

V = TypeVar("V", bound=msgspec.Struct)


@dataclass(frozen=True)
class Snapshot(Generic[V]):
    """Every record as it is now; sent first and again after each reconnect. Replace, don't merge."""

    records: dict[str, V]


@dataclass(frozen=True)
class Changed(Generic[V]):
    key: str
    record: V
    revision: int


@dataclass(frozen=True)
class Removed:
    key: str
    revision: int


SlotEvent = Snapshot[SlotRecord] | Changed[SlotRecord] | Removed
ViewEvent = Snapshot[V] | Changed[V] | Removed


def check_record(key: str, value: msgspec.Struct) -> None:
    """Refuse a record whose own fields name another key than the one it is stored under (``subject_mismatch``:
    an agent may write only its node's keys, and the permissions check the key, never the value). A lease's slot
    count is the contract's to bound (`protocol.AgentLease`)."""
    named = value.node if isinstance(value, AgentLease) else getattr(value, "key", key)
    if named != key:
        raise BadMessage("subject_mismatch", f"a record for {named} is stored under key {key}")


# --- a bucket view --------------------------------------------------------------------------------------------

_RELIST_POLL_S = 0.25  # how often the view checks for a reconnect while idle; bounds re-list latency
WATCH_PROBE_S = 2.0
"""How long a watch may be silent before the view asks the server about its consumer. On a cluster the watch's
consumer (nats-py's ordered consumer: one replica, in memory) lives on one server; when that server dies the watch
goes silent with our connection up, so no reconnect tells us. nats-py notices only after two missed idle heartbeats
(10 s), or at a gap in the deliveries, and then moves the watch to a new inbox and asks for a consumer there once:
when that ask fails (a cluster mid-election), the old consumer, still named by the watch, lives on for its 5 min
inactivity threshold delivering to an inbox nobody reads. One `CONSUMER.INFO` per silent bucket per this interval
bounds the silence to about this plus `WATCH_PROBE_TIMEOUT_S`."""
SNAPSHOT_QUIET_S = 1.0
"""A listing whose end marker came but not the bucket's last revision before the watch asks the stream, after this
long without a delivery, whether that revision was removed meanwhile: then the listing is complete."""
WATCH_PROBE_TIMEOUT_S = 1.0
"""A probe unanswered this long counts as a lost consumer (or a cluster mid-election, when a re-list is what a
watch needs anyway): the watch is made anew, re-listing the bucket. The time is the loop's, not the wall's: the
wait is counted in ticks of `PROBE_TICK_S`, and a tick the loop overslept counts as one tick (`loop_time_wait`)."""
PROBE_TICK_S = 0.05
"""The step in which a probe's wait is counted. A process short of CPU (the 3,000-model bench on 2 shared cores:
its replicas' loops stalled 0.5-1.5 s, dozens of times a run) spends the wall clock's second before the answer is
taken from its socket; each probe so timed out re-listed the bucket (12,000 slots), and the re-list's CPU starved
the loop further. Counted in ticks, a stall costs one tick of the budget."""
PROBE_WALL_MAX_S = 10.0
"""However starved the loop, a probe is given up (its consumer called lost) after this long by the wall clock."""


async def loop_time_wait(
    done: Callable[[], bool],
    budget_s: float,
    *,
    wake: asyncio.Future[Any] | None = None,
    wall_max_s: float = PROBE_WALL_MAX_S,
) -> bool:
    """Wait until `done()` (True), or until `budget_s` of the loop's own time has passed without it (False), or
    `wall_max_s` by the wall clock. The wait is counted in ticks of `PROBE_TICK_S`, a tick that overslept (the loop
    was away: blocked, busy, or the process not scheduled) counting as one tick, so a loop stall does not spend the
    budget an answer had. `wake`: a future whose completion ends a tick early (the answer awaited)."""
    waited, started = 0.0, time.monotonic()
    while not done():
        t0 = time.monotonic()
        if waited >= budget_s or t0 - started >= wall_max_s:
            return False
        tick = min(PROBE_TICK_S, budget_s - waited)
        if wake is not None:
            await asyncio.wait([wake], timeout=tick)
        else:
            await asyncio.sleep(tick)
        waited += min(time.monotonic() - t0, PROBE_TICK_S)
    return True


class BucketView(Generic[V]):
    """Key -> (record, revision) for one bucket, kept by a watch that re-lists after every reconnect.

    `run()` keeps it (as a task); `changes()` yields a `Snapshot`, then `Changed` / `Removed` events, and a new
    `Snapshot` after each re-list. A record that breaks the contract is counted by `rejected` and treated as
    absent (`keep_bad=False`: a slot nobody can compare-and-set must not be offered) or ignored, keeping the last
    good record (`keep_bad=True`: a bad edit of a ScaledObject must not stop autoscaling its model).
    """

    def __init__(
        self,
        nc: Client,
        kv: KeyValue,
        type_: type[V],
        rejected: Rejections,
        *,
        keep_bad: bool = False,
        clock: Clock = time.time,
    ) -> None:
        self._nc = nc
        self._kv = kv
        self._type = type_
        self._rejected = rejected
        self._keep_bad = keep_bad
        self._clock = clock
        self._items: dict[str, tuple[V, int]] = {}
        self._heard: dict[str, float] = {}  # key -> when its current revision first reached this view, by `clock`
        self.ready = asyncio.Event()
        """Set once the first snapshot is in."""
        self.bucket = str(kv._name)
        """The bucket's name."""
        self.relists = 0
        """Watches made anew after the first (a reconnect, or a probe that found the consumer lost)."""
        self.spared: dict[str, int] = {"late": 0, "in_flight": 0}
        """Consumer probes that re-listed before `loop_time_wait`, and do not: ``late``, answered after
        `WATCH_PROBE_TIMEOUT_S` by the clock but within it by the loop's own time (the loop was away, not the
        consumer); ``in_flight``, a delivery reached the watch while the probe was out, or the consumer had sent what
        the watch had not handed over yet, and it came."""
        self.listed_at: float | None = None
        """Reader's time of the latest complete snapshot, by `clock`; None until one is in, and again while
        re-listing. (The registry gives its views its monotonic clock: it measures time since the listing.)"""
        self._listed_reconnects = -1  # the connection's reconnect count when that snapshot was taken
        self._subscribers: set[asyncio.Queue[ViewEvent[V]]] = set()
        self._on_change: Callable[[str, V | None, V | None], None] | None = None
        self._on_arrival: Callable[[str, V], None] | None = None
        """Told each record that *arrives* (a watch delta after the listing, or our own write), before the view
        changes; not one that a listing brings, whose write time is unknown (`warmpool.agentclocks` times leases
        by it)."""
        # Checked by the loops too: on Python 3.11 `wait_for` can swallow a cancellation that races a result.
        self.closed = False

    # --- reading ---------------------------------------------------------------------------------------------

    def get(self, key: str) -> tuple[V, int] | None:
        """(record, revision) of `key` in the view, or None."""
        return self._items.get(key)

    def value(self, key: str) -> V | None:
        hit = self._items.get(key)
        return hit[0] if hit is not None else None

    def revision(self, key: str) -> int | None:
        hit = self._items.get(key)
        return hit[1] if hit is not None else None

    def heard_at(self, key: str) -> float | None:
        """When `key`'s current revision first reached this view (a watch delta, our own write, or the listing that
        first showed it), by `clock`; a re-listing of the same revision keeps the time. None: not in the view.
        How long a record has stood unchanged, judged on the reader's clock: the writer's ``updated_at`` is on the
        writer's clock, which may be seconds or minutes off (contract revision 10)."""
        return self._heard.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[str]:
        return list(self._items)

    def values(self) -> list[V]:
        return [v for v, _ in self._items.values()]

    def entries(self) -> list[tuple[str, V, int]]:
        return [(k, v, rev) for k, (v, rev) in self._items.items()]

    def current(self) -> bool:
        """True when the view was listed on the connection as it is now: connected, and re-listed since the last
        reconnect. While False, what the view holds may be arbitrarily old."""
        return (
            self.listed_at is not None
            and self._nc.is_connected
            and self._nc.stats["reconnects"] == self._listed_reconnects
        )

    # --- changes ---------------------------------------------------------------------------------------------

    def decode(self, key: str, data: bytes) -> V | None:
        try:
            value = protocol.decode(data, self._type)
            check_record(key, value)
            return value
        except BadMessage as err:
            self._rejected(err, source=f"{self._kv._name}/{key}")
            return None

    def apply_local(self, key: str, value: V, revision: int) -> None:
        """Our own acknowledged write: visible to our next decision (and to subscribers) before the watch
        echoes it; the echo is then skipped, so each revision is published once."""
        cur = self._items.get(key)
        if cur is None or cur[1] < revision:
            if self._on_arrival is not None:
                self._on_arrival(key, value)
            self._set(key, value, revision)
            if self.ready.is_set():
                self._publish(Changed(key, value, revision))

    def forget(self, key: str) -> None:
        """Drop `key` from the view (a read found it gone or unreadable)."""
        if key in self._items:
            self._set(key, None, self._items[key][1])

    def _set(self, key: str, value: V | None, revision: int) -> None:
        old = self._items.get(key)
        if value is None:
            self._items.pop(key, None)
            self._heard.pop(key, None)
        else:
            self._items[key] = (value, revision)
            if old is None or old[1] != revision:
                self._heard[key] = self._clock()
        if self._on_change is not None:
            self._on_change(key, old[0] if old else None, value)

    def _publish(self, event: ViewEvent[V]) -> None:
        for q in self._subscribers:
            q.put_nowait(event)

    def subscribe(self) -> asyncio.Queue[ViewEvent[V]]:
        q: asyncio.Queue[ViewEvent[V]] = asyncio.Queue()
        if self.ready.is_set():
            q.put_nowait(Snapshot({k: v for k, (v, _) in self._items.items()}))
        self._subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue[ViewEvent[V]]) -> None:
        self._subscribers.discard(q)

    async def changes(self) -> AsyncIterator[ViewEvent[V]]:
        """A `Snapshot` of the bucket, then each change; a new `Snapshot` after every re-list."""
        q = self.subscribe()
        try:
            while True:
                yield await q.get()
        finally:
            self.unsubscribe(q)

    async def run(self) -> None:
        while not self.closed:
            reconnects = self._nc.stats["reconnects"]
            try:
                newest, stream = await self._newest()
                watcher = await self._kv.watchall()
            except (TimeoutError, nats.errors.Error, OSError) as err:
                log.debug("watch not (yet) possible: %s", err)
                await asyncio.sleep(_RELIST_POLL_S)
                continue
            try:
                await self._follow(watcher, reconnects, newest, stream)
            finally:
                self.listed_at = None
                with contextlib.suppress(Exception):
                    await watcher.stop()
            self.relists += 1

    async def _consumer_lost(self, watcher: KeyValue.KeyWatcher, delivered: int) -> str | None:
        """Ask the server for the watch's consumer; why the watch is lost, or None. Lost when the consumer is gone
        or the server does not answer within `WATCH_PROBE_TIMEOUT_S` of this loop's time, when it delivers to
        another inbox than the watch reads (see `WATCH_PROBE_S`), or when it sent or holds revisions newer than
        `delivered`, the newest the watch handed over, and nothing reaches the watch within that time either (CI:
        a store's view missed a lease for 15 s after a follower's kill while the consumer probe found a consumer).
        Sent but not yet handed over is also what a busy loop looks like (the deliveries wait in its socket, or the
        write came while the probe was out): that waits for them rather than re-list the bucket."""
        sub = watcher._sub  # nats-py keeps the watch's subscription (and the consumer's name) only here
        if sub is None:
            return "the watch has no subscription"
        # The request's own timeout is the wall clock's bound; the budget is the loop's time (`loop_time_wait`).
        js = self._nc.jetstream(timeout=PROBE_WALL_MAX_S)
        asked = asyncio.ensure_future(js.consumer_info(sub._stream, sub._consumer))
        started = time.monotonic()
        updates = watcher._updates
        # A delivery while the probe is out answers it (the watch hears), and is not kept waiting behind it.
        answered = await loop_time_wait(lambda: asked.done() or not updates.empty(), WATCH_PROBE_TIMEOUT_S, wake=asked)
        if not asked.done() and not updates.empty():
            asked.cancel()
            await asyncio.gather(asked, return_exceptions=True)
            self.spared["in_flight"] += 1
            return None
        if not answered:
            asked.cancel()
            await asyncio.gather(asked, return_exceptions=True)
            return (
                f"its consumer's server did not answer within {WATCH_PROBE_TIMEOUT_S:g} s of this process's time "
                f"({time.monotonic() - started:.1f} s by the clock)"
            )
        if time.monotonic() - started > WATCH_PROBE_TIMEOUT_S:
            self.spared["late"] += 1  # answered, where a timeout by the clock would have re-listed
        try:
            info = asked.result()
        except (nats.errors.Error, TimeoutError, OSError) as err:  # NotFoundError: gone with its server
            return f"its consumer is not found ({type(err).__name__}: {err})"
        inbox = getattr(getattr(sub, "_sub", None), "_subject", None)  # moved by nats-py's reset; sub's own is not
        if inbox is not None and info.config.deliver_subject != inbox:
            return f"the watch reads {inbox}, its consumer delivers to {info.config.deliver_subject}"
        sent = (info.delivered.stream_seq if info.delivered is not None else 0) or 0
        if not info.num_pending and sent <= delivered:
            return None
        if await loop_time_wait(lambda: not updates.empty(), WATCH_PROBE_TIMEOUT_S):
            self.spared["in_flight"] += 1  # on its way: handed over next; a silence probes again
            return None
        return (
            f"its consumer sent up to revision {sent} and holds {info.num_pending} more, the watch handed over "
            f"{delivered} and nothing since"
        )

    async def _newest(self) -> tuple[int, str]:
        """The bucket's newest revision before the watch starts (the snapshot holds at least up to it, see
        `_follow`) and its stream's name. 0 when the bucket is empty, or when the server does not answer within
        `WATCH_PROBE_TIMEOUT_S`: while a cluster elects, waiting the KV timeout here too held a re-list past 15 s
        (tests/warmpool/test_cluster.py, 2 runs in 6 beside a CPU hog), so the end marker alone decides then, as
        before."""
        status = asyncio.ensure_future(self._kv.status())
        await asyncio.wait([status], timeout=WATCH_PROBE_TIMEOUT_S)  # asyncio.wait: see `LeaderElection.campaign`
        if not status.done():
            status.cancel()
            log.debug("%s: no stream info in time: the listing ends at the marker", self._kv._name)
            return 0, ""
        try:
            got = status.result()
        except (nats.errors.Error, TimeoutError, OSError) as err:
            log.debug("%s: no stream info (%s): the listing ends at the marker", self._kv._name, err)
            return 0, ""
        return (got.stream_info.state.last_seq if got.values else 0), got.stream_info.config.name or ""

    async def _gone(self, stream: str, revision: int) -> bool:
        """Whether the stream says `revision` is not there (any other answer, or none in time: not known gone)."""
        js = self._nc.jetstream(timeout=WATCH_PROBE_TIMEOUT_S)
        try:
            await js.get_msg(stream, seq=revision)
        except nats.js.errors.NotFoundError:
            return True
        except (nats.errors.Error, TimeoutError, OSError):
            return False
        return False

    async def _follow(self, watcher: KeyValue.KeyWatcher, reconnects: int, newest: int, stream: str) -> None:
        """Follow `watcher`: collect the initial values into a snapshot, install it, then apply each change.

        The snapshot is complete when nats-py's end-of-initial-values marker has come *and* the watch delivered
        `newest`, the bucket's last revision before the watch began. nats-py can send the marker early: before
        deliveries still in flight when it asked for the consumer's pending count, or at a message whose pending
        count read 0 under concurrent writes (nats-io/nats.py#995). A view then went ready holding part of the
        bucket, or none of it (a second store called a live agent stale, in CI). When the watch is quiet for
        `SNAPSHOT_QUIET_S` without `newest`, the stream is asked for it: gone (purged meanwhile), the snapshot is
        taken; still there, the view waits on (a stalled delivery: the consumer probe re-lists if it is lost)."""
        snapshot: dict[str, tuple[V, int]] | None = {}
        kept_bad: set[str] = set()  # keys listed with an unreadable value, whose last good record stands
        marked, delivered = False, 0  # the marker came; the newest revision the listing delivered
        heard = time.monotonic()  # when the watch last delivered, or a probe found its consumer
        asked = heard  # when the stream was last asked whether `newest` is still there
        while self._nc.stats["reconnects"] == reconnects and not self.closed:
            if snapshot is not None and marked and delivered >= newest:
                self._install(snapshot, kept_bad, reconnects)
                snapshot = None
            try:
                # Entries already queued are taken without `updates()`, whose `wait_for` costs a task and a timer
                # per entry (nats-py keeps the queue only here): the echoes of concurrent claims come in bursts.
                entry = watcher._updates.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    entry = await watcher.updates(timeout=_RELIST_POLL_S)
                except nats.errors.TimeoutError:
                    if snapshot is not None and marked and time.monotonic() - max(heard, asked) >= SNAPSHOT_QUIET_S:
                        asked = time.monotonic()
                        if await self._gone(stream, newest):
                            log.info(
                                "%s listed up to revision %d: %d, the newest before the watch, was removed since",
                                self._kv._name,
                                delivered,
                                newest,
                            )
                            delivered = newest
                            continue
                    if time.monotonic() - heard >= WATCH_PROBE_S:
                        heard = time.monotonic()
                        if (why := await self._consumer_lost(watcher, delivered)) is not None:
                            log.warning(
                                "the watch of %s lost its deliveries (its consumer's server is gone, or nats-py's"
                                " reset of it failed: %s): re-listing",
                                self._kv._name,
                                why,
                            )
                            return
                    continue
            heard = time.monotonic()
            if isinstance(entry, KeyValue.Entry):
                rev = entry.revision or 0
                delivered = max(delivered, rev)
                cur = self._items.get(entry.key)
                if cur is not None and (cur[1] >= rev if snapshot is None else cur[1] == rev):
                    if snapshot is not None:  # a re-list: what the view holds at this revision is not decoded again
                        snapshot[entry.key] = cur
                        kept_bad.discard(entry.key)
                    continue  # our own write, already applied and published by `apply_local`: not decoded again
                value = None
                if entry.operation not in ("DEL", "PURGE") and entry.value is not None:
                    value = self.decode(entry.key, entry.value)
                    if value is None and self._keep_bad:
                        if snapshot is not None:
                            snapshot.pop(entry.key, None)
                            kept_bad.add(entry.key)
                        continue  # counted; the last good record stands
                kept_bad.discard(entry.key)
                if snapshot is not None:
                    if value is None:
                        snapshot.pop(entry.key, None)
                    else:
                        snapshot[entry.key] = (value, rev)
                    continue
                cur = self._items.get(entry.key)
                if value is None and cur is None:
                    continue  # nothing to remove
                if value is not None and self._on_arrival is not None:
                    self._on_arrival(entry.key, value)
                self._set(entry.key, value, rev)
                self._publish(Changed(entry.key, value, rev) if value is not None else Removed(entry.key, rev))
            elif entry is None and snapshot is not None and not marked:
                marked = True  # the end of the initial values, by nats-py: installed once `newest` is in too
            else:
                return  # the watcher was stopped under us
        if not self.closed:
            log.info("reconnected: re-listing the bucket")

    def _install(self, snapshot: dict[str, tuple[V, int]], kept_bad: set[str], reconnects: int) -> None:
        """Swap the whole view for a complete snapshot (deletes missed while away vanish here), keeping our own
        writes that are newer than it (their echo comes as a delta) and the last good record of a bad one."""
        old = self._items
        for key, (value, rev) in old.items():
            if (key in snapshot and snapshot[key][1] < rev) or key in kept_bad:
                snapshot[key] = (value, rev)
        self._items = snapshot
        # Heard now: what the listing brings anew (its write time is unknown: its age counts from here); an
        # unchanged revision keeps its time, and what the listing no longer holds is forgotten.
        now, heard = self._clock(), self._heard
        self._heard = {
            key: heard[key] if key in old and old[key][1] == rev and key in heard else now
            for key, (_, rev) in snapshot.items()
        }
        if self._on_change is not None:  # what a re-list found unchanged (same revision) is not indexed again
            for key in old.keys() | snapshot.keys():
                before, after = old.get(key), snapshot.get(key)
                if before is None or after is None or before[1] != after[1]:
                    self._on_change(key, before[0] if before else None, after[0] if after else None)
        self.listed_at = self._clock()
        self._listed_reconnects = reconnects
        self._publish(Snapshot({k: v for k, (v, _) in self._items.items()}))
        self.ready.set()
