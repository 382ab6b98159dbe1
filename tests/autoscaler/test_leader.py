"""Leader election over the fenced lease in pulse_leases, against a real nats-server, on hand clocks.

Each replica gets two clocks, as in production: `wall` stamps and judges leases (shared by the replicas) and
`mono` times the replica's own term. The tests move them by hand and run campaign rounds with `step()`.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.shards.leader import LeaderElection, LeaseSettings
from tests.helpers import HandClock, wait_for
from warmpool import protocol
from warmpool.protocol import LeaderLease
from warmpool.registry import ensure_buckets
from warmpool.rejects import Rejections

LEASE = LeaseSettings(lease_s=1.0, renew_every_s=0.2, stop_fraction=0.8)


class Clocks:
    """One wall clock all replicas read, and a monotonic clock that moves with it."""

    def __init__(self) -> None:
        self.wall = HandClock()
        self.mono = HandClock(start=1000.0)

    def advance(self, dt: float) -> None:
        self.wall.advance(dt)
        self.mono.advance(dt)

    def replica(self, kv: KeyValue, name: str, settings: LeaseSettings = LEASE, **kw: object) -> LeaderElection:
        return LeaderElection(kv, name, settings, clock=self.wall, monotonic=self.mono, **kw)  # type: ignore[arg-type]


async def leases(nc: Client) -> KeyValue:
    return (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]


async def test_one_leader_while_it_renews_and_the_old_one_stops_before_a_new_one_starts(nc: Client) -> None:
    kv, t = await leases(nc), Clocks()
    a, b = t.replica(kv, "a"), t.replica(kv, "b")
    assert await a.step() and not await b.step()
    for _ in range(20):  # four lease periods: b never gets in while a renews every 0.2 s
        t.advance(0.2)
        assert await a.step()
        assert not await b.step()
    # a freezes (SIGKILL-like: no renewals, no resign). Its term ends 0.8 lease after its last renewal was sent;
    # b may start only after a full lease by the wall clock.
    t.advance(0.79)
    assert a.is_leader
    t.advance(0.02)
    assert not a.is_leader, "the old leader acts past stop_fraction x lease"
    assert not await b.step(), "a standby took a lease that had not run out"
    t.advance(0.2)  # 1.01 lease after a's last renewal
    assert await b.step()
    assert not a.is_leader


async def test_election_and_deposition_call_back(nc: Client) -> None:
    kv, t = await leases(nc), Clocks()
    events: list[str] = []
    a = t.replica(kv, "a", on_elected=lambda: events.append("up"), on_deposed=lambda: events.append("down"))
    assert await a.step()
    t.advance(0.9)  # no renewal: the term ends by the monotonic clock alone
    assert not a.is_leader
    assert events == ["up", "down"]


async def test_resign_hands_over_at_once(nc: Client) -> None:
    kv, t = await leases(nc), Clocks()
    slow = LeaseSettings(lease_s=30.0, renew_every_s=0.1)
    a, b = t.replica(kv, "a", slow), t.replica(kv, "b", slow)
    assert await a.step()
    t.advance(1.0)
    assert not await b.step()
    await a.resign()
    assert not a.is_leader
    assert await b.step(), "b waited for a 30 s lease that a had given up"


async def test_deposed_when_someone_else_took_the_lease(nc: Client) -> None:
    kv, t = await leases(nc), Clocks()
    events: list[str] = []
    a = t.replica(kv, "a", on_elected=lambda: events.append("up"), on_deposed=lambda: events.append("down"))
    assert await a.step()
    intruder = LeaderLease(holder="intruder", renewed_at=t.wall() + 100, lease_s=1.0)  # an operator's hand edit
    await kv.put(LEASE.key, protocol.encode(intruder))
    t.advance(0.2)
    assert not await a.step()
    assert events == ["up", "down"] and not a.is_leader


async def test_a_renewal_that_landed_unheard_keeps_the_lease_on_the_old_term(nc: Client) -> None:
    """The broker applied a renewal whose answer timed out: the next compare-and-set fails, yet the lease is
    still ours. Keep it, but on the old term (we cannot prove when it landed)."""
    kv, t = await leases(nc), Clocks()
    a = t.replica(kv, "a")
    assert await a.step()  # term until 0.8
    t.advance(0.5)
    await kv.put(LEASE.key, protocol.encode(LeaderLease(holder="a", renewed_at=t.wall(), lease_s=1.0)))
    assert await a.step(), "deposed by our own renewal"
    t.advance(0.29)
    assert a.is_leader
    t.advance(0.02)  # 0.81: the unheard renewal did not extend the term
    assert not a.is_leader


async def test_after_an_unheard_renewal_the_next_one_extends_the_term_as_usual(nc: Client) -> None:
    kv, t = await leases(nc), Clocks()
    a, b = t.replica(kv, "a"), t.replica(kv, "b")
    assert await a.step()  # term until 0.8
    t.advance(0.5)
    await kv.put(LEASE.key, protocol.encode(LeaderLease(holder="a", renewed_at=t.wall(), lease_s=1.0)))
    assert await a.step()
    t.advance(0.1)
    assert await a.step()  # heard: a new term, until 0.6 + 0.8
    t.advance(0.5)  # 1.1
    assert a.is_leader
    assert not await b.step()


async def test_an_unreadable_lease_is_counted_and_taken_as_expired(nc: Client) -> None:
    kv, t = await leases(nc), Clocks()
    counted: list[str] = []
    a = t.replica(kv, "a", rejections=Rejections(logging.getLogger("test"), on_reject=counted.append))
    await kv.put(LEASE.key, b'{"v": 1, "holder": "ghost", "renewed_at": 1e12}')  # no lease_s: unreadable
    assert await a.step(), "an unreadable lease protected nobody"
    assert counted == ["missing_field"]
    lease = protocol.decode((await kv.get(LEASE.key)).value or b"", LeaderLease)
    assert lease.holder == "a"


async def test_failover_within_lease_plus_one_renewal_on_real_time(nc: Client) -> None:
    """The campaign loop itself, on real time: a standby takes over a frozen leader within lease + one renewal."""
    kv = await leases(nc)
    a, b = LeaderElection(kv, "a", LEASE), LeaderElection(kv, "b", LEASE)
    stop = asyncio.Event()
    ta = asyncio.create_task(a.campaign(stop))
    await wait_for(lambda: a.is_leader, 5, "a elected")
    tb = asyncio.create_task(b.campaign(stop))
    try:
        a.halt()  # frozen: no renewals, no resign
        took = await wait_for(lambda: b.is_leader, 5, "b elected")
        assert took <= LEASE.lease_s + LEASE.renew_every_s + 0.5, f"failover took {took:.2f} s"
        assert not a.is_leader
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(ta, tb, return_exceptions=True), 5)
