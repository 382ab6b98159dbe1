"""Shard leases renewed on a thread of their own (`autoscaler.shards.renewer`): a loop kept busy longer than the
lease loses no shard and its replica record stays fresh, and each renewal reports its slack (what was left of the
term when it was answered).

The busy loop is a handler that computes without yielding (a CPU loop, holding the GIL but for the interpreter's
switch interval), longer than the whole lease. On the daemon's loop the renewals waited behind it and every shard
was lost (the second test shows it, and is what these tests fail with when the keepers run on the loop)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

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


@contextlib.asynccontextmanager
async def _campaigning(
    kv: KeyValue, renewer: LeaseRenewer | None
) -> AsyncIterator[tuple[ShardLeases, list[int], list[float]]]:
    lost: list[int] = []
    slack: list[float] = []
    leases = ShardLeases(
        kv, "busy", SETTINGS, shards=SHARDS, on_lost=lost.append, on_slack=slack.append, renewer=renewer
    )
    stop = asyncio.Event()
    campaign = asyncio.create_task(leases.campaign(stop))
    try:
        await wait_for(lambda: leases.held() == frozenset(range(SHARDS)), 5, "every shard taken")
        await asyncio.sleep(SETTINGS.renew_every_s * 2)  # a renewal or two heard
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
