"""A `BucketView` whose own loop is starved: a probe that finds the consumer ahead of a view whose loop was blocked
does not re-list (before: 3 re-lists in 3 rounds); a lost consumer still does; a needed re-list does not decode or
index again what did not change (before: every record).

Real nats-server, real blocking of the event loop (`time.sleep` on it, as a process off the CPU is): the 3,000-model
bench's replicas re-listed all five of their watches 11-20 times a run on a loaded machine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from nats.aio.client import Client

from tests.helpers import wait_for
from tests.warmpool.test_registry import Deafened
from warmpool import bucketview, connect, protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import AgentLease
from warmpool.registry import BucketView, Snapshot, ensure_buckets
from warmpool.rejects import Rejections


async def _starve(until: float, stall_s: float) -> None:
    """Block the loop `stall_s` at a time, letting it run 5 ms between, until `until` (monotonic)."""
    while time.monotonic() < until:
        time.sleep(stall_s)  # noqa: ASYNC251 - the point: the loop blocked, as a process not scheduled
        await asyncio.sleep(0.005)


def _view(nc: Client, kv: object) -> BucketView[AgentLease]:
    return BucketView(nc, kv, AgentLease, Rejections(logging.getLogger("test")))  # type: ignore[arg-type]


def _put_from_a_thread(url: str, key: str, value: bytes, after_s: float) -> threading.Thread:
    """A writer in a thread of its own (its own loop and connection): it writes while our loop is blocked."""

    async def put() -> None:
        await asyncio.sleep(after_s)
        nc = await connect.connect(connect.NatsOptions(servers=(url,), name="writer"))
        try:
            await (await nc.jetstream().key_value(protocol.AGENTS_BUCKET)).put(key, value)
        finally:
            await nc.close()

    thread = threading.Thread(target=asyncio.run, args=(put(),))
    thread.start()
    return thread


async def test_a_write_that_came_while_the_loop_was_blocked_is_taken_not_relisted(
    nats_server: NatsServer, nc: Client
) -> None:
    """The loop blocked past `WATCH_PROBE_S` while a write was delivered: on waking, the watch looks silent and its
    probe finds the consumer ahead of the view (what it sent waits in our socket). That is a late loop, not a
    lost consumer: the write is taken without re-listing the bucket."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    first = AgentLease(node="n1", heartbeat_at=1.0, lease_s=2.0)
    await kv.put("n1", protocol.encode(first))
    view = _view(nc, kv)
    task = asyncio.create_task(view.run())
    try:
        await wait_for(lambda: view.value("n1") == first, 5, "the first snapshot")
        for round_ in range(3):
            later = AgentLease(node="n2", heartbeat_at=float(round_), lease_s=2.0)
            writer = _put_from_a_thread(nats_server.url, "n2", protocol.encode(later), after_s=0.5)
            time.sleep(bucketview.WATCH_PROBE_S + 1.0)  # noqa: ASYNC251 - the loop blocked while the write comes
            writer.join()
            await wait_for(lambda later=later: view.value("n2") == later, 10, "the write made while blocked")
            await asyncio.sleep(bucketview.WATCH_PROBE_TIMEOUT_S + 0.2)  # the probe, if any, is decided
        assert view.relists == 0
        assert view.spared["in_flight"] >= 1  # the probe found the consumer ahead, and the write came
        assert view.current()
    finally:
        view.closed = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_lost_consumer_is_still_relisted_while_the_loop_is_starved(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    first = AgentLease(node="n1", heartbeat_at=1.0, lease_s=2.0)
    await kv.put("n1", protocol.encode(first))
    deaf = Deafened(kv, "drop")
    view = _view(nc, deaf)
    task = asyncio.create_task(view.run())
    try:
        await wait_for(lambda: view.value("n1") == first, 5, "the first snapshot")
        await deaf.deafen()
        later = AgentLease(node="n2", heartbeat_at=1.0, lease_s=2.0)
        await kv.put("n2", protocol.encode(later))
        t0 = time.monotonic()
        while view.value("n2") != later and time.monotonic() - t0 < 20:
            await _starve(time.monotonic() + 0.5, stall_s=0.25)  # starved, but not past a probe's budget
        assert view.value("n2") == later, "the write made while deaf was never seen"
        assert view.relists >= 1
    finally:
        view.closed = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_relist_indexes_only_what_changed(nc: Client) -> None:
    kv = (await ensure_buckets(nc.jetstream()))[protocol.AGENTS_BUCKET]
    leases = {f"n{i}": AgentLease(node=f"n{i}", heartbeat_at=1.0, lease_s=2.0) for i in range(50)}
    for node, lease in leases.items():
        await kv.put(node, protocol.encode(lease))
    deaf = Deafened(kv, "drop")
    view = _view(nc, deaf)
    indexed: list[str] = []
    view._on_change = lambda key, _old, _new: indexed.append(key)
    events = view.subscribe()
    task = asyncio.create_task(view.run())
    try:
        await wait_for(lambda: len(view) == 50, 5, "the first snapshot")
        assert sorted(indexed) == sorted(leases)
        listed = {k: view.value(k) for k in leases}
        indexed.clear()
        await deaf.deafen()
        changed = AgentLease(node="n3", heartbeat_at=2.0, lease_s=2.0)
        await kv.put("n3", protocol.encode(changed))
        await kv.delete("n4")
        await wait_for(lambda: view.value("n3") == changed and "n4" not in view, 15, "the re-list")
        assert view.relists == 1
        assert sorted(indexed) == ["n3", "n4"]  # the other 48 are as they were: not indexed again
        assert all(view.value(k) is listed[k] for k in leases if k not in ("n3", "n4"))  # nor decoded again
        got = [events.get_nowait() for _ in range(events.qsize())]
        snapshots = [e for e in got if isinstance(e, Snapshot)]
        assert len(snapshots) == 2 and set(snapshots[-1].records) == set(leases) - {"n4"}  # still a Snapshot
    finally:
        view.closed = True
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
