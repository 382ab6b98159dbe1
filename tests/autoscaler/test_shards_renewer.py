"""Shard leases renewed on a thread of their own (`autoscaler.shards.renewer`): a loop kept busy longer than the
lease loses no shard and its replica record stays fresh, and each renewal reports its slack (what was left of the
term when it was answered). The leader lease of the holder of shard 0 (`CompatLeader`) is kept there too, and a
resign stops its keeper before the lease is read back.

The busy loop is a handler that computes without yielding (a CPU loop, holding the GIL but for the interpreter's
switch interval), longer than the whole lease. On the daemon's loop the renewals waited behind it and every shard
was lost (the second test shows it, and is what these tests fail with when the keepers run on the loop)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.shards.leader import LeaseSettings
from autoscaler.shards.leases import ShardLeases, ShardSettings
from autoscaler.shards.renewer import LeaseRenewer
from tests.autoscaler.test_autoscaler import running_autoscaler
from tests.helpers import wait_for
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import LeaderLease, ReplicaRecord
from warmpool.registry import ensure_buckets

SETTINGS = ShardSettings(lease_s=1.0, renew_every_s=0.25)  # the fence at 0.8 s
SHARDS = 4
BUSY_S = 1.5
"""Longer than the lease: a renewal waiting for the loop this long is past the fence and the lease's end."""


def _busy(seconds: float) -> None:
    """A handler that computes without yielding to the loop."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1


def _blocking(seconds: float) -> None:
    """A handler that blocks the loop in a call that lets other threads run (a sleep, a lock, a synchronous I/O)."""
    time.sleep(seconds)


@contextlib.asynccontextmanager
async def _campaigning(
    kv: KeyValue, renewer: LeaseRenewer | None, settings: ShardSettings = SETTINGS
) -> AsyncIterator[tuple[ShardLeases, list[int], list[float]]]:
    lost: list[int] = []
    slack: list[float] = []
    leases = ShardLeases(
        kv, "busy", settings, shards=SHARDS, on_lost=lost.append, on_slack=slack.append, renewer=renewer
    )
    stop = asyncio.Event()
    campaign = asyncio.create_task(leases.campaign(stop))
    try:
        await wait_for(lambda: leases.held() == frozenset(range(SHARDS)), 5, "every shard taken")
        await asyncio.sleep(settings.renew_every_s * 2)  # a renewal or two heard
        yield leases, lost, slack
    finally:
        stop.set()
        await asyncio.wait_for(campaign, 5)
        await leases.resign()


async def _renewed_at(kv: KeyValue) -> list[float]:
    out = []
    for s in range(SHARDS):
        entry = await kv.get(protocol.shard_key(s))
        out.append(protocol.decode(entry.value or b"", LeaderLease).renewed_at)
    return out


async def test_leases_are_renewed_while_the_loop_is_busy_for_longer_than_the_lease(
    nats_server: NatsServer, nc: Client
) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    renewer = LeaseRenewer(connect.NatsOptions(servers=(nats_server.url,), name="test"), kv_timeout_s=0.5)
    await renewer.start()
    try:
        async with _campaigning(kv, renewer) as (leases, lost, slack):
            assert slack and all(0 < s <= SETTINGS.lease_s * SETTINGS.stop_fraction for s in slack), slack
            began = time.time()
            _busy(BUSY_S)
            assert all(leases.owns(s) for s in range(SHARDS)), "a shard was fenced off while the loop was busy"
            assert lost == []
            stamped = await _renewed_at(kv)
            assert all(at > began + BUSY_S - SETTINGS.lease_s / 2 for at in stamped), (began, stamped)
            # The replica record too: the others must not think it gone and move its shards meanwhile.
            entry = await kv.get(protocol.replica_key("busy"))
            record = protocol.decode(entry.value or b"", ReplicaRecord)
            assert record.renewed_at > began + BUSY_S - SETTINGS.lease_s / 2, (began, record)
            assert record.shards == list(range(SHARDS)), record
    finally:
        await renewer.close()
    assert not renewer.running


LOST_AFTER = ShardSettings(lease_s=1.0, renew_every_s=0.25, main_lost_after_s=1.5)
WEDGED_S = 3.5
"""Longer than `LOST_AFTER.main_lost_after_s` plus the lease: a loop this long without a turn is wedged."""


async def test_a_loop_wedged_past_main_lost_after_stops_the_renewals_and_the_shards_lapse(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """The renewer keeps a busy loop's shards (above), but not a wedged one's: once the daemon's loop has had no turn
    for `main_lost_after_s` the renewals stop, the leases and the replica record lapse, and another replica can take
    the shards (before, they were renewed for as long as the thread lived: the models decided by no one)."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    renewer = LeaseRenewer(connect.NatsOptions(servers=(nats_server.url,), name="test"), kv_timeout_s=0.5)
    await renewer.start()
    try:
        async with _campaigning(kv, renewer, LOST_AFTER) as (_, lost, slack):
            count = len(slack)
            began = time.monotonic()
            _busy(WEDGED_S)
            ended = time.monotonic()
            # `slack` grew on the renewer's thread while this one computed: how many renewals, and none late.
            heard = len(slack) - count
            # Its terms ended while it was wedged: on its first rounds back it finds it acts for none of them.
            await wait_for(lambda: sorted(lost) == list(range(SHARDS)), 3, "every term found ended")
            # Renewed for main_lost_after_s (four shards, four times a second), then not: far fewer than the
            # whole wedge's worth of renewals.
            per_s = SHARDS / LOST_AFTER.renew_every_s
            assert heard <= per_s * (LOST_AFTER.main_lost_after_s + 0.5), (heard, ended - began)

        assert any("no longer renewed" in r.getMessage() for r in caplog.records)
    finally:
        await renewer.close()


