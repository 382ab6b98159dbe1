"""Leader election over a fenced lease in KV `pulse_leases`.

Several autoscaler replicas run; one acts. The lease (`protocol.LeaderLease` under `protocol.LEADER_LEASE_KEY`)
says who holds it and when it was last renewed; it is taken and renewed only by compare-and-set, so two replicas
can never both win the same revision. A lease that breaks the contract protects nobody: it is counted (by
reason), logged, and taken over as if expired.

Safety rests on timing the two sides differently. A standby may take the lease only once
``renewed_at + lease_s`` has passed by its clock. The leader stops acting at ``sent + lease_s * stop_fraction``
by its own monotonic clock, where ``sent`` is when it *sent* its last successful renewal (so before the broker
stamped it). With `stop_fraction` < 1 the old leader has stopped before any standby may start, even when the
renewal's acknowledgement was slow, as long as clocks disagree by less than ``lease_s * (1 - stop_fraction)``.

The two compare-and-set steps, `take_lease` and `renew_lease`, are shared with the shard leases
(`autoscaler.shards.leases`), which hold one such lease per shard; the holder of shard 0 also holds this one, so that
replicas of revision 5 and older, which know only this lease, stay standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import LeaderLease
from warmpool.rejects import Rejections

__all__ = ["LeaderElection", "LeaseSettings", "Renewal", "renew_lease", "take_lease"]

log = logging.getLogger("pulsescale.leader")


@dataclass(frozen=True)
class LeaseSettings:
    key: str = protocol.LEADER_LEASE_KEY
    """One lease for all autoscaler replicas sharing these buckets."""
    lease_s: float = 2.0
    """How long a silent leader keeps the lease: the failover time is at most this plus one renewal interval."""
    renew_every_s: float = 0.5
    """Renew four times per lease, so one slow round trip does not lose it."""
    stop_fraction: float = 0.8
    """The leader stops acting this far into its lease without a renewal (see the module doc)."""


class LeaderElection:
    """Run `campaign()` as a task; `is_leader` says whether this replica may act right now."""

    def __init__(
        self,
        kv: KeyValue,
        identity: str,
        settings: LeaseSettings = LeaseSettings(),
        *,
        on_elected: Callable[[], None] | None = None,
        on_deposed: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        rejections: Rejections | None = None,
    ) -> None:
        """`clock` stamps and judges leases (wall time, shared with the other replicas); `monotonic` times this
        replica's own term. `rejections` counts unreadable leases (the daemon binds the registry's metric)."""
        self.kv = kv
        self.identity = identity
        self.settings = settings
        self.on_elected = on_elected
        self.on_deposed = on_deposed
        self.clock = clock
        self.monotonic = monotonic
        self.rejections = rejections or Rejections(log)
        self._revision: int | None = None
        self._act_until = 0.0  # monotonic deadline of our leadership
        self._leading = False
        self._halted = False

    @property
    def is_leader(self) -> bool:
        if self._leading and self.monotonic() >= self._act_until:
            self._depose("lease not renewed in time")
        return self._leading

    def _depose(self, why: str) -> None:
        if self._leading:
            self._leading = False
            self._revision = None
            log.warning("%s: no longer the leader (%s)", self.identity, why)
            if self.on_deposed is not None:
                self.on_deposed()

    def _encode(self) -> bytes:
        return protocol.encode(
            LeaderLease(holder=self.identity, renewed_at=self.clock(), lease_s=self.settings.lease_s)
        )

    def _decode(self, data: bytes | None) -> LeaderLease | None:
        """The lease in `data`, or None (counted and logged) when it breaks the contract."""
        try:
            return protocol.decode(data or b"", LeaderLease)
        except BadMessage as err:
            self.rejections(err, source=f"{protocol.LEASES_BUCKET}/{self.settings.key}")
            return None

    async def _try_acquire(self) -> bool:
        if self._halted:
            return False
        took = await take_lease(
            self.kv, self.settings.key, self._encode, self.identity, self.clock, self._decode, self.monotonic
        )
        if took is None:
            return False
        rev, sent = took
        self._revision = rev
        self._act_until = sent + self.settings.lease_s * self.settings.stop_fraction
        self._leading = True
        log.info("%s: elected leader (lease revision %d)", self.identity, rev)
        if self.on_elected is not None:
            self.on_elected()
        return True

    async def _renew(self, kv: KeyValue | None = None, depose: Callable[[str], None] | None = None) -> bool:
        """Renew the lease over `kv` (by default our own); False when the term has ended. From another thread (a
        `LeaseRenewer`'s loop and `kv`) only the term's extension is written there: `depose` hands its end back
        to the owning loop, and a lapsed fence is left to `is_leader` there."""
        if self._halted or self._revision is None or not self._leading:
            return False
        sent = self.monotonic()
        got = await renew_lease(
            kv or self.kv, self.settings.key, self._encode(), self._revision, self.identity, self._decode
        )
        if got.revision is None:
            (depose or self._depose)("another replica holds the lease")
            return False
        if not self._leading or self.monotonic() >= self._act_until:
            return False  # the renewal came back too late to extend a term that already ended
        self._revision = got.revision
        if got.extended:
            self._act_until = sent + self.settings.lease_s * self.settings.stop_fraction
        return True

    async def campaign(self, stop: asyncio.Event) -> None:
        # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation that races its timeout.
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await self._campaign(stop, stopped)
        finally:
            stopped.cancel()

    def halt(self) -> None:
        """Stop campaigning: no more acquisitions or renewals. A flag, not only a cancellation, because a
        cancellation that races a nats-py reply can be swallowed on Python 3.11 (its requests use wait_for)."""
        self._halted = True

    async def step(self) -> bool:
        """One round of the campaign: renew the lease if we hold it, else try to take it. Returns `is_leader`.
        `campaign` runs one every `renew_every_s`; tests call it directly, on their own clocks."""
        try:
            if self._leading:
                await self._renew()
            else:
                await self._try_acquire()
        except (nats.errors.Error, TimeoutError, OSError) as err:
            log.debug("lease round failed: %s", err)
        return self.is_leader

    async def _campaign(self, stop: asyncio.Event, stopped: asyncio.Future[Any]) -> None:
        while not stop.is_set() and not self._halted:
            await self.step()
            await asyncio.wait([stopped], timeout=self.settings.renew_every_s)

    async def resign(self) -> None:
        """Clean shutdown: give the lease up so a standby takes over at once instead of after `lease_s`.
        Stop `campaign` first. The lease is read back rather than trusted from memory: a renewal cut short by
        the shutdown may have landed without our hearing of it."""
        self.halt()
        self._depose("resigned")
        with contextlib.suppress(nats.errors.Error, TimeoutError, OSError):
            entry = await self.kv.get(self.settings.key)
            lease = self._decode(entry.value)
            if lease is not None and lease.holder == self.identity:
                await self.kv.delete(self.settings.key, last=entry.revision)


# --- one fenced lease, shared by the leader election and the shard leases (`autoscaler.shards.leases`)
# -------------------


async def take_lease(
    kv: KeyValue,
    key: str,
    value: Callable[[], bytes],
    identity: str,
    clock: Callable[[], float],
    decode: Callable[[bytes | None], LeaderLease | None],
    monotonic: Callable[[], float] = time.monotonic,
    *,
    seen: int | None = None,
) -> tuple[int, float] | None:
    """Write the lease `value()` under `key` if it is free, expired, unreadable or already ours (`identity`'s):
    create, or compare-and-set on the revision read. `value()` is called just before the write, so the lease is
    stamped then and not a read's round trip earlier (under a broker slow to answer, that round trip was a term
    spent before it began). The new revision and the `monotonic` time the write was sent (the term starts there),
    or None when another holder has it live or another replica won the race. `decode` counts an unreadable lease
    (or stays quiet) and returns None for it.

    `seen`: the revision at which a watch last saw the lease free by these rules (expired, or ours). The write is
    then a compare-and-set on it straight away, one round trip instead of two (a dead replica's shards are taken
    sooner); only when the lease has moved on since is it read as above."""
    if seen is not None:
        with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
            sent = monotonic()
            return await kv.update(key, value(), last=seen), sent
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:  # KeyDeletedError too: a resigned lease
        entry = None
    try:
        if entry is None or entry.value is None:
            sent = monotonic()
            return await kv.create(key, value()), sent
        cur = decode(entry.value)
        expired = cur is None or clock() > cur.renewed_at + cur.lease_s  # unreadable protects nobody
        if not expired and cur is not None and cur.holder != identity:
            return None
        sent = monotonic()
        return await kv.update(key, value(), last=entry.revision), sent
    except nats.js.errors.KeyWrongLastSequenceError:
        return None


@dataclass(frozen=True)
class Renewal:
    revision: int | None
    """The lease's revision now, or None: another replica holds it (we are deposed)."""
    extended: bool
    """True when our renewal was heard, so the term may be extended from when it was sent. False when the
    compare-and-set failed yet the lease read back is ours: an earlier renewal landed although its answer timed
    out. Keep the lease, but not a longer term: we do not know when it landed."""


async def renew_lease(
    kv: KeyValue,
    key: str,
    value: bytes,
    last: int,
    identity: str,
    decode: Callable[[bytes | None], LeaderLease | None],
) -> Renewal:
    """Compare-and-set the lease `value` onto revision `last`. Errors other than a lost compare-and-set (a
    timeout, a broken connection) propagate: the caller's fencing decides what they cost."""
    try:
        return Renewal(await kv.update(key, value, last=last), extended=True)
    except nats.js.errors.KeyWrongLastSequenceError:
        try:
            entry = await kv.get(key)
        except (nats.errors.Error, TimeoutError):
            return Renewal(None, extended=False)
        lease = decode(entry.value)
        if lease is not None and lease.holder == identity and entry.revision is not None:
            return Renewal(entry.revision, extended=False)
        return Renewal(None, extended=False)
