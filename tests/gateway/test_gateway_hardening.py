"""The reference gateway against hostile clients (the outside security review's M1, M2 and L3), over real HTTP and raw
sockets, with a real nats-server, the real `pulse_slots` and `pulse_scalers` buckets and real upstreams:

- M1: made-up model names are 404 at once and leave nothing behind (no queue, no metric series); the models served
  come from `pulse_scalers`, ready slots or ``--models``; idle queues are reclaimed;
- M2: the bodies of requests being read or waiting share one byte budget, across models;
- L3: a connection must send its request head within the header timeout, and there is a connection cap;
- `/healthz` and `/metrics` on a listener of their own; the `pulsescale gateway` process with the new flags.

The catalog's rules as pure tables are in `test_gateway_catalog`. This module imports nothing the hardening added,
so that each test here can be run against the gateway from before it (and fails there).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client

from gateway.proxy import Gateway
from tests.gateway_helpers import (
    MODEL,
    Upstream,
    delete_scaler,
    put_scaler,
    running_gateway,
    samples_of,
    set_slot,
    upstreams,
)
from tests.helpers import wait_for
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.registry import KvSlotStore

QUICK = aiohttp.ClientTimeout(total=5)
"""A refusal is answered at once: 5 s is a generous bound that only a request left waiting runs into."""

Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def post(s: aiohttp.ClientSession, port: int, body: object, **kw: object) -> tuple[int, dict, dict[str, str]]:  # type: ignore[type-arg]
    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=QUICK, **kw) as r:  # type: ignore[arg-type]
        return r.status, await r.json(content_type=None), dict(r.headers)


async def post_bytes(s: aiohttp.ClientSession, port: int, data: object, timeout: aiohttp.ClientTimeout = QUICK):  # type: ignore[no-untyped-def]
    """`data` as the body: bytes with their Content-Length, an async iterator chunked."""
    payload = io.BytesIO(data) if isinstance(data, bytes) else data
    async with s.post(f"http://127.0.0.1:{port}/v1/completions", data=payload, timeout=timeout) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


def refused(gw: Gateway, reason: str) -> float:
    return gw.metrics.registry.get_sample_value("pulsescale_gateway_refused_total", {"reason": reason}) or 0.0


async def metrics_text(s: aiohttp.ClientSession, port: int) -> str:
    async with s.get(f"http://127.0.0.1:{port}/metrics", timeout=QUICK) as r:
        assert r.status == 200
        return await r.text()


async def listed_scalers(s: aiohttp.ClientSession, port: int) -> None:
    """Until the gateway has read `pulse_scalers`: a made-up name is then 404, not 503."""

    async def decided() -> bool:
        status, body, _ = await post(s, port, {"model": "probe", "prompt": "x"})
        assert status in (404, 503), (status, body)
        return status == 404

    await wait_for(decided, what="pulse_scalers read by the gateway")


@contextlib.asynccontextmanager
async def raw_connections(port: int, n: int) -> AsyncIterator[list[Conn]]:
    """`n` plain TCP connections to the gateway, closed at exit."""
    conns: list[Conn] = []
    try:
        for _ in range(n):
            conns.append(await asyncio.open_connection("127.0.0.1", port))
        yield conns
    finally:
        for _, w in conns:
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()


async def answer_and_close(reader: asyncio.StreamReader, timeout_s: float = 10.0) -> bytes:
    """What the gateway sends before it closes the connection (fails the test if it keeps it open)."""
    try:
        return await asyncio.wait_for(reader.read(), timeout_s)
    except ConnectionResetError:
        return b""


# --- M1: what the gateway serves, and what it keeps -------------------------------------------------------------


async def test_made_up_models_are_404_at_once_and_leave_nothing_behind(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """70 junk names (more than the old 64-model table) are refused at once, create no queue or metric series,
    and a real model that gets a ready slot afterwards is served; a ScaledObject's model queues with no slot."""
    await put_scaler(nc, "scaled")
    async with (
        upstreams(Upstream("a"), Upstream("b")) as (a, b),
        running_gateway(nc, nats_server.url, models=None, timeout_s=20) as gw,
        aiohttp.ClientSession() as s,
    ):
        await listed_scalers(s, gw.port)
        before = refused(gw, "unknown_model")
        junk = await asyncio.gather(*(post(s, gw.port, {"model": f"junk{i}", "prompt": "x"}) for i in range(70)))
        assert [status for status, _, _ in junk] == [404] * 70
        assert {body["error"]["code"] for _, body, _ in junk} == {"unknown_model"}
        assert refused(gw, "unknown_model") - before == 70
        assert not any(m.startswith("junk") for m in gw.queues)
        assert 'model="junk' not in await metrics_text(s, gw.port)

        # A model that no ScaledObject names but whose slot becomes ready: served (it was 404 until a restart).
        await set_slot(store, "n1", "ready", a.url, model="late")
        await wait_for(lambda: "late" in gw.queues and gw.queues["late"].endpoints, what="late's slot routed")
        status, body, _ = await post(s, gw.port, {"model": "late", "prompt": "x"})
        assert (status, body["upstream"]) == (200, "a")

        # The ScaledObject's model has no slot: it queues (scale from zero), and is served once one is ready.
        waiting = asyncio.create_task(post_bytes(s, gw.port, b'{"model": "scaled"}', aiohttp.ClientTimeout(20)))
        await wait_for(lambda: "scaled" in gw.queues and gw.queues["scaled"].depth == 1, what="scaled queued")
        await set_slot(store, "n2", "ready", b.url, model="scaled")
        status, body, _ = await waiting
        assert (status, body["upstream"]) == (200, "b")
        async with s.get(f"http://127.0.0.1:{gw.port}/v1/models", timeout=QUICK) as r:
            assert [m["id"] for m in (await r.json())["data"]] == ["late", "scaled"]


