"""The act side of the shard leases: this replica's terms, and the fenced writes that take, renew and give them.

`ShardTerms` keeps the term of each shard this replica holds (the lease's revision, and the monotonic deadline it
may act until) and does the lease I/O on `pulse_leases` for what `autoscaler.shards.leases.ShardLeases` decides (with
`autoscaler.shards.assign`): takes (`take`: create, or compare-and-set on the revision seen or read), hand-overs
(`give_up`, `delete`) and renewals, each held shard's by a keeper task of its own under `ShardLeases.campaign`
(`keep`). `owns` is the fence: a term past its deadline is lost on the spot, and `on_lost` called. `CompatLeader`
holds the leader lease older replicas campaign for while this replica holds shard 0 ((b) of the rolling upgrade in
`autoscaler.shards.leases`). `ShardSettings` times it all.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from autoscaler.shards.assign import ShardAssignment
from autoscaler.shards.leader import LeaderElection, LeaseSettings, renew_lease, take_lease
from autoscaler.shards.renewer import LeaseRenewer
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import LeaderLease
from warmpool.registry import BucketView
from warmpool.rejects import Rejections
from warmpool.tasks import cancel_and_wait

__all__ = ["NATS_ERRORS", "Callbacks", "CompatLeader", "ShardSettings", "ShardTerms", "reap"]

log = logging.getLogger("pulsescale.shards")

NATS_ERRORS = (nats.errors.Error, TimeoutError, OSError)


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
    main_lost_after_s: float | None = None
    """Renewals made on the renewer's thread (`autoscaler.shards.renewer`) stop once the daemon's loop has had no
    turn, or its NATS connection has been down, this long: its shards then lapse to another replica within this
    plus `lease_s`. None: `main_lost_s`, 2.5 leases and at least 5 s: well above the 1-2 s a loop starved of CPU
    was seen to stall (issue 27: those must not cost a lease), well below a liveness probe's restart."""

    @property
    def main_lost_s(self) -> float:
        """`main_lost_after_s`, or its default."""
        return self.main_lost_after_s if self.main_lost_after_s is not None else max(5.0, 2.5 * self.lease_s)

    def __post_init__(self) -> None:
        if not 0 < self.renew_every_s < self.lease_s:
            raise ValueError(f"renew_every_s ({self.renew_every_s}) must be in (0, lease_s = {self.lease_s})")
        if not 0 < self.stop_fraction < 1:
            raise ValueError(f"stop_fraction ({self.stop_fraction}) must be in (0, 1): see autoscaler.shards.leader")
        if self.main_lost_after_s is not None and not self.main_lost_after_s >= self.lease_s:
            raise ValueError(f"main_lost_after_s ({self.main_lost_after_s}) must be >= lease_s ({self.lease_s})")


def reap(task: asyncio.Task[Any] | None) -> None:
    """Raise what an ended background task of the campaign raised (a bug: NATS errors are caught inside)."""
    if task is not None and task.done() and not task.cancelled() and (err := task.exception()) is not None:
        raise err


@dataclass
class _Term:
    revision: int
    act_until: float
    """Monotonic deadline: sent + lease_s * stop_fraction of the last heard renewal."""
    renewing: bool = False
    """A renewal of this term is in flight: a second on the same revision would fail, and cost a read."""


class Callbacks(Protocol):
    """Where `ShardTerms` finds the callbacks, read each time it calls one (`ShardLeases`' own attributes: they may
    be set after it starts)."""

    on_acquired: Callable[[int], None] | None
    on_lost: Callable[[int], None] | None
    on_renewal: Callable[[float], None] | None
    on_slack: Callable[[float], None] | None


