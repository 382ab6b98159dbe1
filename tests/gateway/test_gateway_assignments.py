"""The gateway routes by `pulse_assignments` (contract revision 11), against a real nats-server, real HTTP upstreams
and `pulsescale assign` as the operator runs it: a node's agent may write a ``ready`` record of any model under its
node's keys, its own endpoint included, and the gateway must not send that model's traffic there unless the node's
assignment lists the model. Refusals are counted once per record in
``pulsescale_gateway_rejected_records_total{reason="unassigned_model"}``; ``--require-assignment`` routes no node
without an assignment; a gateway that may not read the assignments routes nothing, and says so.

Each test fails on the gateway from before it: that one routed every ``ready`` record with a good endpoint."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client

from gateway.proxy import Gateway, GatewaySettings
from tests.gateway_helpers import MODEL, Upstream, running_gateway, set_slot, upstreams
from tests.helpers import wait_for
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.registry import KvSlotStore, ensure_buckets

QUICK = aiohttp.ClientTimeout(total=10)
UNASSIGNED = {"reason": "unassigned_model"}


async def assign_directly(nc: Client, node: str, *models: str) -> None:
    """Write `node`'s assignment as the operator's user would (the bucket made if need be)."""
    kv = (await ensure_buckets(nc.jetstream(), names=[protocol.ASSIGNMENTS_BUCKET]))[protocol.ASSIGNMENTS_BUCKET]
    await kv.put(node, protocol.encode(protocol.NodeAssignment(node=node, models=list(models))))


async def pulsescale_assign(url: str, node: str, *models: str) -> None:
    """``pulsescale assign NODE MODEL...`` as a person runs it."""
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "pulsescale", "assign", node, *models, "--nats", url],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert out.decode() == f"node {node} may offer {', '.join(sorted(models))}\n"


def unassigned(gw: Gateway) -> float:
    return gw.metrics.registry.get_sample_value("pulsescale_gateway_rejected_records_total", UNASSIGNED) or 0.0


async def completion(s: aiohttp.ClientSession, port: int) -> tuple[int, dict]:  # type: ignore[type-arg]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    async with s.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=QUICK) as r:
        return r.status, await r.json(content_type=None)


async def test_a_rogue_nodes_ready_slot_of_a_model_it_was_not_assigned_gets_no_traffic(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """The reviewer's attack on the gateway: n2, assigned ``llama``, writes a ``ready`` record of ``tiny`` with its
    own endpoint. tiny's requests all go to n1 (assigned tiny), the record is counted once however many requests
    come, and once `pulsescale assign` lists tiny for n2 it is routed; taken off the list again, it is not."""
    await assign_directly(nc, "n1", MODEL)
    await assign_directly(nc, "n2", "llama")
    async with upstreams(Upstream("honest"), Upstream("rogue")) as (honest, rogue):
        await set_slot(store, "n1", "ready", honest.url)
        forged = await set_slot(store, "n2", "ready", rogue.url)
        async with running_gateway(nc, nats_server.url) as gw, aiohttp.ClientSession() as s:
            assert set(gw.queues[MODEL].endpoints) == {f"{MODEL}.n1.s0"}  # listed: judged already
            got = [(await completion(s, gw.port))[1].get("upstream") for _ in range(12)]
            assert got == ["honest"] * 12 and (honest.received, rogue.received) == (12, 0)
            assert gw.health()["assignments"] == "listed"
            assert unassigned(gw) == 1  # once per record, not per request

            await pulsescale_assign(nats_server.url, "n2", "llama", MODEL)
            await wait_for(lambda: forged in gw.queues[MODEL].endpoints, what="n2's slot routed once assigned")
            got = [(await completion(s, gw.port))[1]["upstream"] for _ in range(4)]
            assert "rogue" in got and rogue.received >= 1

            await pulsescale_assign(nats_server.url, "n2", "llama")
            await wait_for(lambda: forged not in gw.queues[MODEL].endpoints, what="n2's slot dropped once unassigned")
            before = rogue.received
            got = [(await completion(s, gw.port))[1]["upstream"] for _ in range(4)]
            assert got == ["honest"] * 4 and rogue.received == before
            assert unassigned(gw) == 2  # refused again: the assignment changed
            text = await (await s.get(f"http://127.0.0.1:{gw.port}/metrics", timeout=QUICK)).text()
            assert 'pulsescale_gateway_rejected_records_total{reason="unassigned_model"} 2.0' in text


async def test_a_node_without_an_assignment_is_routed_unless_required(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """The default, as the autoscaler's: a node the listed assignments do not name is unbound, and routed."""
    await assign_directly(nc, "other", "llama")
    async with upstreams(Upstream("a")) as (a,):
        await set_slot(store, "n1", "ready", a.url)
        async with running_gateway(nc, nats_server.url) as gw, aiohttp.ClientSession() as s:
            assert gw.health()["assignments"] == "listed"
            assert (await completion(s, gw.port))[1]["upstream"] == "a" and unassigned(gw) == 0