async def test_idle_queues_are_reclaimed_and_their_samples_stop(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    key = await put_scaler(nc, MODEL)
    async with (
        samples_of(nc) as samples,
        running_gateway(nc, nats_server.url, models=None, timeout_s=0.2, sweep_every_s=0.05, queue_idle_s=0.5) as gw,
        aiohttp.ClientSession() as s,
    ):

        async def waited() -> bool:
            status, body, _ = await post(s, gw.port, {"model": MODEL, "prompt": "x"})
            assert status in (503, 504), (status, body)  # 503 models_not_listed until pulse_scalers is read
            return status == 504  # known, no slot: it waited

        await wait_for(waited, what="a request for the ScaledObject's model timed out waiting")
        assert MODEL in gw.queues
        # Idle for queue_idle_s: reclaimed, its gauges gone, no more samples.
        await wait_for(lambda: MODEL not in gw.queues, what="the idle queue reclaimed")
        assert f'pulsescale_gateway_queue_depth{{model="{MODEL}"}}' not in await metrics_text(s, gw.port)
        sent = len(samples.got)
        await asyncio.sleep(0.5)
        assert len(samples.got) == sent
        assert gw.metrics.queues_reclaimed._value.get() == 1
    async with (
        running_gateway(nc, nats_server.url, models=None, timeout_s=20, sweep_every_s=0.05) as gw,
        aiohttp.ClientSession() as s,
    ):
        await listed_scalers(s, gw.port)
        waiting = asyncio.create_task(post(s, gw.port, {"model": MODEL, "prompt": "x"}))
        await wait_for(lambda: MODEL in gw.queues and gw.queues[MODEL].depth == 1, what="queued")
        # Its ScaledObject deleted: new requests are 404 at once; the one waiting stays, then its queue goes.
        await delete_scaler(nc, key)
        await wait_for(lambda: gw.catalog.verdict(MODEL, ready=False) == "unknown", what="the deletion seen")
        status, body, _ = await post(s, gw.port, {"model": MODEL, "prompt": "x"})
        assert (status, body["error"]["code"]) == (404, "unknown_model")
        assert gw.queues[MODEL].depth == 1
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await wait_for(lambda: MODEL not in gw.queues, what="the unknown model's queue reclaimed once idle")


# --- M2: one budget for the bodies that wait --------------------------------------------------------------------


async def test_bodies_being_read_or_waiting_share_one_budget(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    big = b'{"model": "%s", "prompt": "' % MODEL.encode()
    big += b"x" * (1_000_000 - len(big) - 2) + b'"}'
    other = big.replace(MODEL.encode(), b"othr", 1)
    async with (
        contextlib.AsyncExitStack() as stack,
        upstreams(Upstream("a")) as (a,),
        running_gateway(
            nc,
            nats_server.url,
            models=frozenset({MODEL, "othr"}),
            timeout_s=20,
            max_body_bytes=1024 * 1024,
            body_budget_bytes=2_500_000,
        ) as gw,
        aiohttp.ClientSession() as s,
    ):
        slow = aiohttp.ClientTimeout(30)
        held = [asyncio.create_task(post_bytes(s, gw.port, big, slow)) for _ in range(2)]
        stack.callback(lambda: [t.cancel() for t in held])
        await wait_for(lambda: gw.queues[MODEL].depth == 2, what="two 1 MB requests waiting")

        # Any model: the budget is the gateway's, not the queue's.
        status, body, headers = await post_bytes(s, gw.port, other)
        assert (status, body["error"]["code"], headers["Retry-After"]) == (503, "body_budget_full", "1")

        async def chunked() -> AsyncIterator[bytes]:
            for i in range(0, len(other), 64 * 1024):
                yield other[i : i + 64 * 1024]

        status, body, _ = await post_bytes(s, gw.port, chunked())  # no Content-Length: counted as it arrives
        assert (status, body["error"]["code"]) == (503, "body_budget_full")
        status, body, _ = await post_bytes(s, gw.port, b"{" + b" " * 2_000_000 + b"}")
        assert (status, body["error"]["code"]) == (413, "body_too_large")
        assert refused(gw, "body_budget_full") == 2 and refused(gw, "body_too_large") == 1
        text = await metrics_text(s, gw.port)
        assert "pulsescale_gateway_body_budget_used_bytes 2e+06" in text
        assert gw.queues["othr"].arrivals_total == 0  # refused before it could wait

        await set_slot(store, "n1", "ready", a.url)
        assert [(await t)[0] for t in held] == [200, 200]
        assert gw.budget.held_bytes == 0  # once upstreams have them, bodies leave the budget
        status, _, _ = await post_bytes(s, gw.port, big)
        assert status == 200


# --- L3: half-open connections and the connection cap -----------------------------------------------------------


async def test_a_connection_without_a_request_head_is_dropped(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with (
        running_gateway(nc, nats_server.url, header_timeout_s=0.5, body_timeout_s=0.5) as gw,
        raw_connections(gw.port, 40) as conns,
    ):
        for _, w in conns[:20]:  # half send a partial head, half nothing
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n")
        answers = await asyncio.gather(*(answer_and_close(r) for r, _ in conns))
        assert all(a.startswith(b"HTTP/1.1 408 ") and b'"header_timeout"' in a for a in answers), answers
        await wait_for(lambda: refused(gw, "header_timeout") == 40, what="every timeout counted")
        await wait_for(lambda: gw.health()["connections"] == 0, what="the connections let go")

        # A body that stops coming: 408 after the body timeout.
        async with raw_connections(gw.port, 1) as [(reader, writer)]:
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 100\r\n\r\n" + b'{"model": "tiny"'
            )
            answer = await asyncio.wait_for(reader.readuntil(b"}}"), 10)
            assert answer.startswith(b"HTTP/1.1 408 ") and b'"body_timeout"' in answer
        assert gw.budget.held_bytes == 0

        async with raw_connections(gw.port, 1) as [(reader, writer)]:  # not HTTP: aiohttp's 400, counted
            writer.write(b"\x16\x03\x01 not http\r\n\r\n")
            assert (await answer_and_close(reader)).startswith(b"HTTP/1.0 400 ")
        assert refused(gw, "malformed_request") == 1

        async with aiohttp.ClientSession() as s:  # a real client is not affected
            status, body, _ = await post(s, gw.port, {"model": "nope", "prompt": "x"})
            assert (status, body["error"]["code"]) == (404, "unknown_model")


async def test_connections_past_the_cap_are_refused_and_metrics_have_their_own_listener(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with (
        running_gateway(nc, nats_server.url, max_connections=20, metrics_host="127.0.0.1") as gw,
        aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,  # no connection kept
    ):
        assert gw.metrics_port is not None and gw.metrics_port != gw.port
        async with s.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=QUICK) as r:
            assert r.status == 404  # not on the clients' listener
            assert (await r.json())["error"]["code"] == "no_route" and refused(gw, "no_route") == 1
        async with raw_connections(gw.port, 20) as conns:
            await wait_for(lambda: gw.health()["connections"] == 20, what="20 connections held")
            async with raw_connections(gw.port, 1) as [(reader, _)]:
                answer = await answer_and_close(reader)
                assert answer.startswith(b"HTTP/1.1 503 ") and b'"too_many_connections"' in answer
                assert b"Retry-After: 1" in answer
            # The api listener is full; probes and scrapes still get through on their own.
            async with s.get(f"http://127.0.0.1:{gw.metrics_port}/healthz", timeout=QUICK) as r:
                assert r.status == 200 and (await r.json())["connections"] == 21  # 20 api, this one
            text = await metrics_text(s, gw.metrics_port)
            assert 'pulsescale_gateway_refused_total{reason="too_many_connections"} 1.0' in text
            assert 'pulsescale_gateway_connections{listener="api"} 20.0' in text
            conns[0][1].close()
            await wait_for(lambda: gw.health()["connections"] < 20, what="one let go")
            status, _, _ = await post(s, gw.port, {"model": "nope", "prompt": "x"})
            assert status == 404


# --- pulse_scalers that this NATS user may not read ------------------------------------------------------------


@pytest.fixture
def gateway_user_server(tmp_path: Path) -> NatsServer:
    """A nats-server with an ``admin`` user and a ``gateway`` user that has the gateway role without KV reads of
    `pulse_scalers` (the role as `warmpool.natsauth` renders it today)."""
    role = natsauth.permissions("gateway")
    bare = natsauth.Permissions(
        publish=tuple(p for p in role.publish if protocol.SCALERS_BUCKET not in p), subscribe=role.subscribe
    )
    users = [
        natsauth.User("admin", "autoscaler", "admin-pw", natsauth.Permissions((">",), (">",), allow_responses=True)),
        natsauth.User("gateway", "gateway", "gw-pw", bare),
    ]
    return NatsServer(tmp_path / "nats", extra_config=natsauth.render_authorization(users))


async def test_unreadable_scalers_refuse_503_and_ready_models_are_served(
    gateway_user_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    with gateway_user_server as server:
        admin = await connect.connect(connect.NatsOptions(servers=(server.url,), user="admin", password="admin-pw"))
        gw_opts = connect.NatsOptions(servers=(server.url,), user="gateway", password="gw-pw")
        gw_nc = await connect.connect(gw_opts)
        try:
            store = await KvSlotStore.open(admin)
            await put_scaler(admin, "scaled")
            async with upstreams(Upstream("a")) as (a,):
                await set_slot(store, "n1", "ready", a.url)
                async with (
                    running_gateway(gw_nc, server.url, models=None, timeout_s=20) as gw,
                    aiohttp.ClientSession() as s,
                ):
                    # Not read yet, then unreadable: either way the gateway cannot tell, and says so at once.
                    status, body, headers = await post(s, gw.port, {"model": "scaled", "prompt": "x"})
                    assert (status, body["error"]["code"], headers["Retry-After"]) == (503, "models_not_listed", "1")
                    await wait_for(lambda: gw.health()["scalers"] == "unreadable", what="pulse_scalers unreadable")
                    status, body, _ = await post(s, gw.port, {"model": "scaled", "prompt": "x"})
                    assert (status, body["error"]["code"]) == (503, "models_not_listed")
                    assert refused(gw, "models_not_listed") == 2 and "scaled" not in gw.queues
                    status, body, _ = await post(s, gw.port, {"model": MODEL, "prompt": "x"})
                    assert (status, body["upstream"]) == (200, "a")  # a ready slot vouches for its model
                    assert "give this gateway's NATS user KV reads of pulse_scalers, or pass --models" in caplog.text
        finally:
            await gw_nc.close()
            await admin.close()


# --- the process -----------------------------------------------------------------------------------------------


async def test_pulsescale_gateway_command_with_the_hardening_flags(nats_server: NatsServer, store: KvSlotStore) -> None:
    port, ops = free_port(), free_port()
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "pulsescale", "gateway", "--nats", nats_server.url, "--listen", f"127.0.0.1:{port}",
          "--metrics-listen", f"127.0.0.1:{ops}", "--max-connections", "8", "--header-timeout-s", "500ms",
          "--body-budget", "2MiB", "--body-timeout-s", "5s", "--keepalive-timeout-s", "1m", "--log-level", "WARNING"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as s:

            async def healthy() -> bool:
                try:
                    async with s.get(f"http://127.0.0.1:{ops}/healthz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for(healthy, 20, "the gateway process healthy on its metrics listener")
            async with s.get(f"http://127.0.0.1:{ops}/healthz", timeout=QUICK) as r:
                health = await r.json()
                assert health["body_budget"]["limit_bytes"] == 2 * 1024 * 1024
            async with s.get(f"http://127.0.0.1:{port}/healthz", timeout=QUICK) as r:
                assert r.status == 404
            await listed_scalers(s, port)  # no pulse_scalers bucket: no ScaledObject, every name unknown
            status, body, _ = await post(s, port, {"model": "nope", "prompt": "x"})
            assert (status, body["error"]["code"]) == (404, "unknown_model")
            async with raw_connections(port, 1) as [(reader, _)]:
                assert (await answer_and_close(reader)).startswith(b"HTTP/1.1 408 ")
            text = await metrics_text(s, ops)
            assert 'pulsescale_gateway_refused_total{reason="header_timeout"} 1.0' in text
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_the_size_flag_refuses_what_is_not_a_size() -> None:
    import subprocess

    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "gateway", "--body-budget", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "argument --body-budget: 'lots' is not a size such as 128MiB" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "pulsescale", "gateway", "--body-budget", "1000"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 2 and "must hold at least one largest body" in r.stderr
