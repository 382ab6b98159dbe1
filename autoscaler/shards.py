"""Models sharded over autoscaler replicas: one fenced lease per shard in KV `pulse_leases`.

A model belongs to shard `protocol.shard_of(model)` (`protocol.SHARDS` of them). Each shard is a lease
(`protocol.LeaderLease` under ``shard.<n>``), taken and renewed only by compare-and-set exactly like the leader
lease (`autoscaler.leader`, whose module doc gives the timing argument): a replica acts for a shard only until
``sent + lease_s * stop_fraction`` of its last heard renewal by its own monotonic clock, while another may take the
shard only once ``renewed_at + lease_s`` has passed by the wall clock. `owns` checks the term lazily and calls
`on_lost` when it lapsed, so a replica whose rounds stall stops acting for its shards on time.

Each replica announces itself with a `protocol.ReplicaRecord` under ``replica.<identity>``, renewed every round
and judged live by ``renewed_at + lease_s``. Shards are assigned over the live replicas by rendezvous hashing
(`assign`): a pure function every replica computes alike, under which a joining or leaving replica moves only the
shards that must move. Every round (`step`, every `renew_every_s`) a replica

1. renews its replica record and, in parallel, the leases it holds (record and leases carry the same stamp, so a
   dead replica's record lapses no later than its leases). Under `campaign` each held shard is renewed by a task of
   its own instead (`_keeper`: at once after the take, then every `renew_every_s`), and steps 2 and 3 run beside
   the renewals, in a task of their own: a renewal waits for nothing but its own round trip, and the moves wait
   for no renewal. A lease may then be stamped up to a renewal interval after the record, so a dead replica's
   record can lapse before its leases: the others look again when each lapses (`next_lapse`);
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
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.leader import LeaderElection, LeaseSettings, renew_lease, take_lease
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import LeaderLease, ReplicaRecord
from warmpool.registry import BucketView
from warmpool.rejects import Rejections
from warmpool.tasks import cancel_and_wait

__all__ = ["INVOLUNTARY", "ShardLeases", "ShardSettings", "assign"]

log = logging.getLogger("pulsescale.shards")

_Record = LeaderLease | ReplicaRecord
_NATS_ERRORS = (nats.errors.Error, TimeoutError, OSError)
INVOLUNTARY: Final = frozenset({"lease not renewed in time", "another replica holds its lease"})
"""`ShardLeases.last_loss` reasons that mean the shard was lost, not handed over: the daemon counts these."""
_LAPSE_MARGIN_S: Final = 0.02
"""Looked at this long after a record's or a lease's lapse, so the clock has surely passed it."""
FORGET_AFTER_LEASES = 10
"""A replica record lapsed this many leases is deleted by the holder of shard 0."""


@dataclass(frozen=True)
class ShardSettings:
    lease_s: float = 2.0
    """How long a silent replica keeps its shards and counts as alive: a dead replica's models are decided
    again by another within this plus `renew_every_s`. As the leader lease: long enough that a GC pause or a
    slow broker round trip does not move shards, short enough for the issue's "lease + 1 s" handover."""
    renew_every_s: float = 0.5
    """Renew four times per lease, so one slow round trip does not lose a shard; also how soon a replica takes
    shards that were handed over (a lapsed one is taken at its lapse: `ShardLeases.next_lapse`)."""
    stop_fraction: float = 0.8
    """A replica stops acting for a shard this far into its lease without a heard renewal, before anyone else
    may take it (clocks may disagree by up to ``lease_s * (1 - stop_fraction)``: 0.4 s by default)."""

    def __post_init__(self) -> None:
        if not 0 < self.renew_every_s < self.lease_s:
            raise ValueError(f"renew_every_s ({self.renew_every_s}) must be in (0, lease_s = {self.lease_s})")
        if not 0 < self.stop_fraction < 1:
            raise ValueError(f"stop_fraction ({self.stop_fraction}) must be in (0, 1): see autoscaler.leader")


def _reap(task: asyncio.Task[Any] | None) -> None:
    """Raise what an ended background task of the campaign raised (a bug: NATS errors are caught inside)."""
    if task is not None and task.done() and not task.cancelled() and (err := task.exception()) is not None:
        raise err


def _weight(member: str, shard: int) -> bytes:
    return hashlib.blake2b(f"{member}\x00{shard}".encode(), digest_size=8).digest()