async def test_a_main_connection_down_past_main_lost_after_stops_the_renewals(
    nats_server: NatsServer, nc: Client
) -> None:
    """The loop turns but the daemon cannot act (`main_ok` false: its own NATS connection is down): the renewals'
    connection must not keep its shards for it."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    up = [True]
    renewer = LeaseRenewer(
        connect.NatsOptions(servers=(nats_server.url,), name="test"), kv_timeout_s=0.5, main_ok=lambda: up[0]
    )
    await renewer.start()
    try:
        async with _campaigning(kv, renewer, LOST_AFTER) as (_, lost, _):
            await asyncio.sleep(LOST_AFTER.main_lost_after_s + 0.5)
            assert lost == [], "a loop that turns with its connection up keeps every shard"
            up[0] = False
            await wait_for(lambda: sorted(lost) == list(range(SHARDS)), 10, "every term to end")
            assert renewer.main_stalled_s() > LOST_AFTER.main_lost_after_s
    finally:
        await renewer.close()


def test_main_lost_after_may_not_be_shorter_than_the_lease() -> None:
    with pytest.raises(ValueError, match="main_lost_after_s"):
        ShardSettings(lease_s=2.0, main_lost_after_s=1.0)


async def test_on_the_loop_the_same_busy_handler_costs_every_lease(nc: Client) -> None:
    """The same without a renewer: what the thread is for (and what the first test fails with without it)."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    async with _campaigning(kv, None) as (leases, lost, _):
        _busy(BUSY_S)
        assert not any(leases.owns(s) for s in range(SHARDS))
        assert sorted(lost) == list(range(SHARDS))


async def test_the_daemon_keeps_its_shards_through_a_busy_handler_and_reports_the_slack(
    nats_server: NatsServer, nc: Client
) -> None:
    async with running_autoscaler(nats_server.url, lease=LeaseSettings(lease_s=1.0, renew_every_s=0.25)) as scaler:
        await asyncio.sleep(0.6)
        get = scaler.metrics.registry.get_sample_value
        assert (get("pulsescale_lease_renewal_slack_seconds_count") or 0) > 0
        _busy(BUSY_S)
        await asyncio.sleep(0)
        assert scaler.fleet.shards is not None
        assert scaler.fleet.shards.held() == frozenset(range(protocol.SHARDS))
        assert get("pulsescale_lease_lost_total") == 0


# --- the leader lease of the holder of shard 0 (`CompatLeader`): renewed on the renewer's thread too ------------


@contextlib.asynccontextmanager
async def _renewing(nats_server: NatsServer) -> AsyncIterator[LeaseRenewer]:
    renewer = LeaseRenewer(connect.NatsOptions(servers=(nats_server.url,), name="test"), kv_timeout_s=0.5)
    await renewer.start()
    try:
        yield renewer
    finally:
        await renewer.close()


def _leads(leases: ShardLeases) -> bool:
    """Holds the leader lease, its renewals handed to a keeper on the renewer's thread."""
    compat = leases._compat
    return compat.leader is not None and compat.leader.is_leader and compat.kept()


async def _leader_lease(kv: KeyValue) -> tuple[LeaderLease, int]:
    entry = await kv.get(protocol.LEADER_LEASE_KEY)
    return protocol.decode(entry.value or b"", LeaderLease), entry.revision or 0


def _depositions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "no longer the leader" in r.getMessage()]