def shard_ranges(shards: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``0-2,5,7-8``: a whole reassignment fits in a log line."""
    parts: list[str] = []
    ordered = sorted(set(shards))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


class ShardTerms:
    """The shards this replica holds, each a term of its lease: `owns` fences them; `take`, `keep` (or `renew`),
    `give_up` and `delete` write the leases."""

    def __init__(
        self,
        kv: KeyValue,
        identity: str,
        settings: ShardSettings,
        view: BucketView[Any],
        assignment: ShardAssignment,
        callbacks: Callbacks,
        *,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        renewer: LeaseRenewer | None = None,
    ) -> None:
        """`view` is the bucket's watch (leases written here are applied to it at once); `assignment` says which
        leases are worth a compare-and-set on the revision seen (`ShardAssignment.free`); `renewer`, when given,
        runs the keepers on its own thread, loop and connection (`autoscaler.shards.renewer`), else they run here."""
        self.kv = kv
        self.renewer = renewer
        self.identity = identity
        self.settings = settings
        self.clock = clock
        self.monotonic = monotonic
        self._view = view
        self._assignment = assignment
        self._callbacks = callbacks
        self.held: dict[int, _Term] = {}
        self._said_main_lost = False  # `_main_lost` logged this episode
        self.last_loss = ""
        """Why the shard `on_lost` is being called for was lost: one of `autoscaler.shards.leases.INVOLUNTARY` (the term
        lapsed, another replica holds the lease), or "assigned to another replica", "an older replica leads",
        "resigned"."""
        self.halted = False
        self.keeping = False  # True under `ShardLeases.campaign`: each held shard's renewals are its keeper task's
        self.epoch = 0.0  # monotonic start of `ShardLeases.campaign`: the keepers' ticks count from it (`_next_tick`)
        self.keepers: dict[int, tuple[_Term, asyncio.Task[None]]] = {}  # shard -> the term it keeps, and the task
        # (on the keepers' loop: the renewer's when there is one, and only touched there)
        self.keeper_error: BaseException | None = None  # a keeper's bug on the renewer's loop, raised by `keep`
        self.side_keepers: list[asyncio.Task[None]] = []  # others there (the replica record's, the leader lease's)
        self._took: list[int] = []  # shards taken and lost since the last `report`: one line per round, not per
        self._lost: dict[str, list[int]] = {}  # shard (a reconnect retakes all 32 at once)

    # --- the fence ---------------------------------------------------------------------------------------------

    def owns(self, shard: int) -> bool:
        term = self.held.get(shard)
        if term is None:
            return False
        if self.monotonic() >= term.act_until:
            self.lose(shard, "lease not renewed in time")
            return False
        return True

    def lose(self, shard: int, why: str) -> None:
        if self.held.pop(shard, None) is not None:
            log.debug("%s: no longer owns shard %d (%s)", self.identity, shard, why)
            self._lost.setdefault(why, []).append(shard)
            self.last_loss = why
            self._call(self._callbacks.on_lost, shard)

    def report(self) -> None:
        """Log the shards lost and taken since the last call, one line for each (per reason, for losses): called
        after each round, so a reconnect that retakes every shard says so once, not once per shard."""
        lost, took = self._lost, self._took
        self._lost, self._took = {}, []
        for why, shards in lost.items():
            log.info(
                "%s: no longer owns %d shard(s) %s (%s); owns %d now",
                self.identity, len(shards), shard_ranges(shards), why, len(self.held),
            )  # fmt: skip
        if took:
            log.info(
                "%s: owns %d more shard(s) %s; owns %d now",
                self.identity,
                len(took),
                shard_ranges(took),
                len(self.held),
            )

    def _call(self, callback: Callable[[int], None] | None, shard: int) -> None:
        """A callback's bug is logged, never raised into a round: that would stop the renewals of every shard."""
        if callback is not None:
            try:
                callback(shard)
            except Exception:
                log.exception("%s: shard %d callback failed", self.identity, shard)

    # --- the lease writes --------------------------------------------------------------------------------------

    def _lease(self, now: float) -> LeaderLease:
        return LeaderLease(holder=self.identity, renewed_at=now, lease_s=self.settings.lease_s)

    def _quiet_decode(self, data: bytes | None) -> LeaderLease | None:
        """Reads for a take or a renewal: an unreadable lease was already counted by the view."""
        try:
            return protocol.decode(data or b"", LeaderLease)
        except BadMessage:
            return None

    async def renew(
        self, shard: int, sent: float, now: float, term: _Term | None = None, *, remote: bool = False
    ) -> None:
        """Renew `term` of `shard` (by default the one held now) unless a renewal of it is in flight, or its fence
        has passed (a renewal then would only keep the lease from the replica it now goes to). `remote`: called on
        the renewer's thread, which only reads the terms and hands every change of the daemon's state back to its
        loop (the fence itself, `owns`, stays the daemon's)."""
        term = term or self.held.get(shard)
        if term is None or term.renewing or self.held.get(shard) is not term:
            return
        if not (self.monotonic() < term.act_until if remote else self.owns(shard)):
            return
        if remote and self.renewer is not None and self._main_lost(self.renewer.main_stalled_s()):
            return  # the daemon cannot act for its shards: let them lapse to a replica that can
        term.renewing = True
        try:
            await self._renew_once(shard, term, sent, now, remote=remote)
        finally:
            term.renewing = False

    async def _renew_once(self, shard: int, term: _Term, sent: float, now: float, *, remote: bool) -> None:
        key, lease = protocol.shard_key(shard), self._lease(now)
        kv = self.renewer.kv if remote and self.renewer is not None and self.renewer.kv is not None else self.kv
        try:
            got = await renew_lease(kv, key, protocol.encode(lease), term.revision, self.identity, self._quiet_decode)
        except NATS_ERRORS as err:
            log.debug("%s: shard %d not renewed: %s", self.identity, shard, err)
            return  # the fence decides what a missed renewal costs
        finally:
            if self._callbacks.on_renewal is not None:
                self._callbacks.on_renewal(self.monotonic() - sent)
        if self.held.get(shard) is not term:
            return  # this term ended while the renewal was out (lost, given up, or taken again as a new term)
        if got.revision is None:
            self._main(remote, self._lose_term, shard, term, "another replica holds its lease")
            return
        heard = self.monotonic()
        if heard >= term.act_until or (not remote and not self.owns(shard)):
            return  # came back too late to extend a term that already ended; the next round takes it again
        term.revision = got.revision
        if got.extended:
            if self._callbacks.on_slack is not None:
                self._callbacks.on_slack(term.act_until - heard)  # what was left of the term: at 0 it is lost
            term.act_until = sent + self.settings.lease_s * self.settings.stop_fraction
            self._main(remote, self._view.apply_local, key, lease, got.revision)

    def _main_lost(self, stalled_s: float) -> bool:
        """Whether the daemon's loop (or its connection) is lost for `stalled_s`: said once per episode."""
        lost = stalled_s > self.settings.main_lost_s
        if lost and not self._said_main_lost:
            log.error(
                "%s: the event loop has had no turn, or its NATS connection has been down, for %.1f s (over %.1f s): "
                "shard leases are no longer renewed, so another replica takes the shards",
                self.identity, stalled_s, self.settings.main_lost_s,
            )  # fmt: skip
        self._said_main_lost = lost
        return lost

    def _main(self, remote: bool, fn: Callable[..., Any], *args: Any) -> None:
        """`fn(*args)` on the daemon's loop: now when already there, else handed over from the renewer's thread."""
        if remote and self.renewer is not None:
            self.renewer.on_main(fn, *args)
        else:
            fn(*args)

    def _lose_term(self, shard: int, term: _Term, why: str) -> None:
        if self.held.get(shard) is term:
            self.lose(shard, why)

    async def take(self, shard: int) -> None:
        # The term is timed from the moment the lease is stamped, when its write is sent (`take_lease`): not the
        # round's start, which a starved replica's slow renewals may have begun a second earlier (the term would
        # end at once), nor the take's read, a round trip earlier.
        key, stamped = protocol.shard_key(shard), []

        def lease() -> bytes:
            stamped.append(self._lease(self.clock()))
            return protocol.encode(stamped[-1])

        seen, free_at = self._view.value(key), None
        if isinstance(seen, LeaderLease) and self._assignment.free(shard, self.clock()):
            free_at = self._view.revision(key)
        try:
            took = await take_lease(
                self.kv, key, lease, self.identity, self.clock, self._quiet_decode, self.monotonic, seen=free_at
            )
        except NATS_ERRORS as err:
            log.debug("%s: shard %d not taken: %s", self.identity, shard, err)
            return
        if took is None:
            return
        rev, sent = took
        if self.halted:  # `ShardLeases.resign` ran while the take was in flight: hand it straight back
            await self.delete(shard, rev)
            return
        self.held[shard] = _Term(rev, sent + self.settings.lease_s * self.settings.stop_fraction)
        self._view.apply_local(key, stamped[-1], rev)
        log.debug("%s: owns shard %d (lease revision %d)", self.identity, shard, rev)
        self._took.append(shard)
        self._call(self._callbacks.on_acquired, shard)
        self.keep(shard)  # its first renewal at once, not at the next round

    async def give_up(self, shard: int, why: str) -> None:
        term = self.held.get(shard)
        if term is None:
            return
        self.lose(shard, why)
        await self.delete(shard, term.revision)

    async def delete(self, shard: int, revision: int | None) -> None:
        """Delete our lease of `shard`, on `revision` if known; when that fails, read it back and delete it if it
        is still ours (a renewal may have landed unheard)."""
        key = protocol.shard_key(shard)
        with contextlib.suppress(*NATS_ERRORS):
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

    # --- the keepers (under `ShardLeases.campaign`) ------------------------------------------------------------

    def keep(self, shard: int) -> None:
        """Under `ShardLeases.campaign`, start the task that renews `shard` while this term of it lasts (idempotent
        per term: a shard lost and taken back gets a keeper of its own term at once, the old one is cancelled). With
        a renewer the keeper runs on its thread (`autoscaler.shards.renewer`)."""
        if self.keeper_error is not None:
            raise self.keeper_error  # a keeper that died of a bug ends the campaign, as the rounds' bugs do
        term = self.held.get(shard)
        if not self.keeping or term is None:
            return
        if self.renewer is not None and self.renewer.running:
            self.renewer.call(self._keep_here, shard, term, True)
        else:
            self._keep_here(shard, term, False)

    def _keep_here(self, shard: int, term: _Term, remote: bool) -> None:
        """`keep`, on the keepers' loop."""
        if self.halted or not self.keeping or self.held.get(shard) is not term:
            return
        kept = self.keepers.get(shard)
        if kept is not None:
            if kept[0] is term and not kept[1].done():
                return
            try:
                reap(kept[1])
            except Exception as err:
                if not remote:
                    raise
                self.keeper_error = err
            kept[1].cancel()
        task = asyncio.create_task(self._keeper(shard, term, remote), name=f"shard-{shard}-keeper")
        self.keepers[shard] = (term, task)

    async def _keeper(self, shard: int, term: _Term, remote: bool = False) -> None:
        """Renew `shard` at once, then on each of the replica's ticks (`_next_tick`), or as soon as a slower
        renewal is answered. Each shard on its own: a renewal never waits for another's answer, a take, a
        hand-over or the replica record, so a term lasts as long as one round trip stays under
        `lease_s * stop_fraction / 2` (0.8 s at the defaults), right after a take too. In one round of them all,
        the slowest answer set the pace, the holder of shard 0 renewed the leader lease after its shards, and a
        shard just taken waited for the next round: all three lost leases under a slow broker (`bench decide
        --models 3000 --replicas 3`)."""
        while not self.halted and self.held.get(shard) is term:
            sent = self.monotonic()
            await self.renew(shard, sent, self.clock(), term, remote=remote)
            await asyncio.sleep(max(0.0, self._next_tick(sent) - self.monotonic()))

    def _next_tick(self, after: float) -> float:
        """The first of the replica's renewal ticks (every `renew_every_s` from `ShardLeases.campaign`'s start)
        after `after`. The keepers renew on the same ticks, so their renewals go out and come back together, as one
        round's did, rather than spread over the interval. One answered after its next tick is renewed at once:
        an interval never exceeds a round trip."""
        every = self.settings.renew_every_s
        return self.epoch + (math.floor((after - self.epoch) / every) + 1) * every

    async def stop_keepers(self) -> None:
        """Cancel every keeper and wait until each has ended (on the renewer's loop when there is one)."""
        if self.renewer is not None and self.renewer.running:
            await self.renewer.run(self._stop_keepers_here())
        else:
            await self._stop_keepers_here()

    async def _stop_keepers_here(self) -> None:
        keepers, self.keepers = [task for _, task in self.keepers.values()], {}
        keepers += self.side_keepers
        self.side_keepers = []
        await cancel_and_wait(keepers)
        for task in keepers:
            reap(task)


class CompatLeader:
    """(b) of the rolling upgrade (`autoscaler.shards.leases`): the leader lease older replicas campaign for, held by
    the holder of shard 0 (`leader`, a `LeaderElection`, while it does) and resigned when it gives shard 0 up. Under
    `ShardLeases.campaign` with a running renewer, each term's renewals are a keeper's on the renewer's thread
    (`_keeper`), as the shards' are: on the daemon's loop a busy loop cost the lease up to 45 times a run."""

    def __init__(
        self,
        kv: KeyValue,
        identity: str,
        settings: ShardSettings,
        terms: ShardTerms,
        *,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
        rejections: Rejections,
    ) -> None:
        self.kv = kv
        self.identity = identity
        self.settings = settings
        self.clock = clock
        self.monotonic = monotonic
        self.rejections = rejections
        self._terms = terms
        self.leader: LeaderElection | None = None  # (b): while we hold shard 0
        self._leading = asyncio.Lock()  # one `lead` at a time
        self._gen = 0  # bumped (on the daemon's loop) at each take and resign: a keeper keeps one generation's
        self._kept_gen = -1  # term, the one last handed to it
        self._keeper_task: asyncio.Task[None] | None = None  # the keeper and its renewal in flight: on the
        self._renewal: asyncio.Task[bool] | None = None  # renewer's loop, and only touched there

    async def lead(self, *, renewing: bool = False) -> None:
        """(b) of `autoscaler.shards.leases`' module doc: the holder of shard 0 also holds the leader lease older
        replicas campaign for. The renewals only renew it (`renewing`), unless a keeper does (`kept`): taking or
        resigning it is the moves' (`due`), so the renewals never wait behind a take's two round trips. One at a
        time."""
        if renewing and (self._leading.locked() or self.due() or self.leader is None or self.kept()):
            return
        async with self._leading:
            await self._lead_once()

    def due(self) -> bool:
        """The leader lease wants a take (we own shard 0 and do not lead) or a resign (we lead, or tried to,
        without shard 0): more than a renewal."""
        leading = self.leader is not None and self.leader.is_leader
        return (self._terms.owns(0) and not leading) or (not self._terms.owns(0) and self.leader is not None)

    def kept(self) -> bool:
        """Whether this term's renewals are a keeper's on the renewer's thread, not this loop's."""
        renewer = self._terms.renewer
        return self._kept_gen == self._gen and self._terms.keeping and renewer is not None and renewer.running

    async def _lead_once(self) -> None:
        if self._terms.owns(0) and not self._terms.halted:
            if self.leader is None:
                self.leader = LeaderElection(
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
            leader = self.leader
            if leader.is_leader and self.kept():
                return  # its keeper renews it (the moves' second `lead`, after a take)
            if not leader.is_leader:
                self._gen += 1  # a take: a term of its own, for a keeper of its own
            await leader.step()
            if leader.is_leader and not self.kept():
                self._keep(leader)  # a term just taken (or held from before the campaign)
        elif self.leader is not None:
            leader, self.leader = self.leader, None
            await self._resign(leader)

    async def resign(self) -> None:
        """Resign the leader lease if we hold it, under way or not (`ShardLeases.resign`)."""
        if self.leader is not None:
            leader, self.leader = self.leader, None
            await self._resign(leader)

    async def _resign(self, leader: LeaderElection) -> None:
        leader.halt()  # no renewal starts now, here or on the renewer's thread
        self._gen += 1
        renewer = self._terms.renewer
        if renewer is not None and renewer.running:
            # A renewal still out must not land after `resign`'s read-back: it would keep the lease from the next.
            await renewer.run(self._stop_keeper_here())
        await leader.resign()

    # --- the keeper, on the renewer's loop -------------------------------------------------------------------

    def _keep(self, leader: LeaderElection) -> None:
        """Hand this term's renewals to a keeper of its own on the renewer's thread, if it runs."""
        renewer = self._terms.renewer
        if self._terms.keeping and renewer is not None and renewer.running and renewer.kv is not None:
            self._kept_gen = self._gen
            renewer.call(self._keep_here, leader, self._gen, renewer, renewer.kv)

    def _keep_here(self, leader: LeaderElection, gen: int, renewer: LeaseRenewer, kv: KeyValue) -> None:
        if self._gen != gen or self._terms.halted or not self._terms.keeping:
            return
        if self._keeper_task is not None:
            self._keeper_task.cancel()  # an earlier term's, if not ended yet
        self._keeper_task = asyncio.create_task(self._keeper(leader, gen, renewer, kv), name="leader-keeper")
        # Stopped with the shard keepers; those that ended cleanly are dropped (one per take of shard 0).
        side = self._terms.side_keepers
        side[:] = [t for t in side if not t.done() or (not t.cancelled() and t.exception() is not None)]
        side.append(self._keeper_task)

    async def _keeper(self, leader: LeaderElection, gen: int, renewer: LeaseRenewer, kv: KeyValue) -> None:
        """Renew the leader lease over `kv` at once, then on the shard keepers' ticks (`ShardTerms._next_tick`),
        while shard 0's term lasts; ends with the term (deposed, resigned, or a newer take's keeper). Its end
        (`_depose`) and the fence (`is_leader`) stay the daemon's loop's."""
        while self._gen == gen and not self._terms.halted:
            sent = self.monotonic()
            shard0 = self._terms.held.get(0)
            # Only with shard 0 live, and a daemon that can act (`ShardTerms._main_lost`): else let it lapse.
            if shard0 is not None and sent < shard0.act_until and not self._terms._main_lost(renewer.main_stalled_s()):
                depose = functools.partial(renewer.on_main, self._deposed, leader, gen)
                # A task of its own, shielded: a stopped keeper leaves it to be answered (`_stop_keeper_here`).
                self._renewal = renewal = asyncio.ensure_future(leader._renew(kv, depose))
                renewal.add_done_callback(_retrieved)
                try:
                    if not await asyncio.shield(renewal):
                        return
                except NATS_ERRORS as err:
                    log.debug("%s: leader lease not renewed: %s", self.identity, err)  # the fence decides
            await asyncio.sleep(max(0.0, self._terms._next_tick(sent) - self.monotonic()))

    def _deposed(self, leader: LeaderElection, gen: int, why: str) -> None:
        """On the daemon's loop: a keeper found another replica holding the lease (not a later term of ours)."""
        if self._gen == gen:
            leader._depose(why)

    async def _stop_keeper_here(self) -> None:
        """Cancel the keeper and wait for its renewal in flight to be answered (or time out: the renewer's
        `kv_timeout_s`). One cut short could still land after `resign`'s read-back: a cancel does not unsend it."""
        task, self._keeper_task = self._keeper_task, None
        renewal, self._renewal = self._renewal, None
        if task is not None:
            await cancel_and_wait([task])
        if renewal is not None:
            await asyncio.wait([renewal])


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A keeper's renewal may outlive its keeper: its error is the keeper's to raise, or nobody's."""
    if not task.cancelled():
        task.exception()