def assign(shards: int, members: Iterable[str]) -> dict[int, str]:
    """Shard -> member: rendezvous hashing with equal quotas. Every (member, shard) pair has a weight (blake2b);
    pairs are taken heaviest first, each shard going to the first member that still has room, and every member has
    room for ``shards // n`` shards (the first ``shards % n`` of them, in an order fixed by their names' hash, one
    more). So the split is even (the busiest holds at most one shard more than the idlest: plain rendezvous hashing
    leaves 3 replicas with 16 of 32 shards at worst), and it stays stable: a member joining or leaving moves its own
    share plus a few shards between the others (7 of 32 at worst over 2,000 random fleets of 1-7, tests/test_shards.py).
    Pure and order-independent, so every replica computes the same plan from the same members. Empty without
    members."""
    names = sorted(set(members), key=lambda m: (_weight(m, -1), m))
    if not names:
        return {}
    n = len(names)
    room = {m: shards // n + (1 if i < shards % n else 0) for i, m in enumerate(names)}
    plan: dict[int, str] = {}
    for _, shard, member in sorted(((_weight(m, s), s, m) for s in range(shards) for m in names), reverse=True):
        if shard not in plan and room[member] > 0:
            plan[shard] = member
            room[member] -= 1
    return plan


@dataclass
class _Term:
    revision: int
    act_until: float
    """Monotonic deadline: sent + lease_s * stop_fraction of the last heard renewal."""
    renewing: bool = False
    """A renewal of this term is in flight: a second on the same revision would fail, and cost a read."""


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
    ) -> None:
        """`clock` stamps and judges leases and records (wall time, shared with the other replicas); `monotonic`
        times this replica's own terms. `count_models` fills the record's `models` (ScaledObjects in our
        shards). `nc` is the connection `kv` uses (its reconnects re-list the view); by default kv's own.
        `on_renewal(seconds)` gets each shard renewal's time from its send to its answer, or to its failure (under
        `step`, from the round's start): next to the loop's lag it tells a slow broker from a busy process before
        a lease is lost."""
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
        self.clock = clock
        self.monotonic = monotonic
        self.rejections = rejections or Rejections(log)
        self._nc: Client = nc if nc is not None else kv._js._nc
        self._started_at = clock()
        self._held: dict[int, _Term] = {}
        self.last_loss = ""
        """Why the shard `on_lost` is being called for was lost: one of `INVOLUNTARY` (the term lapsed, another
        replica holds the lease), or "assigned to another replica", "an older replica leads", "resigned"."""
        self._halted = False
        self._legacy: str | None = None  # the older replica leading through LEADER_LEASE_KEY, while it does
        self._leader: LeaderElection | None = None  # (b): while we hold shard 0
        self._leading = asyncio.Lock()  # one `_lead` at a time
        self._keeping = False  # True under `campaign`: each held shard's renewals are its keeper task's
        self._epoch = 0.0  # monotonic start of `campaign`: the keepers' ticks count from it (`_next_tick`)
        self._keepers: dict[int, tuple[_Term, asyncio.Task[None]]] = {}  # shard -> the term it keeps, and the task
        self._last_plan: tuple[tuple[str, ...], dict[int, str]] | None = None
        self._view = _LeasesView(self._nc, kv, msgspec.Struct, self.rejections, clock=clock)
        self._view_task: asyncio.Task[None] | None = None

    # --- what this replica may do now (synchronous: on the per-sample path) ----------------------------------

    def owns(self, shard: int) -> bool:
        term = self._held.get(shard)
        if term is None:
            return False
        if self.monotonic() >= term.act_until:
            self._lose(shard, "lease not renewed in time")
            return False
        return True

    def owns_model(self, model: str) -> bool:
        return self.owns(protocol.shard_of(model, self.shards))

    def held(self) -> frozenset[int]:
        return frozenset(s for s in list(self._held) if self.owns(s))

    def owner(self, shard: int) -> str | None:
        """The live holder of `shard` as last seen (our own identity while we own it); None: nobody now."""
        if self.owns(shard):
            return self.identity
        lease = self._view.value(protocol.shard_key(shard))
        if not isinstance(lease, LeaderLease) or self.clock() > lease.renewed_at + lease.lease_s:
            return None
        return None if lease.holder == self.identity else lease.holder

    def owner_of_model(self, model: str) -> str | None:
        return self.owner(protocol.shard_of(model, self.shards))

    def replicas(self) -> list[ReplicaRecord]:
        """Live replicas as last seen (ours included once announced), sorted by identity."""
        now = self.clock()
        recs = [
            v
            for k, v, _ in self._view.entries()
            if k.startswith(protocol.REPLICA_KEY_PREFIX)
            and isinstance(v, ReplicaRecord)
            and now <= v.renewed_at + v.lease_s
        ]
        return sorted(recs, key=lambda r: r.identity)

    def _lose(self, shard: int, why: str) -> None:
        if self._held.pop(shard, None) is not None:
            log.info("%s: no longer owns shard %d (%s)", self.identity, shard, why)
            self.last_loss = why
            self._call(self.on_lost, shard)

    def _call(self, callback: Callable[[int], None] | None, shard: int) -> None:
        """A callback's bug is logged, never raised into a round: that would stop the renewals of every shard."""
        if callback is not None:
            try:
                callback(shard)
            except Exception:
                log.exception("%s: shard %d callback failed", self.identity, shard)

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
        if self._halted:
            part.close()
            return False
        try:
            return await part
        except _NATS_ERRORS as err:
            log.debug("%s: shard round failed: %s", self.identity, err)
            return False

    async def _renewals(self) -> bool:
        """Step 1, and the leader lease of (b): all at once, so the next renewal is sent one round trip after this
        one, never after a take, a hand-over or a leader-lease write too (the holder of shard 0 renewed the
        leader lease after its shards: under a broker answering in 0.6 s it lost every lease every few seconds,
        `bench decide --models 3000 --replicas 3`). False while there is no snapshot of the bucket yet."""
        if not await self.start(timeout_s=self.settings.renew_every_s):
            return False  # no snapshot yet: we cannot know who else is alive
        for s in list(self._held):
            self.owns(s)  # fences lapsed terms now, even if nobody asked
        sent = self.monotonic()
        now = self.clock()  # one stamp for the record and the leases: the record never outlives them
        held = sorted(self._held)
        if self._keeping:  # `campaign`: each shard's keeper renews it on its own
            for s in held:
                self._keep(s)
            renewals = []
        else:
            renewals = [self._renew(s, sent, now) for s in held]
        await asyncio.gather(self._announce(now, held), *renewals, self._lead(renewing=True))
        return True

    def _keep(self, shard: int) -> None:
        """Under `campaign`, start the task that renews `shard` while this term of it lasts (idempotent per term:
        a shard lost and taken back gets a keeper of its own term at once, the old one is cancelled)."""
        term = self._held.get(shard)
        if not self._keeping or term is None:
            return
        kept = self._keepers.get(shard)
        if kept is not None:
            if kept[0] is term and not kept[1].done():
                return
            _reap(kept[1])  # a keeper that died of a bug ends the campaign, as the rounds' bugs do
            kept[1].cancel()
        self._keepers[shard] = (term, asyncio.create_task(self._keeper(shard, term), name=f"shard-{shard}-keeper"))

    async def _keeper(self, shard: int, term: _Term) -> None:
        """Renew `shard` at once, then on each of the replica's ticks (`_next_tick`), or as soon as a slower
        renewal is answered. Each shard on its own: a renewal never waits for another's answer, a take, a
        hand-over or the replica record, so a term lasts as long as one round trip stays under
        `lease_s * stop_fraction / 2` (0.8 s at the defaults), right after a take too. In one round of them all,
        the slowest answer set the pace, the holder of shard 0 renewed the leader lease after its shards, and a
        shard just taken waited for the next round: all three lost leases under a slow broker (`bench decide
        --models 3000 --replicas 3`)."""
        while not self._halted and self._held.get(shard) is term:
            sent = self.monotonic()
            await self._renew(shard, sent, self.clock(), term)
            await asyncio.sleep(max(0.0, self._next_tick(sent) - self.monotonic()))

    def _next_tick(self, after: float) -> float:
        """The first of the replica's renewal ticks (every `renew_every_s` from `campaign`'s start) after
        `after`. The keepers renew on the same ticks, so their renewals go out and come back together, as one
        round's did, rather than spread over the interval. One answered after its next tick is renewed at once:
        an interval never exceeds a round trip."""
        every = self.settings.renew_every_s
        return self._epoch + (math.floor((after - self._epoch) / every) + 1) * every

    async def _moves(self) -> bool:
        """Steps 2 and 3, then the leader lease when shard 0 was just taken, and the sweep of lapsed records."""
        if self._halted or not self._view.current():
            return False  # a stale view may not move shards; renewals never depended on it
        now = self.clock()
        members = [r.identity for r in self.replicas()]
        if self.identity not in members:
            members.append(self.identity)
        legacy = self._legacy_holder(now)
        if legacy != self._legacy:
            if legacy is not None:
                log.warning(
                    "%s: an older replica (%s, no replica record) leads through the %r lease: taking no shard "
                    "until it stops",
                    self.identity,
                    legacy,
                    protocol.LEADER_LEASE_KEY,
                )
            else:
                log.info("%s: no older replica leads any more: taking shards", self.identity)
            self._legacy = legacy
        plan = {} if legacy is not None else self._plan(members)
        give_up = [s for s in self._held if plan.get(s) != self.identity]
        take = [s for s, m in plan.items() if m == self.identity and s not in self._held and self._free(s, now)]
        await asyncio.gather(*(self._give_up(s) for s in give_up), *(self._take(s) for s in take))
        if self._lead_due() and not self._halted:
            await self._lead()  # now, not a round later: an older replica must find the leader lease held
            await self._lead()  # and its first renewal at once, as `_take` does
        if self.owns(0):
            await self._sweep(now)
        return True

    async def _sweep(self, now: float) -> None:
        """The holder of shard 0 deletes replica records lapsed for `FORGET_AFTER_LEASES` leases (on their
        revision), so replicas that died do not pile up in the bucket. Kept that long so a dead replica's
        leader lease has surely lapsed first (see `_legacy_holder`)."""
        stale = [
            (k, rev)
            for k, v, rev in self._view.entries()
            if isinstance(v, ReplicaRecord) and now > v.renewed_at + v.lease_s * (1 + FORGET_AFTER_LEASES)
        ]
        for key, rev in stale:
            with contextlib.suppress(*_NATS_ERRORS):
                await self.kv.delete(key, last=rev)
                self._view.forget(key)

    def _plan(self, members: list[str]) -> dict[int, str]:
        """`assign` over `members`, recomputed only when they change (most rounds they do not)."""
        key = tuple(sorted(members))
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, assign(self.shards, key))
        return self._last_plan[1]

    def _legacy_holder(self, now: float) -> str | None:
        """The holder of a live leader lease that has no replica record at all, live or lapsed: an older version.
        (A dead replica of ours may hold a leader lease that outlives its record by a round trip; its lapsed
        record says it was one of us.)"""
        lease = self._view.value(protocol.LEADER_LEASE_KEY)
        if not isinstance(lease, LeaderLease) or now > lease.renewed_at + lease.lease_s:
            return None
        if lease.holder == self.identity or protocol.REPLICA_KEY_PREFIX + lease.holder in self._view:
            return None
        return lease.holder

    def _free(self, shard: int, now: float) -> bool:
        """Worth a try by the view: no lease, an expired one, or ours. The take itself reads and compare-and-sets."""
        lease = self._view.value(protocol.shard_key(shard))
        return (
            not isinstance(lease, LeaderLease)
            or lease.holder == self.identity
            or now > lease.renewed_at + lease.lease_s
        )

    def _lease(self, now: float) -> LeaderLease:
        return LeaderLease(holder=self.identity, renewed_at=now, lease_s=self.settings.lease_s)

    def _quiet_decode(self, data: bytes | None) -> LeaderLease | None:
        """Reads for a take or a renewal: an unreadable lease was already counted by the view."""
        try:
            return protocol.decode(data or b"", LeaderLease)
        except BadMessage:
            return None

    async def _announce(self, now: float, held: list[int]) -> None:
        rec = ReplicaRecord(
            identity=self.identity,
            renewed_at=now,
            lease_s=self.settings.lease_s,
            started_at=self._started_at,
            shards=held,
            models=self.count_models() if self.count_models is not None else 0,
        )
        key = protocol.replica_key(self.identity)
        try:
            rev = await self.kv.put(key, protocol.encode(rec))
        except _NATS_ERRORS as err:
            log.debug("%s: replica record not renewed: %s", self.identity, err)
            return
        self._view.apply_local(key, rec, rev)

    async def _renew(self, shard: int, sent: float, now: float, term: _Term | None = None) -> None:
        """Renew `term` of `shard` (by default the one held now) unless a renewal of it is in flight, or its fence
        has passed (a renewal then would only keep the lease from the replica it now goes to)."""
        term = term or self._held.get(shard)
        if term is None or term.renewing or self._held.get(shard) is not term or not self.owns(shard):
            return
        term.renewing = True
        try:
            await self._renew_once(shard, term, sent, now)
        finally:
            term.renewing = False

    async def _renew_once(self, shard: int, term: _Term, sent: float, now: float) -> None:
        key, lease = protocol.shard_key(shard), self._lease(now)
        try:
            got = await renew_lease(
                self.kv, key, protocol.encode(lease), term.revision, self.identity, self._quiet_decode
            )
        except _NATS_ERRORS as err:
            log.debug("%s: shard %d not renewed: %s", self.identity, shard, err)
            return  # the fence decides what a missed renewal costs
        finally:
            if self.on_renewal is not None:
                self.on_renewal(self.monotonic() - sent)
        if self._held.get(shard) is not term:
            return  # this term ended while the renewal was out (lost, given up, or taken again as a new term)
        if got.revision is None:
            self._lose(shard, "another replica holds its lease")
            return
        if not self.owns(shard):
            return  # came back too late to extend a term that already ended; the next round takes it again
        term.revision = got.revision
        if got.extended:
            term.act_until = sent + self.settings.lease_s * self.settings.stop_fraction
            self._view.apply_local(key, lease, got.revision)

    async def _take(self, shard: int) -> None:
        # The term is timed from the moment the lease is stamped, when its write is sent (`take_lease`): not the
        # round's start, which a starved replica's slow renewals may have begun a second earlier (the term would
        # end at once), nor the take's read, a round trip earlier.
        key, stamped = protocol.shard_key(shard), []

        def lease() -> bytes:
            stamped.append(self._lease(self.clock()))
            return protocol.encode(stamped[-1])

        seen, free_at = self._view.value(key), None
        if isinstance(seen, LeaderLease) and self._free(shard, self.clock()):
            free_at = self._view.revision(key)
        try:
            took = await take_lease(
                self.kv, key, lease, self.identity, self.clock, self._quiet_decode, self.monotonic, seen=free_at
            )
        except _NATS_ERRORS as err:
            log.debug("%s: shard %d not taken: %s", self.identity, shard, err)
            return
        if took is None:
            return
        rev, sent = took
        if self._halted:  # `resign` ran while the take was in flight: hand it straight back
            await self._delete(shard, rev)
            return
        self._held[shard] = _Term(rev, sent + self.settings.lease_s * self.settings.stop_fraction)
        self._view.apply_local(key, stamped[-1], rev)
        log.info("%s: owns shard %d (lease revision %d)", self.identity, shard, rev)
        self._call(self.on_acquired, shard)
        self._keep(shard)  # its first renewal at once, not at the next round

    async def _give_up(self, shard: int) -> None:
        term = self._held.get(shard)
        if term is None:
            return
        self._lose(shard, "assigned to another replica" if self._legacy is None else "an older replica leads")
        await self._delete(shard, term.revision)

    async def _delete(self, shard: int, revision: int | None) -> None:
        """Delete our lease of `shard`, on `revision` if known; when that fails, read it back and delete it if it
        is still ours (a renewal may have landed unheard)."""
        key = protocol.shard_key(shard)
        with contextlib.suppress(*_NATS_ERRORS):
            if revision is not None:
                with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
                    await self.kv.delete(key, last=revision)
                    self._view.forget(key)
                    return
            entry = await self.kv.get(key)
            lease = self._quiet_decode(entry.value)
            if lease is not None and lease.holder == self.identity:
                await self.kv.delete(key, last=entry.revision)
                self._view.forget(key)

    async def _lead(self, *, renewing: bool = False) -> None:
        """(b) of the module doc: the holder of shard 0 also holds the leader lease older replicas campaign for.
        The renewals only renew it (`renewing`): taking or resigning it is the moves' (`_lead_due`), so the
        renewals never wait behind a take's two round trips. One at a time."""
        if renewing and (self._leading.locked() or self._lead_due() or self._leader is None):
            return
        async with self._leading:
            await self._lead_once()

    def _lead_due(self) -> bool:
        """The leader lease wants a take (we own shard 0 and do not lead) or a resign (we lead, or tried to,
        without shard 0): more than a renewal."""
        leading = self._leader is not None and self._leader.is_leader
        return (self.owns(0) and not leading) or (not self.owns(0) and self._leader is not None)

    async def _lead_once(self) -> None:
        if self.owns(0) and not self._halted:
            if self._leader is None:
                self._leader = LeaderElection(
                    self.kv,
                    self.identity,
                    LeaseSettings(
                        key=protocol.LEADER_LEASE_KEY,
                        lease_s=self.settings.lease_s,
                        renew_every_s=self.settings.renew_every_s,
                        stop_fraction=self.settings.stop_fraction,
                    ),
                    clock=self.clock,
                    monotonic=self.monotonic,
                    rejections=self.rejections,
                )
            await self._leader.step()
        elif self._leader is not None:
            leader, self._leader = self._leader, None
            await leader.resign()

    # --- running and stopping ------------------------------------------------------------------------------------

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
        self._keeping, self._epoch = True, self.monotonic()

        def run(task: asyncio.Task[bool] | None, part: Callable[[], Coroutine[Any, Any, bool]]) -> asyncio.Task[bool]:
            """`task` while it runs, else `part` in a new task (raising what the ended one raised: a bug in the
            renewals or the moves ends the campaign, as it did when they ran inline)."""
            if task is not None and not task.done():
                return task
            _reap(task)
            return asyncio.create_task(self._step(part()), name=f"shard-{part.__name__.strip('_')}-{self.identity}")

        tick = loop.time()
        try:
            while not stop.is_set() and not self._halted:
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
            self._keeping = False
            await cancel_and_wait([t for t in (renewing, moving) if t is not None])
            await self._stop_keepers()
            _reap(renewing)
            _reap(moving)

    async def _stop_keepers(self) -> None:
        keepers, self._keepers = [task for _, task in self._keepers.values()], {}
        await cancel_and_wait(keepers)
        for task in keepers:
            _reap(task)

    def next_lapse(self) -> float | None:
        """When the next record or shard lease of another replica lapses if it is not renewed (wall clock); None:
        nothing of another's is live. Only a replica that stopped renewing lapses: the others renew well before,
        so this moves on. Leases as well as records: a keeper may have stamped a dead replica's lease after its
        record, and a look at the record's lapse alone found the lease still live and took the shard a whole
        renewal interval later (takeover 2.6 s against 1.9 s, `bench decide --models 3000 --replicas 3`)."""
        now = self.clock()
        ends = [
            v.renewed_at + v.lease_s
            for k, v, _ in self._view.entries()
            if (isinstance(v, ReplicaRecord) and v.identity != self.identity)
            or (isinstance(v, LeaderLease) and k.startswith(protocol.SHARD_KEY_PREFIX) and v.holder != self.identity)
        ]
        later = [t for t in ends if t > now]
        return min(later) if later else None

    def halt(self) -> None:
        """Stop taking and renewing (a flag, as `LeaderElection.halt`). The terms held run out by the fence."""
        self._halted = True

    async def resign(self) -> None:
        """Clean shutdown: `on_lost` for each held shard, then delete our leases (on their revision, else read
        back) and our replica record, so the others take over on their next round instead of after `lease_s`."""
        self.halt()
        await self._stop_keepers()
        terms = dict(self._held)
        for s in sorted(terms):
            self._lose(s, "resigned")
        # Leases the view says are ours but we no longer count as held (a lapsed term) are ours to free too.
        ours = {
            int(k[len(protocol.SHARD_KEY_PREFIX) :])
            for k, v, _ in self._view.entries()
            if k.startswith(protocol.SHARD_KEY_PREFIX) and isinstance(v, LeaderLease) and v.holder == self.identity
        }
        await asyncio.gather(*(self._delete(s, terms[s].revision if s in terms else None) for s in terms.keys() | ours))
        if self._leader is not None:
            leader, self._leader = self._leader, None
            await leader.resign()
        with contextlib.suppress(*_NATS_ERRORS):
            await self.kv.delete(protocol.replica_key(self.identity))
        await self.close()

    async def close(self) -> None:
        """Stop the bucket's watch (`resign` does it too). Leases are left to lapse: use `resign` to hand over."""
        self._halted = True
        await self._stop_keepers()
        self._view.closed = True
        if self._view_task is not None:
            task, self._view_task = self._view_task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_NATS_ERRORS):
                await task