async def test_the_leader_lease_is_kept_while_the_loop_is_blocked_for_longer_than_its_fence(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Renewed on the daemon's loop, the leader lease was lost to a blocked loop and taken again, up to 45 times a
    run (`bench decide --models 3000 --replicas 3`), while the shard leases were kept on the renewer's thread. Its
    renewals are a keeper's there now: the same term (no take, no deposition) renewed all through the block."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    async with _renewing(nats_server) as renewer, _campaigning(kv, renewer) as (leases, lost, _):
        await wait_for(lambda: _leads(leases), 5, "the leader lease held and kept on the renewer's thread")
        compat = leases._compat
        leader, gen = compat.leader, compat._gen
        began = time.time()
        _blocking(BUSY_S)  # past the fence (0.8 s) and the whole lease
        assert leader is not None and leader.is_leader, "the leader lease was fenced off while the loop was blocked"
        lease, _ = await _leader_lease(kv)
        assert lease.holder == "busy" and lease.renewed_at > began + BUSY_S - SETTINGS.lease_s / 2, (began, lease)
        await asyncio.sleep(SETTINGS.renew_every_s * 2)  # the loop's own rounds again
        assert compat.leader is leader and leader.is_leader
        assert compat._gen == gen, "the leader lease was taken again"

        async def ours() -> bool:  # the key's latest revision is our term's: written by its renewals alone
            now_held, revision = await _leader_lease(kv)
            return now_held.holder == "busy" and leader._revision == revision

        await wait_for(ours, 2, "the leader key's latest revision our term's")
        assert _depositions(caplog) == []
        assert lost == []


async def test_a_resign_stops_the_keeper_before_its_read_back_and_the_leader_key_stays_deleted(
    nats_server: NatsServer, nc: Client
) -> None:
    """A resign (shard 0 handed over, or a shutdown) stops the keeper on the renewer's loop before reading the
    lease back: a renewal landing between the read-back and the delete would keep the lease from the next holder
    until it lapsed. Resigned at several points of a tick (the keepers renew on the ticks), the key is deleted
    each time and no renewal lands after; each take after gets a keeper of its own."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    async with _renewing(nats_server) as renewer, _campaigning(kv, renewer) as (leases, _, _):
        compat, terms = leases._compat, leases._terms
        keepers: list[object] = []
        for phase in (0.0, 0.001, 0.003, 0.01, 0.1):
            await wait_for(lambda: _leads(leases) and compat._keeper_task is not None, 5, "the leader lease kept")
            keeper = compat._keeper_task
            assert keeper is not None and keeper not in keepers, "a take without a keeper of its own"
            keepers.append(keeper)
            await asyncio.sleep(max(0.0, terms._next_tick(time.monotonic()) - time.monotonic()) + phase)
            compat.due = lambda: False  # type: ignore[method-assign]  # no take again while we look
            try:
                await compat.resign()
                assert keeper.done() and compat.leader is None
                for _ in range(3):  # past the next tick, when the keeper would have renewed
                    with pytest.raises(nats.js.errors.KeyNotFoundError):
                        await kv.get(protocol.LEADER_LEASE_KEY)
                    await asyncio.sleep(SETTINGS.renew_every_s / 2)
            finally:
                del compat.due  # the moves take it again


async def test_a_keeper_that_finds_the_leader_lease_taken_ends_and_a_fresh_take_gets_a_fresh_one(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Another replica holds the lease (a replica of ours, with a record: no older version leads, no shard moves):
    the keeper's renewal finds it, the term ends on the daemon's loop, and the keeper ends by itself. Once that
    lease lapses the holder of shard 0 takes it again, with a new keeper."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    async with _renewing(nats_server) as renewer, _campaigning(kv, renewer) as (leases, lost, _):
        compat = leases._compat
        await wait_for(lambda: _leads(leases) and compat._keeper_task is not None, 5, "the leader lease kept")
        keeper, leader = compat._keeper_task, compat.leader
        assert keeper is not None and leader is not None
        now = time.time()
        record = ReplicaRecord(
            identity="other", renewed_at=now - 2, lease_s=SETTINGS.lease_s, started_at=now - 10, shards=[], models=0
        )
        await kv.put(protocol.replica_key("other"), protocol.encode(record))
        await kv.put(
            protocol.LEADER_LEASE_KEY,
            protocol.encode(LeaderLease(holder="other", renewed_at=now, lease_s=SETTINGS.lease_s)),
        )
        await wait_for(lambda: keeper.done() and not leader.is_leader, 2, "the keeper ended, the term with it")
        assert not keeper.cancelled(), "the keeper was stopped, not ended by itself"
        assert any("another replica holds the lease" in m for m in _depositions(caplog)), _depositions(caplog)
        await wait_for(
            lambda: _leads(leases) and compat._keeper_task not in (None, keeper), 5, "taken again once lapsed"
        )
        lease, _ = await _leader_lease(kv)
        assert lease.holder == "busy"
        assert lost == []
