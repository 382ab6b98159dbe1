"""Models sharded over autoscaler replicas: one fenced lease per shard in KV `pulse_leases`.

A model belongs to shard `protocol.shard_of(model)` (`protocol.SHARDS` of them). Each shard is a lease
(`protocol.LeaderLease` under ``shard.<n>``), taken and renewed only by compare-and-set exactly like the leader
lease (`autoscaler.shards.leader`, whose module doc gives the timing argument): a replica acts for a shard only until
``sent + lease_s * stop_fraction`` of its last heard renewal by its own monotonic clock, while another may take the
shard only once ``renewed_at + lease_s`` has passed by the wall clock. `owns` checks the term lazily and calls
`on_lost` when it lapsed, so a replica whose rounds stall stops acting for its shards on time.

Each replica announces itself with a `protocol.ReplicaRecord` under ``replica.<identity>``, renewed every round
and judged live by ``renewed_at + lease_s``. Shards are assigned over the live replicas by rendezvous hashing
(`assign`): a pure function every replica computes alike, under which a joining or leaving replica moves only the
shards that must move. Every round (`step`, every `renew_every_s`) a replica

1. renews its replica record and, in parallel, the leases it holds (record and leases carry the same stamp, so a
   dead replica's record lapses no later than its leases). Under `campaign` each held shard is renewed by a task of
   its own instead (`ShardTerms._keeper`: at once after the take, then every `renew_every_s`), and steps 2 and 3
   run beside the renewals, in a task of their own: a renewal waits for nothing but its own round trip, and the
   moves wait for no renewal. A lease may then be stamped up to a renewal interval after the record, so a dead
   replica's record can lapse before its leases: the others look again when each lapses (`next_lapse`). With a
   started `LeaseRenewer` (the daemon's) the keepers, the record's after its first write and the leader lease's of
   (b) after its take (`CompatLeader`), run on the renewer's thread, loop and connection
   (`autoscaler.shards.renewer`), so a busy loop here delays none of them;
2. gives up each held shard now assigned to another live replica: `on_lost(shard)` first (the daemon stops
   acting for its models), then deletes the lease on its revision, so the new owner takes it on its next round;
3. takes each shard assigned to it that is free, expired or unreadable (create, or compare-and-set on the revision
   read), then calls `on_acquired(shard)`.

A dead replica's leases and record lapse after `lease_s`; the replicas its shards are now assigned to look
right then (`campaign` wakes at the next lapse) and take them, so a handover takes ``lease_s`` and a round trip,
at most ``lease_s + renew_every_s`` when the moves are busy. Who is alive and who holds what is
read from one watch of the bucket (a `registry.BucketView`: snapshot, then deltas, re-listed after reconnects and
when its consumer is lost), never by reading 32 keys a round. Steps 2 and 3 run only on a current view;
renewals never depend on it (the compare-and-set decides). Unreadable leases and replica records are counted
(`rejections`) and treated as expired.

Rolling upgrade from revision 5 replicas, which lead through the single lease under `LEADER_LEASE_KEY`:

(a) While that lease is live and its holder has no `ReplicaRecord` (live or lapsed: an older version), this
    replica takes no shard and gives up any it holds (logged once, with the holder): the old leader acts for
    every model, and two actors for one model is what the leases exist to prevent.
(b) The holder of shard 0 also takes and renews the leader lease (a `LeaderElection`, resigned when it gives up
    shard 0), so an older replica that starts later finds the lease held and stays standby.

Its parts: `autoscaler.shards.assign` decides (`assign`, and a `ShardAssignment` that reads the view: who is alive,
who holds what, what lapses next, which shards to give up and take; pure, time passed in);
`autoscaler.shards.terms` acts (a `ShardTerms` holds this replica's terms and does the fenced takes, renewals,
keepers and gives; a `CompatLeader` holds the leader lease of (b)). `ShardLeases` joins them: the bucket's watch,
the replica record, the rounds and the campaign that times them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Final

import msgspec
from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.shards.assign import ShardAssignment, assign
from autoscaler.shards.renewer import LeaseRenewer
from autoscaler.shards.terms import NATS_ERRORS, CompatLeader, ShardSettings, ShardTerms, reap
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import LeaderLease, ReplicaRecord
from warmpool.registry import BucketView
from warmpool.rejects import Rejections
from warmpool.tasks import cancel_and_wait

__all__ = ["INVOLUNTARY", "ShardLeases", "ShardSettings", "assign"]

log = logging.getLogger("pulsescale.shards")

INVOLUNTARY: Final = frozenset({"lease not renewed in time", "another replica holds its lease"})
"""`ShardLeases.last_loss` reasons that mean the shard was lost, not handed over: the daemon counts these."""
_LAPSE_MARGIN_S: Final = 0.02
"""Looked at this long after a record's or a lease's lapse, so the clock has surely passed it."""


class _LeasesView(BucketView[Any]):
    """The `pulse_leases` bucket as seen by shard leases: shard and leader leases, and replica records. Other
    keys (overrides) are not ours to read and are ignored without a count."""

    def decode(self, key: str, data: bytes) -> Any:
        try:
            if key.startswith(protocol.REPLICA_KEY_PREFIX):
                rec = protocol.decode(data, ReplicaRecord)
                if protocol.REPLICA_KEY_PREFIX + rec.identity != key:
                    raise BadMessage("subject_mismatch", f"the record of {rec.identity} is stored under key {key}")
                return rec
            if key.startswith(protocol.SHARD_KEY_PREFIX) or key == protocol.LEADER_LEASE_KEY:
                return protocol.decode(data, LeaderLease)
        except BadMessage as err:
            self._rejected(err, source=f"{protocol.LEASES_BUCKET}/{key}")
        return None


class ShardLeases:
    """Run `campaign()` as a task; `owns(shard)` / `owns_model(model)` say whether this replica may act now."""

    def __init__(
        self,
        kv: KeyValue,
        identity: str,
        settings: ShardSettings = ShardSettings(),
        *,
        shards: int = protocol.SHARDS,
        on_acquired: Callable[[int], None] | None = None,
        on_lost: Callable[[int], None] | None = None,
        count_models: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        rejections: Rejections | None = None,
        nc: Client | None = None,
        on_renewal: Callable[[float], None] | None = None,
        on_slack: Callable[[float], None] | None = None,
        renewer: LeaseRenewer | None = None,
    ) -> None:
        """`clock` stamps and judges leases and records (wall time, shared with the other replicas); `monotonic`
        times this replica's own terms. `count_models` fills the record's `models` (ScaledObjects in our
        shards). `nc` is the connection `kv` uses (its reconnects re-list the view); by default kv's own.
        `on_renewal(seconds)` gets each shard renewal's time from its send to its answer, or to its failure (under
        `step`, from the round's start): next to the loop's lag it tells a slow broker from a busy process before
        a lease is lost. `on_slack(seconds)` gets, at each renewal that extends a term, what was left of the term
        when its answer came (at 0 the shard is lost: how close the renewals run to losing it). `renewer`, when
        given and started, renews the held shards on a thread, loop and connection of its own
        (`autoscaler.shards.renewer`), so a busy loop here does not cost them."""
        protocol.replica_key(identity)  # refuses an identity that is not one key token
        if not 0 < shards <= protocol.SHARDS:
            raise ValueError(f"shards must be in (0, {protocol.SHARDS}], not {shards}")
        self.kv = kv
        self.identity = identity
        self.settings = settings
        self.shards = shards
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.count_models = count_models
        self.on_renewal = on_renewal
        self.on_slack = on_slack
        self.clock = clock
        self.monotonic = monotonic
        self.rejections = rejections or Rejections(log)
        self._nc: Client = nc if nc is not None else kv._js._nc
        self._started_at = clock()
        self._view = _LeasesView(self._nc, kv, msgspec.Struct, self.rejections, clock=clock)
        self._record: tuple[list[int], int] = ([], 0)  # shards and models for the record, as last counted here
        self._record_kept = False  # the renewer's thread announces the record (`_keep_record`)
        self._view_task: asyncio.Task[None] | None = None
        self._assignment = ShardAssignment(identity, shards, self._view)  # deciding: who should hold which shard
        # Acting: the terms held and their lease writes. `self` as its callbacks: `on_acquired`, `on_lost` and
        # `on_renewal` are read from here each time, so they may be set after construction.
        self._terms = ShardTerms(
            kv,
            identity,
            settings,
            self._view,
            self._assignment,
            self,
            clock=clock,
            monotonic=monotonic,
            renewer=renewer,
        )
        # (b) of the module doc: the leader lease, while we hold shard 0.
        self._compat = CompatLeader(
            kv, identity, settings, self._terms, clock=clock, monotonic=monotonic, rejections=self.rejections
        )

    # --- what this replica may do now (synchronous: on the per-sample path) ------------------------------------

    def owns(self, shard: int) -> bool:
        return self._terms.owns(shard)

    def owns_model(self, model: str) -> bool:
        return self._terms.owns(protocol.shard_of(model, self.shards))  # per sample: one call fewer

    def held(self) -> frozenset[int]:
        return frozenset(s for s in list(self._terms.held) if self.owns(s))

    def owner(self, shard: int) -> str | None:
        """The live holder of `shard` as last seen (our own identity while we own it); None: nobody now."""
        if self.owns(shard):
            return self.identity
        return self._assignment.holder(shard, self.clock())

    def owner_of_model(self, model: str) -> str | None:
        return self.owner(protocol.shard_of(model, self.shards))

    def replicas(self) -> list[ReplicaRecord]:
        """Live replicas as last seen (ours included once announced), sorted by identity."""
        return self._assignment.replicas(self.clock())

    @property
    def view(self) -> BucketView[Any]:
        """The watch of the leases bucket (its figures: `BucketView.relists`, `BucketView.spared`)."""
        return self._view

    @property
    def last_loss(self) -> str:
        """Why the shard `on_lost` is being called for was lost (`ShardTerms.last_loss`: one of `INVOLUNTARY`, or
        a hand-over)."""
        return self._terms.last_loss

    # --- rounds ------------------------------------------------------------------------------------------------

    async def start(self, timeout_s: float = 10.0) -> bool:
        """Start the bucket's watch (idempotent) and wait up to `timeout_s` for its first snapshot."""
        if self._view.ready.is_set():
            return True
        if self._view_task is None:
            self._view_task = asyncio.create_task(self._view.run(), name=f"shard-leases-watch-{self.identity}")
        ready = asyncio.ensure_future(self._view.ready.wait())
        try:
            await asyncio.wait([ready], timeout=timeout_s)  # asyncio.wait: see LeaderElection.campaign
        finally:
            ready.cancel()
        return self._view.ready.is_set()

    async def step(self) -> None:
        """One round (see the module doc): the renewals, then the moves. `campaign` runs the renewals every
        `renew_every_s` and the moves beside them; tests call this directly."""
        if await self._step(self._renewals()):
            await self._step(self._moves())

    async def _step(self, part: Coroutine[Any, Any, bool]) -> bool:
        if self._terms.halted:
            part.close()
            return False
        try:
            return await part
        except NATS_ERRORS as err:
            log.debug("%s: shard round failed: %s", self.identity, err)
            return False
        finally:
            self._terms.report()

    async def _renewals(self) -> bool:
        """Step 1, and the leader lease of (b): all at once, so the next renewal is sent one round trip after this
        one, never after a take, a hand-over or a leader-lease write too (the holder of shard 0 renewed the
        leader lease after its shards: under a broker answering in 0.6 s it lost every lease every few seconds,
        `bench decide --models 3000 --replicas 3`). False while there is no snapshot of the bucket yet."""
        if not await self.start(timeout_s=self.settings.renew_every_s):
            return False  # no snapshot yet: we cannot know who else is alive
        for s in list(self._terms.held):
            self.owns(s)  # fences lapsed terms now, even if nobody asked
        sent = self.monotonic()
        now = self.clock()  # one stamp for the record and the leases: the record never outlives them
        held = sorted(self._terms.held)
        self._record = (held, self.count_models() if self.count_models is not None else 0)
        announce = True
        if self._terms.keeping:  # `campaign`: each shard's keeper renews it on its own
            for s in held:
                self._terms.keep(s)
            renewals = []
            renewer = self._terms.renewer
            if renewer is not None and renewer.running:
                # The record too, beside the leases' keepers (after this first one here): a record left to a busy
                # loop lapsed while its leases did not, and the others moved shards to and fro meanwhile.
                announce = not self._record_kept
                if announce:
                    self._record_kept = True
                    renewer.call(self._keep_record)
        else:
            renewals = [self._terms.renew(s, sent, now) for s in held]
        record = [self._announce(now, held)] if announce else []
        await asyncio.gather(*record, *renewals, self._compat.lead(renewing=True))
        return True

    def _keep_record(self) -> None:
        """On the renewer's loop: announce the replica record every renewal tick, with the shards and models the
        daemon's loop last counted (`_record`) and a fresh stamp; stopped with the keepers."""
        if not self._terms.halted and self._terms.keeping:
            self._terms.side_keepers.append(asyncio.create_task(self._record_keeper(), name="replica-record"))

    async def _record_keeper(self) -> None:
        renewer = self._terms.renewer
        while not self._terms.halted and renewer is not None and renewer.kv is not None:
            sent = self.monotonic()
            held, models = self._record
            # A daemon that cannot act is not announced as live: its record lapses with its shards' leases, so the
            # other replicas' plans stop counting it (`ShardTerms._main_lost`, which says so).
            if not self._terms._main_lost(renewer.main_stalled_s()):
                await self._announce(self.clock(), held, models=models, kv=renewer.kv, main=renewer.on_main)
            await asyncio.sleep(max(0.0, self._terms._next_tick(sent) - self.monotonic()))

    async def _moves(self) -> bool:
        """Steps 2 and 3, then the leader lease when shard 0 was just taken, and the sweep of lapsed records."""
        if self._terms.halted or not self._view.current():
            return False  # a stale view may not move shards; renewals never depended on it
        now = self.clock()
        members = [r.identity for r in self.replicas()]
        give_up, take = self._assignment.moves(now, members, self._terms.held)
        why = "assigned to another replica" if self._assignment.legacy is None else "an older replica leads"
        await asyncio.gather(*(self._terms.give_up(s, why) for s in give_up), *(self._terms.take(s) for s in take))
        if self._compat.due() and not self._terms.halted:
            await self._compat.lead()  # now, not a round later: an older replica must find the leader lease held
            await self._compat.lead()  # and its first renewal at once, as `ShardTerms.take` does
        if self.owns(0):
            await self._sweep(now)
        return True

    async def _sweep(self, now: float) -> None:
        """The holder of shard 0 deletes replica records lapsed for `shardassign.FORGET_AFTER_LEASES` leases (on
        their revision), so replicas that died do not pile up in the bucket. Kept that long so a dead replica's
        leader lease has surely lapsed first (see `ShardAssignment.legacy_holder`)."""
        stale = self._assignment.lapsed_records(now)
        for key, rev in stale:
            with contextlib.suppress(*NATS_ERRORS):
                await self.kv.delete(key, last=rev)
                self._view.forget(key)

    async def _announce(
        self,
        now: float,
        held: list[int],
        *,
        models: int | None = None,
        kv: KeyValue | None = None,
        main: Callable[..., None] | None = None,
    ) -> None:
        """Write the replica record; `kv` and `main` when on the renewer's thread (the view is the daemon loop's)."""
        if models is None:
            models = self.count_models() if self.count_models is not None else 0
        rec = ReplicaRecord(
            identity=self.identity,
            renewed_at=now,
            lease_s=self.settings.lease_s,
            started_at=self._started_at,
            shards=held,
            models=models,
        )
        key = protocol.replica_key(self.identity)
        try:
            rev = await (kv or self.kv).put(key, protocol.encode(rec))
        except NATS_ERRORS as err:
            log.debug("%s: replica record not renewed: %s", self.identity, err)
            return
        (main or (lambda fn, *args: fn(*args)))(self._view.apply_local, key, rec, rev)

    # --- running and stopping ----------------------------------------------------------------------------------

    async def campaign(self, stop: asyncio.Event) -> None:
        """Until `stop` is set or `halt` is called: the renewals (replica record, leader lease; each shard has its
        keeper) every `renew_every_s`, and the moves on the same ticks and at each lapse of another replica's
        record or lease (`next_lapse`). Each in a task of its own, one of each at a time, so neither waits for
        the other: a take is two round trips, and with the moves started only once the renewals were back, a
        slow replica-record write held back the take of a lapsed shard by as long as the write took."""
        # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation that races its timeout.
        loop = asyncio.get_running_loop()
        every = self.settings.renew_every_s
        stopped = asyncio.ensure_future(stop.wait())
        renewing: asyncio.Task[bool] | None = None
        moving: asyncio.Task[bool] | None = None
        self._terms.keeping, self._terms.epoch = True, self.monotonic()

        def run(task: asyncio.Task[bool] | None, part: Callable[[], Coroutine[Any, Any, bool]]) -> asyncio.Task[bool]:
            """`task` while it runs, else `part` in a new task (raising what the ended one raised: a bug in the
            renewals or the moves ends the campaign, as it did when they ran inline)."""
            if task is not None and not task.done():
                return task
            reap(task)
            return asyncio.create_task(self._step(part()), name=f"shard-{part.__name__.strip('_')}-{self.identity}")

        tick = loop.time()
        try:
            while not stop.is_set() and not self._terms.halted:
                if loop.time() >= tick:
                    renewing = run(renewing, self._renewals)  # a round still out is not doubled: skipped
                    tick = max(tick + every, loop.time())
                waits: list[asyncio.Future[Any]] = [stopped]
                if self._view.ready.is_set():
                    moving = run(moving, self._moves)
                elif renewing is not None and not renewing.done():
                    waits.append(renewing)  # the first renewals start the view: the moves right after them
                wait = max(0.0, tick - loop.time())
                # A replica that went silent frees its shards when its record and leases lapse: look right then, not
                # up to a renewal interval later (a dead replica's models wait lease_s + this; the bar: lease + 1 s).
                lapse = self.next_lapse()
                if lapse is not None:
                    wait = min(wait, max(0.0, lapse - self.clock()) + _LAPSE_MARGIN_S)
                await asyncio.wait(waits, timeout=wait)
        finally:
            stopped.cancel()
            self._terms.keeping = False
            await cancel_and_wait([t for t in (renewing, moving) if t is not None])
            await self._terms.stop_keepers()
            self._record_kept = False
            reap(renewing)
            reap(moving)

    def next_lapse(self) -> float | None:
        """When the next record or shard lease of another replica lapses if it is not renewed (wall clock, by
        `clock`); None: nothing of another's is live (`ShardAssignment.next_lapse`)."""
        return self._assignment.next_lapse(self.clock())

    def halt(self) -> None:
        """Stop taking and renewing (a flag, as `LeaderElection.halt`). The terms held run out by the fence."""
        self._terms.halted = True

    async def resign(self) -> None:
        """Clean shutdown: `on_lost` for each held shard, then delete our leases (on their revision, else read
        back) and our replica record, so the others take over on their next round instead of after `lease_s`."""
        self.halt()
        await self._terms.stop_keepers()
        terms = dict(self._terms.held)
        for s in sorted(terms):
            self._terms.lose(s, "resigned")
        self._terms.report()
        # Leases the view says are ours but we no longer count as held (a lapsed term) are ours to free too.
        ours = self._assignment.our_leases()
        await asyncio.gather(
            *(self._terms.delete(s, terms[s].revision if s in terms else None) for s in terms.keys() | ours)
        )
        await self._compat.resign()
        key = protocol.replica_key(self.identity)
        renewer = self._terms.renewer
        with contextlib.suppress(*NATS_ERRORS):
            if renewer is not None and renewer.running and renewer.kv is not None:
                # On the connection the record was last written on: after its last write, not before it.
                await renewer.run(renewer.kv.delete(key))
            else:
                await self.kv.delete(key)
        await self.close()

    async def close(self) -> None:
        """Stop the bucket's watch (`resign` does it too). Leases are left to lapse: use `resign` to hand over."""
        self._terms.halted = True
        await self._terms.stop_keepers()
        self._view.closed = True
        if self._view_task is not None:
            task, self._view_task = self._view_task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, *NATS_ERRORS):
                await task