async def test_require_assignment_routes_no_node_without_one(nats_server: NatsServer, store: KvSlotStore) -> None:
    """`pulsescale gateway --require-assignment`, the process: n1 has a ready slot and no assignment, so tiny's
    request waits out its timeout (504); once `pulsescale assign n1 tiny` it is served by n1."""
    await assign_directly(store.nc, "other", "llama")  # the bucket exists and is read: n1 is simply not in it
    port = free_port()
    async with upstreams(Upstream("a")) as (a,):
        await set_slot(store, "n1", "ready", a.url)
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "pulsescale", "gateway", "--nats", nats_server.url, "--listen",
              f"127.0.0.1:{port}", "--models", MODEL, "--timeout-s", "1s", "--require-assignment",
              "--log-level", "WARNING"],
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )  # fmt: skip
        try:
            async with aiohttp.ClientSession() as s:

                async def health() -> dict | None:  # type: ignore[type-arg]
                    try:
                        async with s.get(f"http://127.0.0.1:{port}/healthz", timeout=QUICK) as r:
                            return await r.json() if r.status == 200 else None
                    except aiohttp.ClientError:
                        return None

                await wait_for(health, 20, "the gateway process healthy")
                assert (await health()) is not None and (await health())["assignments"] == "listed"  # type: ignore[index]
                status, body = await completion(s, port)
                assert (status, body["error"]["code"]) == (504, "timeout")
                assert a.received == 0
                metrics = await (await s.get(f"http://127.0.0.1:{port}/metrics", timeout=QUICK)).text()
                assert 'pulsescale_gateway_rejected_records_total{reason="unassigned_model"} 1.0' in metrics

                await pulsescale_assign(nats_server.url, "n1", MODEL)

                async def served() -> bool:
                    status, body = await completion(s, port)
                    return status == 200 and body["upstream"] == "a"

                await wait_for(served, 20, "n1 routed once assigned")
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


@pytest.fixture
def no_assignment_reads(tmp_path: Path) -> NatsServer:
    """A nats-server with an ``admin`` user and a ``gateway`` user that has the gateway role without KV reads of
    `pulse_assignments` (a user rendered before this change)."""
    role = natsauth.permissions("gateway")
    bare = natsauth.Permissions(
        publish=tuple(p for p in role.publish if protocol.ASSIGNMENTS_BUCKET not in p), subscribe=role.subscribe
    )
    users = [
        natsauth.User("admin", "autoscaler", "admin-pw", natsauth.Permissions((">",), (">",), allow_responses=True)),
        natsauth.User("gateway", "gateway", "gw-pw", bare),
    ]
    return NatsServer(tmp_path / "nats", extra_config=natsauth.render_authorization(users))


async def test_a_gateway_that_may_not_read_the_assignments_routes_nothing_and_says_so(
    no_assignment_reads: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """It cannot tell an assigned slot from a forged one, so it routes none: the slot stays out of its table,
    /healthz answers 503 (slots not listed) and names the assignments unreadable, and the log says the fix."""
    caplog.set_level(logging.WARNING, logger="pulsescale.gateway")
    with no_assignment_reads as server:
        admin = await connect.connect(connect.NatsOptions(servers=(server.url,), user="admin", password="admin-pw"))
        gw_nc = await connect.connect(connect.NatsOptions(servers=(server.url,), user="gateway", password="gw-pw"))
        try:
            store = await KvSlotStore.open(admin)
            await assign_directly(admin, "n1", MODEL)
            async with upstreams(Upstream("a")) as (a,):
                await set_slot(store, "n1", "ready", a.url)
                settings = GatewaySettings(
                    nats=connect.NatsOptions(servers=(server.url,)),
                    port=0,
                    gateway_id="gw-test",
                    models=frozenset({MODEL}),
                )
                async with Gateway(settings, gw_nc) as gw:
                    await wait_for(lambda: gw.routes.view is not None and len(gw.routes.view) == 1, what="slot read")
                    await asyncio.sleep(0.3)  # what a gateway routes it has routed by now
                    assert gw.queues[MODEL].endpoints == {}
                    await wait_for(
                        lambda: gw.health().get("assignments") == "unreadable", what="the assignments found unreadable"
                    )
                    assert gw.queues[MODEL].endpoints == {} and not gw.routes.listed.is_set()
                    async with (
                        aiohttp.ClientSession() as s,
                        s.get(f"http://127.0.0.1:{gw.port}/healthz", timeout=QUICK) as r,
                    ):
                        assert r.status == 503 and (await r.json())["assignments"] == "unreadable"
                assert a.received == 0
            assert "give this gateway's NATS user KV reads of pulse_assignments" in caplog.text
        finally:
            await gw_nc.close()
            await admin.close()
