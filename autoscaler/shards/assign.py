"""Which shards each live replica should hold, from what `pulse_leases` shows: the deciding half of the shard leases.

`assign` splits the shards over the live replicas (rendezvous hashing with equal quotas). `ShardAssignment` reads the
bucket as last seen (`Seen`: the watch `autoscaler.shards.leases.ShardLeases` keeps) and answers for one replica: who is
alive (`replicas`), who holds a shard (`holder`), when another's record or lease lapses next (`next_lapse`), whether
an older replica leads (`legacy_holder`), and which held shards to give up and which to take (`moves`). No NATS, no
tasks, no clock: time is an argument, so every answer follows from the view and `now`. The act side
(`autoscaler.shards.terms`) takes, renews and gives the leases; `autoscaler.shards.leases` joins the two.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Iterable
from typing import Any, Protocol

from warmpool import protocol
from warmpool.protocol import LeaderLease, ReplicaRecord

__all__ = ["FORGET_AFTER_LEASES", "Seen", "ShardAssignment", "assign"]

log = logging.getLogger("pulsescale.shards")

FORGET_AFTER_LEASES = 10
"""A replica record lapsed this many leases is deleted by the holder of shard 0."""


def _weight(member: str, shard: int) -> bytes:
    return hashlib.blake2b(f"{member}\x00{shard}".encode(), digest_size=8).digest()


def assign(shards: int, members: Iterable[str]) -> dict[int, str]:
    """Shard -> member: rendezvous hashing with equal quotas. Every (member, shard) pair has a weight (blake2b);
    pairs are taken heaviest first, each shard going to the first member that still has room, and every member has
    room for ``shards // n`` shards (the first ``shards % n`` of them, in an order fixed by their names' hash, one
    more). So the split is even (the busiest holds at most one shard more than the idlest: plain rendezvous hashing
    leaves 3 replicas with 16 of 32 shards at worst), and it stays stable: a member joining or leaving moves its own
    share plus a few shards between the others (7 of 32 at worst over 2,000 random fleets of 1-7,
    tests/autoscaler/test_shards.py). Pure and order-independent, so every replica computes the same plan from the same
    members. Empty without members."""
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


class Seen(Protocol):
    """What `ShardAssignment` reads of `pulse_leases`: key -> decoded lease or replica record, with revisions (a
    `registry.BucketView` in the daemon)."""

    def value(self, key: str) -> Any: ...

    def entries(self) -> Iterable[tuple[str, Any, int]]: ...

    def __contains__(self, key: object) -> bool: ...


class ShardAssignment:
    """The deciding half of `autoscaler.shards.leases.ShardLeases` for replica `identity`: what the view `seen` says
    about the others, and which shards this replica should give up and take."""

    def __init__(self, identity: str, shards: int, seen: Seen) -> None:
        self.identity = identity
        self.shards = shards
        self.seen = seen
        self.legacy: str | None = None  # the older replica leading through LEADER_LEASE_KEY, while it does
        self._last_plan: tuple[tuple[str, ...], dict[int, str]] | None = None

    # --- the others, as last seen ------------------------------------------------------------------------------

    def replicas(self, now: float) -> list[ReplicaRecord]:
        """Live replicas as last seen (ours included once announced), sorted by identity."""
        recs = [
            v
            for k, v, _ in self.seen.entries()
            if k.startswith(protocol.REPLICA_KEY_PREFIX)
            and isinstance(v, ReplicaRecord)
            and now <= v.renewed_at + v.lease_s
        ]
        return sorted(recs, key=lambda r: r.identity)

    def holder(self, shard: int, now: float) -> str | None:
        """The live holder of `shard`'s lease as last seen, unless that is us; None: nobody now."""
        lease = self.seen.value(protocol.shard_key(shard))
        if not isinstance(lease, LeaderLease) or now > lease.renewed_at + lease.lease_s:
            return None
        return None if lease.holder == self.identity else lease.holder

    def next_lapse(self, now: float) -> float | None:
        """When the next record or shard lease of another replica lapses if it is not renewed (wall clock); None:
        nothing of another's is live. Only a replica that stopped renewing lapses: the others renew well before,
        so this moves on. Leases as well as records: a keeper may have stamped a dead replica's lease after its
        record, and a look at the record's lapse alone found the lease still live and took the shard a whole
        renewal interval later (takeover 2.6 s against 1.9 s, `bench decide --models 3000 --replicas 3`)."""
        ends = [
            v.renewed_at + v.lease_s
            for k, v, _ in self.seen.entries()
            if (isinstance(v, ReplicaRecord) and v.identity != self.identity)
            or (isinstance(v, LeaderLease) and k.startswith(protocol.SHARD_KEY_PREFIX) and v.holder != self.identity)
        ]
        later = [t for t in ends if t > now]
        return min(later) if later else None

    def lapsed_records(self, now: float) -> list[tuple[str, int]]:
        """Key and revision of each replica record lapsed for `FORGET_AFTER_LEASES` leases: the sweep's to delete."""
        return [
            (k, rev)
            for k, v, rev in self.seen.entries()
            if isinstance(v, ReplicaRecord) and now > v.renewed_at + v.lease_s * (1 + FORGET_AFTER_LEASES)
        ]

    def our_leases(self) -> set[int]:
        """The shards whose lease the view says is ours, whether or not we count them as held."""
        return {
            int(k[len(protocol.SHARD_KEY_PREFIX) :])
            for k, v, _ in self.seen.entries()
            if k.startswith(protocol.SHARD_KEY_PREFIX) and isinstance(v, LeaderLease) and v.holder == self.identity
        }

    # --- steps 2 and 3, decided --------------------------------------------------------------------------------

    def moves(self, now: float, members: list[str], held: Collection[int]) -> tuple[list[int], list[int]]:
        """Steps 2 and 3 of `autoscaler.shards.leases`: the shards of `held` to give up and the shards to take, by the
        plan over `members` (the live replicas; ours is added) or, while an older replica leads (`legacy`, logged once
        when it starts and when it stops), none to take and every held one to give up."""
        if self.identity not in members:
            members.append(self.identity)
        legacy = self.legacy_holder(now)
        if legacy != self.legacy:
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
            self.legacy = legacy
        plan = {} if legacy is not None else self.plan(members)
        give_up = [s for s in held if plan.get(s) != self.identity]
        take = [s for s, m in plan.items() if m == self.identity and s not in held and self.free(s, now)]
        return give_up, take

    def plan(self, members: list[str]) -> dict[int, str]:
        """`assign` over `members`, recomputed only when they change (most rounds they do not)."""
        key = tuple(sorted(members))
        if self._last_plan is None or self._last_plan[0] != key:
            self._last_plan = (key, assign(self.shards, key))
        return self._last_plan[1]

    def legacy_holder(self, now: float) -> str | None:
        """The holder of a live leader lease that has no replica record at all, live or lapsed: an older version.
        (A dead replica of ours may hold a leader lease that outlives its record by a round trip; its lapsed
        record says it was one of us.)"""
        lease = self.seen.value(protocol.LEADER_LEASE_KEY)
        if not isinstance(lease, LeaderLease) or now > lease.renewed_at + lease.lease_s:
            return None
        if lease.holder == self.identity or protocol.REPLICA_KEY_PREFIX + lease.holder in self.seen:
            return None
        return lease.holder

    def free(self, shard: int, now: float) -> bool:
        """Worth a try by the view: no lease, an expired one, or ours. The take itself reads and compare-and-sets."""
        lease = self.seen.value(protocol.shard_key(shard))
        return (
            not isinstance(lease, LeaderLease)
            or lease.holder == self.identity
            or now > lease.renewed_at + lease.lease_s
        )
