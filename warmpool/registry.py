"""The slot registry on JetStream KV: fenced claims by compare-and-set, agent leases, and watches.

Buckets (names from `protocol`): `pulse_slots` holds one `SlotRecord` per ``<model>.<node>.<slot>``;
`pulse_agents` holds one `AgentLease` per node. Every slot write is ``kv.update(key, value, last=rev)`` on the
revision we last saw, so the server decides every race. The revision of the claim write is the claim's fencing
token; with the random `claim_id` it is what a holder must present to move the slot on.

A `KvSlotStore` keeps a view of both buckets from KV watches (snapshot, then deltas; re-listed after every
reconnect, since watches do not resume by themselves). Claims pick candidates from the view and let the
compare-and-set say whether the view was current: reads are not read-your-writes, so no decision rests on one.
`BucketView` is that view for any bucket of contract records; the autoscaler follows `pulse_scalers` with one.
On a cluster a watch can also go silent with the connection up (its consumer lived on a server that died): a
view silent for `WATCH_PROBE_S` asks whether its consumer still exists, and re-lists if not.

The buckets are made and opened by `warmpool.buckets` (re-exported here): `replicas_for` replicas, raised by the
autoscaler on an existing bucket that has fewer; other roles report it.

Leases are judged by the reader's clock, and only on a current view: after a reconnect the agents' view is
re-listed, and a lease is called lapsed only once its agent had two heartbeat intervals since to renew it
(`lease_lapsed`). Without that, an outage longer than a lease would make every healthy agent look dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import placement, protocol, slots
from warmpool.buckets import (
    ALL_BUCKETS,
    KV_REPLICAS_ENV,
    BucketSettings,
    KvReplicasError,
    ensure_buckets,
    parse_replicas,
    replicas_for,
)
from warmpool.errors import (
    BadMessage,
    ClaimConflict,
    InvalidTransition,
    NoSlotAvailable,
    SlotNotFound,
    StaleToken,
)
from warmpool.protocol import AgentLease, SlotRecord, SlotState
from warmpool.rejects import Rejections
from warmpool.tasks import cancel_and_wait

__all__ = [
    "BucketSettings",
    "BucketView",
    "Changed",
    "Claim",
    "KvSlotStore",
    "Removed",
    "Snapshot",
    "SlotEvent",
    "ALL_BUCKETS",
    "check_record",
    "KV_REPLICAS_ENV",
    "KvReplicasError",
    "ensure_buckets",
    "parse_replicas",
    "replicas_for",
]

log = logging.getLogger("pulsescale.registry")

Clock = Callable[[], float]


@dataclass(frozen=True)
class Claim:
    """A held slot. `token` is the claim write's revision (the fencing token); `revision` the latest write."""

    key: str
    token: int
    claim_id: str
    revision: int
    record: SlotRecord

    @property
    def model(self) -> str:
        return self.record.model

    @property
    def node(self) -> str:
        return self.record.node

    @property
    def slot(self) -> str:
        return self.record.slot


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
"""How long a watch may be silent before the view asks the server whether its consumer still exists. On a
cluster the watch's consumer (nats-py's ordered consumer: one replica, in memory) lives on one server; when that
server dies the watch goes silent with our connection up, so no reconnect tells us. nats-py notices only after
two missed idle heartbeats (10 s) and tries once to recreate it. One `CONSUMER.INFO` per silent bucket per this
interval bounds the silence to about this plus `WATCH_PROBE_TIMEOUT_S`."""
SNAPSHOT_QUIET_S = 1.0
"""A listing whose end marker came but not the bucket's last revision before the watch asks the stream, after this
long without a delivery, whether that revision was removed meanwhile: then the listing is complete."""
WATCH_PROBE_TIMEOUT_S = 1.0
"""A probe unanswered this long counts as a lost consumer (or a cluster mid-election, when a re-list is what a
watch needs anyway): the watch is made anew, re-listing the bucket."""


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
        self.ready = asyncio.Event()
        """Set once the first snapshot is in."""
        self.relists = 0
        self.listed_at: float | None = None
        """Reader's time of the latest complete snapshot; None until one is in, and again while re-listing."""
        self._listed_reconnects = -1  # the connection's reconnect count when that snapshot was taken
        self._subscribers: set[asyncio.Queue[ViewEvent[V]]] = set()
        self._on_change: Callable[[str, V | None, V | None], None] | None = None
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
        else:
            self._items[key] = (value, revision)
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

    async def _consumer_lost(self, watcher: KeyValue.KeyWatcher) -> bool:
        """Ask the server for the watch's consumer: True when it says it is gone or does not answer in time."""
        sub = watcher._sub  # nats-py keeps the watch's subscription (and the consumer's name) only here
        if sub is None:
            return True
        js = self._nc.jetstream(timeout=WATCH_PROBE_TIMEOUT_S)
        try:
            await js.consumer_info(sub._stream, sub._consumer)
        except (nats.errors.Error, TimeoutError, OSError):
            return True  # NotFoundError: gone with its server; a timeout: gone, or the cluster mid-election
        return False

    async def _newest(self) -> tuple[int, str]:
        """The bucket's newest revision before the watch starts (the snapshot holds at least up to it, see
        `_follow`) and its stream's name. 0 when the bucket is empty, or when the server does not answer within
        `WATCH_PROBE_TIMEOUT_S`: while a cluster elects, waiting the KV timeout here too held a re-list past 15 s
        (tests/test_cluster.py, 2 runs in 6 beside a CPU hog), so the end marker alone decides then, as before."""
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
                        if await self._consumer_lost(watcher):
                            log.warning(
                                "the watch of %s lost its consumer (its server is gone?): re-listing", self._kv._name
                            )
                            return
                    continue
            heard = time.monotonic()
            if isinstance(entry, KeyValue.Entry):
                rev = entry.revision or 0
                delivered = max(delivered, rev)
                if snapshot is None and (cur := self._items.get(entry.key)) is not None and cur[1] >= rev:
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
        if self._on_change is not None:
            for key in old.keys() | snapshot.keys():
                before, after = old.get(key), snapshot.get(key)
                self._on_change(key, before[0] if before else None, after[0] if after else None)
        self.listed_at = self._clock()
        self._listed_reconnects = reconnects
        self._publish(Snapshot({k: v for k, (v, _) in self._items.items()}))
        self.ready.set()


