"""`warmpool.buckets.follow_bucket` (and `follow_view` on it): a bucket that does not exist yet, or does not
answer, is asked for again and followed once it opens (the gateway's `pulse_scalers` and `pulse_assignments`),
against a real nats-server."""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client
from nats.js.kv import KeyValue

from tests.helpers import wait_for
from warmpool import buckets, protocol
from warmpool.bucketview import BucketView, Changed, Snapshot
from warmpool.embedded import NatsServer
from warmpool.protocol import NodeAssignment
from warmpool.rejects import Rejections

BUCKET = "pytest_follow"


async def test_absent_then_created_is_followed(nc: Client) -> None:
    states: list[tuple[str, str]] = []
    followed: list[bytes | None] = []

    async def follow(kv: KeyValue) -> None:
        followed.append((await kv.get("k")).value)

    task = asyncio.create_task(
        buckets.follow_bucket(
            nc,
            BUCKET,
            asyncio.Event(),
            on_state=lambda state, why: states.append((state, why)),
            follow=follow,
            retry_s=0.05,
            open_timeout_s=2.0,
        )
    )
    await wait_for(lambda: states, what="the bucket reported absent")
    kv = await nc.jetstream().create_key_value(bucket=BUCKET)
    await kv.put("k", b"v")
    await asyncio.wait_for(task, 10)  # returns once `follow` does
    assert followed == [b"v"]
    assert set(states) == {("absent", "")}


async def test_unreadable_while_nats_is_away_then_followed(nats_server: NatsServer, nc: Client) -> None:
    states: list[tuple[str, str]] = []
    followed = asyncio.Event()

    async def follow(kv: KeyValue) -> None:
        followed.set()

    nats_server.kill()
    task = asyncio.create_task(
        buckets.follow_bucket(
            nc,
            BUCKET,
            asyncio.Event(),
            on_state=lambda state, why: states.append((state, why)),
            follow=follow,
            retry_s=0.05,
            open_timeout_s=0.2,
            max_wait_s=0.1,
        )
    )
    await wait_for(lambda: len(states) >= 2, what="the bucket reported unreadable twice")
    assert all(state == "unreadable" and why for state, why in states), states
    nats_server.restart()
    await wait_for(lambda: nc.is_connected, what="the client reconnected")
    await nc.jetstream().create_key_value(bucket=BUCKET)
    await asyncio.wait_for(task, 10)
    assert followed.is_set()


async def test_stop_ends_the_pause(nc: Client) -> None:
    stop = asyncio.Event()
    states: list[tuple[str, str]] = []

    async def follow(kv: KeyValue) -> None:
        raise AssertionError("the bucket does not exist")

    task = asyncio.create_task(
        buckets.follow_bucket(
            nc,
            BUCKET,
            stop,
            on_state=lambda state, why: states.append((state, why)),
            follow=follow,
            retry_s=3600.0,
            open_timeout_s=2.0,
        )
    )
    await wait_for(lambda: states, what="the bucket reported absent")
    stop.set()
    await asyncio.wait_for(task, 5)
    assert states == [("absent", "")]


async def test_follow_view_hands_each_event_of_the_records_view_and_closes_it(nc: Client) -> None:
    """`follow_view`: the view is handed over once made, then its snapshot and each change; at `stop` the view is
    closed and its watch ended."""
    kv = await nc.jetstream().create_key_value(bucket=BUCKET)
    await kv.put("n1", protocol.encode(NodeAssignment(node="n1", models=["m"])))
    stop = asyncio.Event()
    views: list[BucketView[NodeAssignment]] = []
    events: list[object] = []
    task = asyncio.create_task(
        buckets.follow_view(
            nc, BUCKET, NodeAssignment, Rejections(logging.getLogger("test")), stop,
            on_state=lambda state, why: None, on_view=views.append,
            on_event=lambda view, event: events.append(event), name="test-view", retry_s=0.05, open_timeout_s=2.0,
        )
    )  # fmt: skip
    await wait_for(lambda: events, what="the first event")
    assert len(views) == 1 and isinstance(events[0], Snapshot)
    assert [a.models for a in events[0].records.values()] == [["m"]]
    await kv.put("n2", protocol.encode(NodeAssignment(node="n2", models=["q"])))
    await wait_for(lambda: any(isinstance(e, Changed) for e in events), what="the change")
    changed = next(e for e in events if isinstance(e, Changed))
    assert changed.key == "n2" and changed.record.models == ["q"]
    stop.set()
    await kv.put("n3", protocol.encode(NodeAssignment(node="n3")))  # an event, so the loop sees `stop`
    await asyncio.wait_for(task, 5)
    assert views[0].closed
