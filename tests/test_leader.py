"""Leader election over the fenced lease in pulse_leases, against a real nats-server."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client

from autoscaler.leader import LeaderElection, LeaseSettings
from warmpool import protocol
from warmpool.registry import ensure_buckets

FAST = LeaseSettings(lease_s=1.0, renew_every_s=0.2)


async def until(cond, timeout: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.01)
    return time.monotonic()


async def test_one_leader_and_failover_within_lease_plus_one_second(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    a = LeaderElection(kv, "a", FAST)
    b = LeaderElection(kv, "b", FAST)
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    ta = asyncio.create_task(a.campaign(stop_a))
    await until(lambda: a.is_leader)
    tb = asyncio.create_task(b.campaign(stop_b))
    try:
        for _ in range(20):  # two lease periods: b never gets in while a renews
            await asyncio.sleep(0.1)
            assert a.is_leader and not b.is_leader
        # a freezes (SIGKILL-like: no resign, no renewals).
        a.halt()
        frozen = time.monotonic()
        a_stops = a._act_until
        b_starts = await until(lambda: b.is_leader, timeout=3)
        assert b_starts - frozen <= FAST.lease_s + 1.0
        assert a_stops <= b_starts, "the old leader could still act when the new one started"
        assert not a.is_leader
    finally:
        stop_a.set()
        stop_b.set()
        await asyncio.wait_for(asyncio.gather(ta, tb, return_exceptions=True), 5)


async def test_resign_hands_over_at_once(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    slow = LeaseSettings(lease_s=30.0, renew_every_s=0.1)
    a, b = LeaderElection(kv, "a", slow), LeaderElection(kv, "b", slow)
    stop = asyncio.Event()
    ta = asyncio.create_task(a.campaign(stop))
    await until(lambda: a.is_leader)
    tb = asyncio.create_task(b.campaign(stop))
    await asyncio.sleep(0.3)
    assert not b.is_leader
    a.halt()
    await asyncio.wait_for(ta, 5)
    await a.resign()
    await until(lambda: b.is_leader, timeout=2)  # far less than the 30 s lease
    stop.set()
    await asyncio.gather(tb, return_exceptions=True)


async def test_deposed_when_someone_else_took_the_lease(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    events: list[str] = []
    a = LeaderElection(kv, "a", FAST, on_elected=lambda: events.append("up"), on_deposed=lambda: events.append("down"))
    assert await a._try_acquire()
    await kv.put(FAST.key, b'{"v":1,"holder":"intruder","renewed_at":1e12,"lease_s":1}')  # an operator's hand edit
    assert not await a._renew()
    assert events == ["up", "down"] and not a.is_leader


async def test_a_renewal_that_landed_unheard_does_not_depose(nc: Client) -> None:
    """The broker applied a renewal whose answer timed out: the next compare-and-set fails, yet the lease is
    still ours. Keep it (on the old term) instead of reporting a rival that does not exist."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    a = LeaderElection(kv, "a", FAST)
    assert await a._try_acquire()
    act_until = a._act_until
    await kv.put(FAST.key, a._encode())  # the renewal we never heard back from
    assert await a._renew() and a.is_leader
    assert a._act_until == act_until  # no longer term than we can prove
    assert await a._renew() and a._act_until > act_until  # and the next renewal works as usual
