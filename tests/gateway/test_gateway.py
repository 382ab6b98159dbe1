"""The reference gateway against a real nats-server, the real `pulse_slots` bucket and real HTTP upstreams: the queue
bound (429), the wait bound (504), a slot leaving mid-request, a stream cut after its first bytes, least-loaded
routing, and the contract's queue samples; the queue and the sample schedule as pure tables."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import pytest
from nats.aio.client import Client

from gateway.proxy import Gateway, GatewaySettings
from gateway.publisher import Schedule
from gateway.queue import ModelQueue
from gateway.routes import endpoint_ok, ready_endpoints
from tests.gateway_helpers import MODEL, Upstream, running_gateway, samples_of, set_slot, upstreams
from tests.helpers import wait_for
from warmpool.connect import NatsOptions
from warmpool.embedded import NatsServer, free_port
from warmpool.protocol import SlotRecord
from warmpool.registry import KvSlotStore

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 3}


def routed(gw: Gateway) -> int:
    """Ready endpoints the gateway routes `MODEL` to."""
    q = gw.queues.get(MODEL)
    return 0 if q is None else len(q.endpoints)


async def post(session: aiohttp.ClientSession, port: int, body: object = COMPLETION, path: str = "/v1/completions"):  # type: ignore[no-untyped-def]
    async with session.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


# --- pure: the queue and the sample schedule ---------------------------------------------------------------------


def test_queue_is_fifo_bounded_and_accounts_for_every_request() -> None:
    q: ModelQueue[str] = ModelQueue("m", limit=2, concurrency=1)
    a, b, c = (q.arrive(x, 0.0, 1.0) for x in "abc")
    assert a is not None and b is not None and c is None  # no endpoint: two wait, the third is refused
    q.set_endpoint("m.n1.s0", "http://h:1")
    assert [w.item for w in q.dispatch()] == ["a"]  # head first, one per endpoint
    assert q.give_up(b, "timeout") and not q.give_up(b, "timeout")
    q.finish(a, "completed")
    assert q.dispatch() == []
    n = q.counts()
    assert (n.arrivals_total, n.completions_total, n.timeouts_total, n.rejected_total) == (3, 1, 1, 1)
    assert n.arrivals_total == (
        n.queue_depth + n.inflight + n.completions_total + n.timeouts_total + n.rejected_total + n.failed_total
    )


def test_queue_retry_goes_to_the_head_and_avoids_the_broken_endpoint() -> None:
    q: ModelQueue[str] = ModelQueue("m", limit=10, concurrency=1)
    q.set_endpoint("m.n1.s0", "http://a:1")
    q.set_endpoint("m.n2.s0", "http://b:1")
    first = q.arrive("first", 0.0, 1.0)
    assert first is not None and [w.endpoint.key for w in q.dispatch() if w.endpoint] == ["m.n1.s0"]
    second = q.arrive("second", 0.0, 1.0)
    assert second is not None and q.dispatch() == [second] and second.endpoint is not None
    assert second.endpoint.key == "m.n2.s0"
    q.finish(second, "completed")
    q.retry(first)  # n1 broke: first goes back ahead of anything that waits, and to n2
    later = q.arrive("later", 0.0, 1.0)
    assert later is not None
    assert [(w.item, w.endpoint.key) for w in q.dispatch() if w.endpoint] == [
        ("first", "m.n2.s0"),
        ("later", "m.n1.s0"),
    ]


def test_queue_least_loaded_and_a_free_endpoint_beats_a_zero_limit() -> None:
    q: ModelQueue[int] = ModelQueue("m", limit=0, concurrency=3)
    q.set_endpoint("m.n1.s0", "http://a:1")
    q.set_endpoint("m.n2.s0", "http://b:1")
    got = []
    for i in range(6):
        w = q.arrive(i, 0.0, 1.0)
        assert w is not None, f"request {i} refused while an endpoint had room"
        got += [x.endpoint.key for x in q.dispatch() if x.endpoint]
    assert got == ["m.n1.s0", "m.n2.s0"] * 3
    assert q.arrive(6, 0.0, 1.0) is None  # both full, limit 0: refused


@pytest.mark.parametrize(
    ("last_at", "dirty", "due"),
    [
        (None, True, float("-inf")),  # the first sample: at once
        (10.0, False, 10.1),  # idle: the period
        (10.0, True, 10.01),  # a change: after the minimum gap, not the period
    ],
)
def test_sample_schedule(last_at: float | None, dirty: bool, due: float) -> None:
    s = Schedule(every_s=0.1, min_gap_s=0.01, last_at=last_at, dirty=dirty)
    assert s.due_at() == pytest.approx(due)


def test_routes_table_and_endpoint_check() -> None:
    recs = [
        SlotRecord(model="a", node="n1", slot="s0", state="ready", endpoint="http://10.0.0.1:8000"),
        SlotRecord(model="a", node="n2", slot="s0", state="warm", endpoint="http://10.0.0.2:8000"),
        SlotRecord(model="a", node="n3", slot="s0", state="ready", endpoint="file:///etc/passwd"),
        SlotRecord(model="b", node="n1", slot="s1", state="ready", endpoint="http://10.0.0.1:8001/"),
    ]
    assert ready_endpoints(recs, None) == {
        "a": {"a.n1.s0": "http://10.0.0.1:8000"},
        "b": {"b.n1.s1": "http://10.0.0.1:8001"},
    }
    assert ready_endpoints(recs, frozenset({"b"})) == {"b": {"b.n1.s1": "http://10.0.0.1:8001"}}
    for bad in ("http://u:p@h:1", "http://h:1/x", "http://h:99999", "ftp://h", "http://h:1?q=1"):
        assert not endpoint_ok(bad), bad


# --- against nats-server, the registry and real upstreams --------------------------------------------------------


async def test_queue_bound_gives_429_and_the_queue_drains(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("a", holding=True)) as (a,), samples_of(nc) as samples:
        await set_slot(store, "n1", "ready", a.url)
        async with (
            running_gateway(nc, nats_server.url, queue_limit=2, endpoint_concurrency=1) as gw,
            aiohttp.ClientSession() as s,
        ):
            await wait_for(lambda: routed(gw) == 1, what="the ready slot routed")
            held = [asyncio.create_task(post(s, gw.port)) for _ in range(3)]  # 1 at the upstream, 2 waiting
            await wait_for(lambda: gw.queues[MODEL].depth == 2 and a.received == 1, what="1 in flight, 2 waiting")
            status, body, headers = await post(s, gw.port)
            assert status == 429
            assert body["error"]["code"] == "queue_full" and "2 requests" in body["error"]["message"]
            assert headers["Retry-After"] == "1"
            a.hold.set()
            assert [(await t)[0] for t in held] == [200, 200, 200]
            await wait_for(lambda: samples.last is not None and samples.last.completions_total == 3, what="3 done")
            last = samples.last
            assert last is not None
            assert (last.arrivals_total, last.queue_depth, last.inflight, last.timeouts_total) == (4, 0, 0, 0)
            assert gw.metrics.responses.labels(MODEL, "429")._value.get() == 1


async def test_every_listed_model_is_served_however_many_are_listed(nc: Client) -> None:
    """A list given with --models is served whole, from the start, and nothing else is."""
    listed = frozenset(f"m{i}" for i in range(70))
    gw = Gateway(GatewaySettings(nats=NatsOptions(), port=0, models=listed), nc)
    assert set(gw.queues) == listed
    assert gw.catalog.verdict("m69", ready=False) == "known"
    assert gw.catalog.verdict("unlisted", ready=True) == "unknown"


async def test_waiting_past_the_timeout_is_504(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    async with (
        samples_of(nc) as samples,
        running_gateway(nc, nats_server.url, timeout_s=0.3) as gw,
        aiohttp.ClientSession() as s,
    ):
        status, body, _ = await post(s, gw.port)
        assert status == 504 and body["error"]["code"] == "timeout"
        await wait_for(lambda: samples.last is not None and samples.last.timeouts_total == 1, what="the 504 counted")
        assert samples.last is not None and samples.last.queue_depth == 0
        assert gw.metrics.responses.labels(MODEL, "504")._value.get() == 1


async def test_a_queued_request_is_served_when_a_slot_becomes_ready(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with (
        upstreams(Upstream("a")) as (a,),
        samples_of(nc) as samples,
        running_gateway(nc, nats_server.url, timeout_s=20) as gw,
        aiohttp.ClientSession() as s,
    ):
        waiting = asyncio.create_task(post(s, gw.port, path=f"/{MODEL}/v1/completions", body={"prompt": "x"}))
        await wait_for(lambda: samples.last is not None and samples.last.queue_depth == 1, what="queued")
        await set_slot(store, "n1", "ready", a.url)
        status, body, _ = await waiting
        assert status == 200 and body["upstream"] == "a"
        await wait_for(lambda: samples.last is not None and samples.last.completions_total == 1, what="done")


async def test_a_slot_leaving_ready_mid_request_moves_the_request(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("a", holding=True), Upstream("b")) as (a, b):
        key_a = await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url) as gw, aiohttp.ClientSession() as s:
            await wait_for(lambda: routed(gw) == 1, what="slot a routed")
            req = asyncio.create_task(post(s, gw.port))
            await wait_for(lambda: a.received == 1, what="the request at a")
            await set_slot(store, "n2", "ready", b.url)
            await wait_for(lambda: routed(gw) == 2, what="slot b routed")
            await store.set_state(key_a, "releasing")  # a leaves ready while its engine still holds the request
            status, body, _ = await req
            assert status == 200 and body["upstream"] == "b"
            assert a.answered == 0
            assert gw.metrics.retries.labels(MODEL)._value.get() == 1
            assert list(gw.queues[MODEL].endpoints) == [f"{MODEL}.n2.s0"]


async def test_a_refused_connection_is_retried_on_another_slot(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("b")) as (b,):
        await set_slot(store, "n1", "ready", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        await set_slot(store, "n2", "ready", b.url)
        async with running_gateway(nc, nats_server.url) as gw, aiohttp.ClientSession() as s:
            await wait_for(lambda: routed(gw) == 2, what="both routed")
            status, body, _ = await post(s, gw.port)  # n1 first (same load, key order), refused, then n2
            assert status == 200 and body["upstream"] == "b"
            assert gw.metrics.retries.labels(MODEL)._value.get() == 1


async def test_every_upstream_broken_is_502(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    await set_slot(store, "n1", "ready", f"http://127.0.0.1:{free_port()}")
    async with running_gateway(nc, nats_server.url, max_attempts=2) as gw, aiohttp.ClientSession() as s:
        await wait_for(lambda: routed(gw) == 1, what="routed")
        status, body, _ = await post(s, gw.port)
        assert (
            status == 502 and body["error"]["code"] == "upstream_failed" and "2 upstream(s)" in body["error"]["message"]
        )
        assert gw.queues[MODEL].failed_total == 1


async def test_a_stream_cut_after_its_first_bytes_is_not_retried(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("a", mode="stream", break_stream=True), Upstream("b", mode="stream")) as (a, b):
        await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url) as gw, aiohttp.ClientSession() as s:
            await wait_for(lambda: routed(gw) == 1, what="routed")
            await set_slot(store, "n2", "ready", b.url)
            await wait_for(lambda: routed(gw) == 2, what="both routed")
            got: list[bytes] = []

            async def read_stream() -> None:
                url = f"http://127.0.0.1:{gw.port}/v1/completions"
                async with s.post(url, json={**COMPLETION, "stream": True}) as r:
                    assert r.status == 200
                    async for chunk in r.content.iter_any():
                        got.append(chunk)

            with pytest.raises(aiohttp.ClientPayloadError):
                await read_stream()
            assert b"".join(got) == b"data: first\n\n"
            assert b.received == 0  # the client had bytes: no second upstream
            assert gw.metrics.broken_streams.labels(MODEL)._value.get() == 1
            # A whole stream passes through.
            gw.queues[MODEL].remove_endpoint(f"{MODEL}.n1.s0")
            async with s.post(f"http://127.0.0.1:{gw.port}/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                assert await r.read() == b"data: first\n\ndata: [DONE]\n\n"


async def test_least_loaded_routing(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    async with upstreams(Upstream("a", holding=True), Upstream("b", holding=True)) as (a, b):
        await set_slot(store, "n1", "ready", a.url)
        await set_slot(store, "n2", "ready", b.url)
        async with running_gateway(nc, nats_server.url, endpoint_concurrency=4) as gw, aiohttp.ClientSession() as s:
            await wait_for(lambda: routed(gw) == 2, what="both routed")
            first = [asyncio.create_task(post(s, gw.port)) for _ in range(4)]
            await wait_for(lambda: a.received + b.received == 4, what="4 requests at the upstreams")
            assert (a.received, b.received) == (2, 2)
            a.hold.set()
            await wait_for(lambda: a.answered == 2 and gw.queues[MODEL].inflight == 2, what="a's two done")
            more = [asyncio.create_task(post(s, gw.port)) for _ in range(2)]
            for t in more:
                status, body, _ = await t
                assert (status, body["upstream"]) == (200, "a")  # a has 0 in flight, b has 2: both go to a
            assert b.received == 2
            b.hold.set()
            assert sorted([(await t)[1]["upstream"] for t in first]) == ["a", "a", "b", "b"]


async def test_samples_every_100ms_when_idle_and_the_books_balance(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with upstreams(Upstream("a")) as (a,), samples_of(nc) as samples:
        await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url, models=frozenset({MODEL})) as gw, aiohttp.ClientSession() as s:
            await wait_for(lambda: len(samples.got) >= 12, what="a second of idle samples")
            gaps = sorted(b - a for a, b in zip(samples.received_at[1:], samples.received_at[2:], strict=False))
            assert 0.08 <= gaps[len(gaps) // 2] <= 0.15, gaps  # the period, as received (scheduling may add jitter)
            results = await asyncio.gather(*(post(s, gw.port) for _ in range(20)))
            assert [r[0] for r in results] == [200] * 20
            await wait_for(lambda: samples.last is not None and samples.last.completions_total == 20, what="20 done")
            last = samples.last
            assert last is not None and last.gateway == "gw-test" and last.arrivals_total == 20
            assert gw.publisher.published_total >= len(samples.got)


async def test_bad_requests_health_and_metrics(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    async with running_gateway(nc, nats_server.url, models=frozenset({MODEL})) as gw, aiohttp.ClientSession() as s:
        base = f"http://127.0.0.1:{gw.port}"
        assert (await post(s, gw.port, {"model": "other", "prompt": "x"}))[0] == 404
        assert (await post(s, gw.port, {"prompt": "x"}))[0] == 400
        assert (await post(s, gw.port, {"model": "Bad.Name"}))[0] == 400
        status, body, _ = await post(s, gw.port, {"model": "other"}, path=f"/{MODEL}/v1/completions")
        assert status == 400 and "path names model" in body["error"]["message"]
        async with s.post(f"{base}/v1/completions", data=b"not json") as r:
            assert r.status == 400
        async with s.get(f"{base}/healthz") as r:
            health = await r.json()
            assert r.status == 200 and health["slots_listed"] and health["models"][MODEL]["ready"] == 0
        async with s.get(f"{base}/metrics") as r:
            text = await r.text()
            assert 'pulsescale_gateway_samples_published_total{model="tiny"}' in text


async def test_pulsescale_gateway_command(nats_server: NatsServer, store: KvSlotStore) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "pulsescale", "gateway", "--nats", nats_server.url, "--listen", f"127.0.0.1:{port}",
          "--models", MODEL, "--log-level", "WARNING"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as s:

            async def healthy() -> bool:
                try:
                    async with s.get(f"http://127.0.0.1:{port}/healthz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for(healthy, 20, "the gateway process healthy")
            status, body, _ = await post(s, port, {"model": "nope"})
            assert status == 404 and body["error"]["code"] == "unknown_model"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