# --- the store ------------------------------------------------------------------------------------------------


class KvSlotStore:
    """The slot registry on JetStream KV. Use ``async with await KvSlotStore.open(nc) as store:``.

    Reading is from the views (`record`, `entry`, `records`, `lease`, `leases`, `claimable`; no I/O), writing is by
    compare-and-set: claims (`claim`, `claim_slot`), the holder's moves (`advance`, `release`), the agent's
    (`register`, `set_state`, `heartbeat`, `withdraw`), drains, and `watch` for the slot changes."""

    # A claim tries at most this many candidates that turn out to be taken before it reports a conflict:
    # a loser of a race learns the truth from the compare-and-set and moves on to the next slot.
    max_claim_attempts = 16

    def __init__(
        self,
        nc: Client,
        buckets: dict[str, KeyValue],
        *,
        clock: Clock = time.time,
        rng: random.Random | None = None,
        resolve_timeout_s: float = 10.0,
        on_reject: Callable[[str], None] | None = None,
    ) -> None:
        self.nc = nc
        self.clock = clock
        self.rng = rng or random.Random()
        self.resolve_timeout_s = resolve_timeout_s
        """How long a claim whose outcome is unknown (broker gone mid-write) keeps asking the broker."""
        self.rejected = Rejections(log, on_reject=on_reject)
        """Records in the buckets that break the contract: skipped, counted by reason, logged at a bounded rate;
        `on_reject(reason)` binds the owner's metric (``pulsescale_registry_rejected_records_total``)."""
        self._slots_kv = buckets[protocol.SLOTS_BUCKET]
        self._agents_kv = buckets[protocol.AGENTS_BUCKET]
        self.slots: BucketView[SlotRecord] = BucketView(nc, self._slots_kv, SlotRecord, self.rejected, clock=clock)
        self.agents: BucketView[AgentLease] = BucketView(nc, self._agents_kv, AgentLease, self.rejected, clock=clock)
        # Indexes kept in step with the view, so a claim looks only at the model's warm and held slots.
        self._by_model: dict[str, set[str]] = {}
        self._warm: dict[str, dict[int, dict[str, set[str]]]] = {}  # model -> tier -> node -> keys
        self._offered: dict[str, frozenset[str]] = {}  # node -> slot names its lease lists
        self._pools: dict[str, placement.Pool] = {}  # model -> its warm slots filed for `placement.Pool.pick`
        self._parked_in: dict[str, set[str]] = {}  # node -> models whose pool parked it (refiled on a lease change)
        self._reserved: dict[str, SlotRecord] = {}
        """Slots whose claim by this store is in flight (key -> the record the claim was built on): out of their
        pool and counted as load on their node until the broker answers, so a concurrent local claimer neither
        tries the same slot (a certain lost race: two round trips) nor piles onto the same node."""
        self.claim_conflicts = 0
        """Claim compare-and-sets lost to another writer (each one a wasted round trip plus a re-read)."""
        self.slots._on_change = self._index
        self.agents._on_change = self._index_lease
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def open(
        cls,
        nc: Client,
        *,
        settings: BucketSettings = BucketSettings(),
        timeout_s: float = 2.0,
        **kwargs: Any,
    ) -> KvSlotStore:
        """`timeout_s` bounds each KV call: a claim caught by a broker restart learns its fate (by reading
        it back) after this long instead of the client's default 5 s."""
        buckets = await ensure_buckets(
            nc.jetstream(timeout=timeout_s), settings, names=(protocol.SLOTS_BUCKET, protocol.AGENTS_BUCKET)
        )
        return cls(nc, buckets, **kwargs)

    def _index(self, key: str, old: SlotRecord | None, new: SlotRecord | None) -> None:
        for rec, delta in ((old, -1), (new, 1)):
            if rec is None:
                continue
            m = rec.model
            if delta > 0:
                self._by_model.setdefault(m, set()).add(key)
            else:
                self._by_model[m].discard(key)
            if rec.state == "warm" and not rec.drain:
                t = placement.tier(rec)
                keys = self._warm.setdefault(m, {}).setdefault(t, {}).setdefault(rec.node, set())
                if delta > 0:
                    keys.add(key)
                    if key not in self._reserved:  # filed again when its claim is answered (`_unreserve`)
                        self._pool(m).add_warm(key, t, rec.node, rec.rack)
                else:
                    keys.discard(key)
                    self._pool(m).remove_warm(key, t, rec.node)
            elif rec.state in slots.HELD_STATES:
                self._pool(m).held(rec.node, rec.rack, delta)

    def _pool(self, model: str) -> placement.Pool:
        pool = self._pools.get(model)
        if pool is None:

            def parked(node: str, model: str = model) -> None:
                self._parked_in.setdefault(node, set()).add(model)

            pool = self._pools[model] = placement.Pool(on_park=parked)
        return pool

    def _reserve(self, key: str, rec: SlotRecord) -> None:
        """A claim of `key` (warm in the view as `rec`) is about to be sent: take it out of its pool and count it
        as load on its node, as a claim that already landed would be."""
        pool = self._pool(rec.model)
        pool.remove_warm(key, placement.tier(rec), rec.node)
        pool.held(rec.node, rec.rack, 1)
        self._reserved[key] = rec

    def _unreserve(self, key: str) -> None:
        """The claim of `key` is answered (either way): undo `_reserve`, then file the slot as the view has it now
        (still warm when the claim was lost to a write we have not seen; the caller applies a won claim at once)."""
        rec = self._reserved.pop(key)
        pool = self._pool(rec.model)
        pool.held(rec.node, rec.rack, -1)
        cur = self.slots.value(key)
        if cur is not None and cur.state == "warm" and not cur.drain:
            pool.add_warm(key, placement.tier(cur), cur.node, cur.rack)

    def _index_lease(self, node: str, _old: AgentLease | None, new: AgentLease | None) -> None:
        if new is None:
            self._offered.pop(node, None)
        else:
            self._offered[node] = frozenset(new.slots)
        for model in self._parked_in.pop(node, ()):
            if (pool := self._pools.get(model)) is not None:
                pool.unpark(node)

    def _usable(self, model: str, node: str, keys: Collection[str], now: float) -> list[str]:
        """The keys among `keys` (warm slots of `model` on `node`) that a claim may take at `now`: none unless the
        node's lease is fresh, and only the slots that lease lists (a record alone offers nothing: any key under
        the node can be written by its agent user). Costs at most `protocol.MAX_SLOTS_PER_NODE` lookups."""
        lease = self.lease(node)
        if lease is None or not lease.fresh(now):
            return []
        names = self._offered.get(node, frozenset())
        if len(keys) <= len(names):
            # A key is `protocol.slot_key`'s "<model>.<node>.<slot>" (`check_record` holds every record to it).
            start = len(model) + len(node) + 2
            return [k for k in keys if k[start:] in names]
        return [key for name in names if (key := f"{model}.{node}.{name}") in keys]

    async def start(self, timeout_s: float = 10.0) -> None:
        """Start the watches and wait for their first snapshot."""
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self.slots.run(), name="registry-watch-slots"),
                asyncio.create_task(self.agents.run(), name="registry-watch-agents"),
            ]
        await asyncio.wait_for(asyncio.gather(self.slots.ready.wait(), self.agents.ready.wait()), timeout_s)

    async def stop_slot_watch(self) -> None:
        """Stop following `pulse_slots`; the view keeps what it holds, and our own writes (`apply_local`). For
        `pulsescale bench claims --without-slot-watch`, which shows what receiving our claims' echoes costs."""
        self.slots.closed = True
        await cancel_and_wait(self._tasks[:1])

    @property
    def watching_slots(self) -> bool:
        return bool(self._tasks) and not self._tasks[0].done()

    async def close(self) -> None:
        self.slots.closed = self.agents.closed = True
        await cancel_and_wait(self._tasks)
        self._tasks = []

    async def __aenter__(self) -> KvSlotStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- reading -----------------------------------------------------------------------------------------------

    def record(self, key: str) -> SlotRecord | None:
        """The slot under `key` in the view, or None."""
        return self.slots.value(key)

    def entry(self, key: str) -> tuple[SlotRecord, int] | None:
        """(record, revision) of the slot under `key` in the view, or None."""
        return self.slots.get(key)

    def records(self, model: str | None = None) -> list[SlotRecord]:
        """Slots in the current view (of one model, or all)."""
        if model is None:
            return self.slots.values()
        return [rec for k in self._by_model.get(model, ()) if (rec := self.slots.value(k)) is not None]

    def lease(self, node: str) -> AgentLease | None:
        return self.agents.value(node)

    def leases(self) -> dict[str, AgentLease]:
        return {node: lease for node, lease, _ in self.agents.entries()}

    def nodes(self) -> set[str]:
        """Every node that has a lease or a slot in the views."""
        return {r.node for r in self.slots.values()} | set(self.agents.keys())

    def claimable(self, model: str, now: float | None = None) -> list[SlotRecord]:
        """The model's slots that a claim could take at `now` (default: the store's clock)."""
        now = self.clock() if now is None else now
        out = []
        for by_node in self._warm.get(model, {}).values():
            for node, keys in by_node.items():
                out += [rec for k in self._usable(model, node, keys, now) if (rec := self.record(k)) is not None]
        return out

    def lease_lapsed(self, node: str, now: float) -> bool:
        """True only when we *know* the agent of `node` stopped renewing: its lease is missing or old in a view
        that is current, and the agent had two heartbeat intervals since that view was listed to renew it.

        A stale view (disconnected, or not re-listed since a reconnect) proves nothing: after a broker outage
        longer than a lease, every agent's last heartbeat is old until the agents reconnect and renew."""
        view = self.agents
        if not view.current() or view.listed_at is None:
            return False
        lease = self.lease(node)
        if lease is None:
            return True  # withdrawn (a clean shutdown), or gone from a current listing
        if lease.fresh(now):
            return False
        # Two intervals, not one: the agent reconnects on its own schedule (possibly after us), and its first
        # write after the outage may be a stale buffered heartbeat replayed by its client.
        return now - view.listed_at >= 2 * lease.renew_every_s

    async def get(self, key: str) -> tuple[SlotRecord, int]:
        """Read one slot from the broker (not the view)."""
        try:
            entry = await self._slots_kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            raise SlotNotFound(f"no slot {key} in {protocol.SLOTS_BUCKET}") from None
        assert entry.value is not None and entry.revision is not None
        rec = protocol.decode(entry.value, SlotRecord)
        check_record(key, rec)
        return rec, entry.revision

    async def _refresh(self, key: str) -> tuple[SlotRecord, int] | None:
        try:
            rec, rev = await self.get(key)
        except (SlotNotFound, BadMessage):
            self.slots.forget(key)
            return None
        self.slots.apply_local(key, rec, rev)
        return rec, rev

    # --- claims --------------------------------------------------------------------------------------------------

    async def claim(self, model: str, *, exclude: Iterable[str] = ()) -> Claim:
        """Claim the best claimable slot of `model`, or raise `NoSlotAvailable` / `ClaimConflict`.

        While the bucket's stream has no leader (a cluster electing one after a server died, a few seconds),
        the write has no taker and nats-py's `NoStreamResponseError` comes out at once: the write did not land,
        and trying other slots cannot help, so it is not turned into a `ClaimConflict` (whose callers retry at
        once); callers wait a moment as for any broker error."""
        skip = set(exclude)
        conflicts = 0
        while True:
            now = self.clock()

            def usable(node: str, keys: Collection[str], now: float = now) -> list[str]:
                return self._usable(model, node, keys, now)

            pool = self._pools.get(model)
            key = pool.pick(usable=usable, skip=skip, rng=self.rng) if pool is not None else None
            if key is None:
                raise NoSlotAvailable(f"no claimable slot of model {model}")
            try:
                return await self._claim_one(self.slots.get(key), now)
            except ClaimConflict:
                conflicts += 1
                skip.add(key)
                if conflicts >= self.max_claim_attempts:
                    raise ClaimConflict(
                        f"lost {conflicts} races for slots of {model} in a row; the pool is contended"
                    ) from None

    async def claim_slot(self, key: str) -> Claim:
        """Claim one named slot (the on-call path and tests)."""
        hit = self.slots.get(key) or await self._refresh(key)
        if hit is None:
            raise SlotNotFound(f"no slot {key}")
        rec = hit[0]
        if not slots.claimable(rec, self.lease(rec.node), self.clock()):
            raise NoSlotAvailable(f"slot {key} is {rec.state}{' (drained)' if rec.drain else ''} or its agent is stale")
        return await self._claim_one(hit, self.clock())

    async def _claim_one(self, hit: tuple[SlotRecord, int] | None, now: float) -> Claim:
        if hit is None:
            raise ClaimConflict("the slot left the view")
        rec, last = hit
        key = rec.key
        if rec.state != "warm" or rec.drain:
            # The CAS would pass (the revision is current) but would take a slot that is not free: the
            # index and the record disagree, which must never turn into a double hold.
            log.error("index offered %s in state %s; refusing to claim it", key, rec.state)
            raise ClaimConflict(f"slot {key} is {rec.state}, not warm")
        if key in self._reserved:
            # Our own claim of this slot is in flight: one of the two would lose the compare-and-set.
            raise ClaimConflict(f"slot {key} is being claimed by this process already")
        claim_id = secrets.token_hex(8)
        new = msgspec.structs.replace(
            rec, state="claimed", claim_id=claim_id, token=None, endpoint=None, reason=None, updated_at=now
        )
        self._reserve(key, rec)
        try:
            rev = await self._slots_kv.update(key, protocol.encode(new), last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            self.claim_conflicts += 1
            await self._refresh(key)
            raise ClaimConflict(f"slot {key} changed under us") from None
        except (nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.errors.NoRespondersError):
            # The broker may or may not have applied the write: ask it, never guess.
            resolved = await self._resolve(key, claim_id)
            if resolved is None:
                raise ClaimConflict(f"claim of {key} did not go through (broker unavailable mid-write)") from None
            rev = resolved
        finally:
            self._unreserve(key)
        # No await since `_unreserve`: no other claimer can see the slot filed as warm again before this.
        self.slots.apply_local(key, new, rev)
        return Claim(key=key, token=rev, claim_id=claim_id, revision=rev, record=new)

    async def _resolve(self, key: str, claim_id: str) -> int | None:
        deadline = time.monotonic() + self.resolve_timeout_s
        while time.monotonic() < deadline:
            try:
                rec, rev = await self.get(key)
            except (TimeoutError, nats.errors.Error, OSError):
                await asyncio.sleep(0.1)
                continue
            return rev if rec.claim_id == claim_id and rec.state == "claimed" else None
        return None

    async def advance(self, claim: Claim, state: SlotState, **fields: Any) -> Claim:
        """Move a held slot on (`activating`, `ready`, `releasing`, `failed`, ...) by compare-and-set.

        Raises `StaleToken` when the claim no longer holds the slot (the fenced-zombie case) and
        `InvalidTransition` when the lifecycle table forbids the move.
        """

        def build(rec: SlotRecord) -> SlotRecord:
            slots.check_transition(rec.state, state)
            return msgspec.structs.replace(rec, state=state, token=claim.token, updated_at=self.clock(), **fields)

        new, rev = await self._cas_as_holder(claim, build)
        return Claim(key=claim.key, token=claim.token, claim_id=claim.claim_id, revision=rev, record=new)

    async def release(self, claim: Claim, *, reason: str | None = None) -> None:
        """Give a held slot back: `warm`, or `draining` if its node was drained meanwhile. A slot whose agent's
        lease has lapsed goes to `failed` instead: `warm` would advertise a slot nobody can serve from (its agent
        writes it `warm` again when it comes back)."""

        def build(rec: SlotRecord) -> SlotRecord:
            now = self.clock()
            if rec.state in ("activating", "ready"):
                # In service (or getting there): the lifecycle goes through `releasing` first.
                return msgspec.structs.replace(rec, state="releasing", reason=reason, updated_at=now)
            target = slots.release_target(rec)
            why = reason
            if target == "warm" and self.lease_lapsed(rec.node, now):
                target = "failed"
                why = f"released while the agent of {rec.node} was away (lease lapsed)" + (
                    f": {reason}" if reason else ""
                )
            slots.check_transition(rec.state, target)
            return msgspec.structs.replace(
                rec, state=target, claim_id=None, token=None, endpoint=None, reason=why, updated_at=now
            )

        for _ in range(2):
            new, rev = await self._cas_as_holder(claim, build)
            if new.state != "releasing":
                return
            claim = Claim(key=claim.key, token=claim.token, claim_id=claim.claim_id, revision=rev, record=new)
        raise ClaimConflict(f"slot {claim.key} did not leave releasing")

    # --- compare-and-set -------------------------------------------------------------------------------------------

    max_cas_attempts = 8
    """Lost compare-and-sets (another writer got there first) one write retries before `ClaimConflict`."""

    async def _read(self, key: str) -> tuple[SlotRecord | None, int]:
        """(record, revision) from the broker; (None, 0) when the key does not exist, (None, revision) when its
        value breaks the contract (counted)."""
        try:
            entry = await self._slots_kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        assert entry.revision is not None
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None, entry.revision
        return self.slots.decode(key, entry.value), entry.revision

    async def _cas(
        self,
        key: str,
        build: Callable[[SlotRecord | None, int], Awaitable[SlotRecord | None]],
        *,
        what: str,
        start: tuple[SlotRecord, int] | None = None,
    ) -> tuple[SlotRecord, int] | None:
        """The one compare-and-set loop: write ``await build(current, revision)`` over the slot's record.

        `build` gets None for a key that is absent or unreadable; it returns the record to write, None for
        "nothing to write" (returned as None), or raises to refuse. Another writer winning the race means a
        re-read and a re-build. `start` is a copy we hold (a holder's claim): it may be stale, so a refusal
        (`StaleToken`, `InvalidTransition`) built on it is tried once more on a fresh read before it counts."""
        cur: tuple[SlotRecord | None, int] | None = start
        fresh = start is None
        for _ in range(self.max_cas_attempts):
            if cur is None:
                cur = await self._read(key)
                fresh = True
            rec, rev = cur
            try:
                new = await build(rec, rev)
            except (StaleToken, InvalidTransition):
                if fresh:
                    raise
                cur = None
                continue
            if new is None:
                return None
            try:
                if rev == 0:
                    new_rev = await self._slots_kv.create(key, protocol.encode(new))
                else:
                    new_rev = await self._slots_kv.update(key, protocol.encode(new), last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                cur = None
                continue
            self.slots.apply_local(key, new, new_rev)
            return new, new_rev
        raise ClaimConflict(f"slot {key} keeps changing {what}")

    async def _cas_as_holder(self, claim: Claim, build: Callable[[SlotRecord], SlotRecord]) -> tuple[SlotRecord, int]:
        """Write `build(current)` as the claim's holder: fenced by `_verify_holder` on every attempt."""

        async def fenced(rec: SlotRecord | None, rev: int) -> SlotRecord:
            if rec is None:
                raise StaleToken(f"slot {claim.key} is gone; claim {claim.claim_id} holds nothing")
            await self._verify_holder(claim, rec, rev)
            return build(rec)

        done = await self._cas(claim.key, fenced, what="under its holder", start=(claim.record, claim.revision))
        assert done is not None  # `fenced` never returns None
        return done

    async def _verify_holder(self, claim: Claim, rec: SlotRecord, rev: int) -> None:
        """The fencing check: same claim id, and the token is the revision of that claim's write."""
        stale = StaleToken(
            f"slot {claim.key} is no longer held by claim {claim.claim_id} (token {claim.token}); "
            f"it is {rec.state} under {rec.claim_id or 'nobody'}"
        )
        if rec.claim_id != claim.claim_id:
            raise stale
        if rec.token is not None:
            if rec.token != claim.token:
                raise stale
            return
        if rev == claim.token:
            return  # the record is still the claim write itself
        # Fields were updated since the claim write, before any holder wrote its token: read that write back.
        try:
            entry = await self._slots_kv.get(claim.key, revision=claim.token)
        except nats.js.errors.KeyNotFoundError:
            raise stale from None
        if entry.value is None:
            raise stale
        first = protocol.decode(entry.value, SlotRecord)
        if first.claim_id != claim.claim_id or first.state != "claimed":
            raise stale

    # --- agent side ------------------------------------------------------------------------------------------------

    async def register(self, record: SlotRecord) -> int:
        """Write a slot as its agent sees it (start-up, re-stage). Keeps a pending drain request."""

        async def build(cur: SlotRecord | None, _: int) -> SlotRecord:
            return record if cur is None else msgspec.structs.replace(record, drain=record.drain or cur.drain)

        done = await self._cas(record.key, build, what="while its agent registers it")
        assert done is not None
        return done[1]

    async def set_state(
        self, key: str, state: SlotState, *, expect: Iterable[SlotState] | None = None, **fields: Any
    ) -> tuple[SlotRecord, int]:
        """Agent-side transition by compare-and-set (`warm` after staging, `failed` with a reason, ...).

        `expect` lists the states the slot must be in; anything else raises `InvalidTransition`.
        """
        allowed = set(expect) if expect is not None else None

        async def build(rec: SlotRecord | None, _: int) -> SlotRecord:
            if rec is None:
                raise SlotNotFound(f"no slot {key} in {protocol.SLOTS_BUCKET}")
            if allowed is not None and rec.state not in allowed:
                raise InvalidTransition(f"slot {key} is {rec.state}, expected one of {sorted(allowed)}")
            slots.check_transition(rec.state, state)
            return msgspec.structs.replace(rec, state=state, updated_at=self.clock(), **fields)

        done = await self._cas(key, build, what="under its agent")
        assert done is not None
        return done

    async def heartbeat(self, lease: AgentLease) -> int:
        """Write an agent's lease. One writer per node, so a plain put is enough."""
        rev = await self._agents_kv.put(lease.node, protocol.encode(lease))
        self.agents.apply_local(lease.node, lease, rev)
        return rev

    def adopt(self, key: str) -> Claim | None:
        """The claim that holds `key` now, as a `Claim` this process can act on (a new leader takes over the
        previous leader's claims this way). None when the slot is not held."""
        hit = self.slots.get(key)
        if hit is None:
            return None
        rec, rev = hit
        if rec.state not in slots.HELD_STATES or rec.claim_id is None:
            return None
        token = rec.token if rec.token is not None else rev  # untouched since the claim write: its revision
        return Claim(key=key, token=token, claim_id=rec.claim_id, revision=rev, record=rec)

    async def withdraw(self, node: str) -> None:
        """Remove an agent's lease at clean shutdown: its slots stop being claimable at once."""
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self._agents_kv.delete(node)

    async def unregister(self, key: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self._slots_kv.delete(key)

    # --- drain ---------------------------------------------------------------------------------------------------

    async def drain(self, node: str) -> list[str]:
        """Stop offering a node's slots: idle ones go to `draining`, held ones finish and go there on release."""
        return await self._drain(node, True)

    async def undrain(self, node: str) -> list[str]:
        return await self._drain(node, False)

    async def _drain(self, node: str, on: bool) -> list[str]:
        async def build(rec: SlotRecord | None, _: int) -> SlotRecord | None:
            if rec is None:
                return None  # gone meanwhile
            if rec.state in slots.HELD_STATES:
                new = msgspec.structs.replace(rec, drain=on)
            elif on:
                new = msgspec.structs.replace(rec, state="draining", drain=True, updated_at=self.clock())
            else:
                state: SlotState = "warm" if rec.state == "draining" else rec.state
                new = msgspec.structs.replace(rec, state=state, drain=False, updated_at=self.clock())
            if msgspec.structs.replace(new, updated_at=rec.updated_at) == rec:
                return None  # already so: a repeated drain changes nothing
            return new

        touched = []
        for key in [r.key for r in self.slots.values() if r.node == node]:
            if await self._cas(key, build, what="while its node is (un)drained") is not None:
                touched.append(key)
        return touched

    # --- watch ---------------------------------------------------------------------------------------------------

    async def watch(self) -> AsyncIterator[SlotEvent]:
        """A `Snapshot` of every slot, then each change; a new `Snapshot` after every reconnect."""
        if not self._tasks:
            await self.start()
        async for event in self.slots.changes():
            yield event
