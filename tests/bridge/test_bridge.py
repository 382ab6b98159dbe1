"""The bridge against real parts: a real nats-server (tests/conftest.py), engines serving vLLM-shaped pages over HTTP
on loopback (`helpers.Engine`), slots written to the real `pulse_slots`, and, for the PromQL path, a protocol-level
double of the Prometheus query API (`helpers.PrometheusDouble`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client

from bridge import daemon
from bridge.settings import BridgeSettings, Query, Target
from tests.bridge.helpers import (
    FAST,
    Engine,
    PrometheusDouble,
    engines,
    errors,
    finite,
    gauge,
    running_bridge,
    samples_of,
)
from tests.gateway_helpers import set_slot
from tests.helpers import wait_for
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore


async def test_samples_carry_what_the_engine_serves_and_follow_it(nats_server: NatsServer, nc: Client) -> None:
    async with engines(Engine()) as (e,):
        e.set(3, 2, 10, engine="0")
        e.set(1, 0, 5, engine="1")  # data parallel: a second engine of the same model on the same page
        async with samples_of(nc, "tiny") as got, running_bridge(nc, nats_server.url, targets=(Target.parse(e.url),)):
            await wait_for(lambda: got.last is not None, 10, "a first sample")
            first = got.last
            assert first is not None
            assert (first.gateway, first.queue_depth, first.inflight) == ("bridge-test", 4, 2)
            assert first.arrivals_total == 6 and first.completions_total == 0  # a baseline: the present arrived
            e.set(7, 4, 15, engine="0")  # 5 finished, 6 more present: 11 arrived
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 8, 10, "the new figures")
            last = got.last
            assert last is not None and last.inflight == 4
            assert (last.arrivals_total, last.completions_total, last.timeouts_total) == (6 + 11, 5, 0)
            # Between reads the last good reading goes out again, every 100 ms as the contract asks.
            n = len(got.got)
            await asyncio.sleep(0.5)
            assert len(got.got) - n >= 3


@pytest.mark.serial
async def test_a_change_shows_within_two_scrape_intervals(nats_server: NatsServer, nc: Client) -> None:
    every = 0.25  # the default period
    async with engines(Engine()) as (e,):
        e.set(0, 0, 0)
        async with (
            samples_of(nc, "tiny") as got,
            running_bridge(nc, nats_server.url, targets=(Target.parse(e.url),), scrape_every_s=every, stale_after_s=1),
        ):
            await wait_for(lambda: got.last is not None, 10, "a first sample")
            lags = []
            for depth in (5, 9, 2):
                t0 = asyncio.get_running_loop().time()
                e.set(depth, 1, 0)
                await wait_for(lambda d=depth: got.last is not None and got.last.queue_depth == d, 10, f"depth {depth}")
                lags.append(asyncio.get_running_loop().time() - t0)
            assert max(lags) < 2 * every, lags


async def test_an_engine_that_goes_away_stops_its_model_after_the_bound(nats_server: NatsServer, nc: Client) -> None:
    async with engines(Engine(served="a"), Engine(served="b")) as (ea, eb):
        ea.set(2, 1, 0)
        eb.set(1, 1, 0)
        targets = (Target.parse(ea.url), Target.parse(eb.url))
        async with (
            samples_of(nc, "a") as got_a,
            samples_of(nc, "b") as got_b,
            running_bridge(nc, nats_server.url, targets=targets) as bridge,
        ):
            await wait_for(lambda: got_a.last is not None and got_b.last is not None, 10, "samples of both")
            loop = asyncio.get_running_loop()
            await ea.stop()
            gone_at = loop.time()
            source = f"{ea.url}/metrics"
            await wait_for(lambda: gauge(bridge, "pulsescale_bridge_publishing", "a") == 0, 10, "a stopped")
            stopped_after = loop.time() - gone_at
            assert stopped_after < FAST["stale_after_s"] + 3 * FAST["scrape_every_s"] + 0.5, stopped_after
            assert errors(bridge, source, "unreachable") >= 1
            assert bridge.health()["sources"][source]["error"].startswith("unreachable")
            quiet_from = loop.time() + 0.05  # a sample already on its way
            await asyncio.sleep(0.5)
            assert got_a.since(quiet_from) == []  # no stale figure, no zero: nothing
            assert len(got_b.since(quiet_from)) >= 3  # the other model goes on
            age = gauge(bridge, "pulsescale_bridge_reading_age_seconds", "a")
            assert finite(age) and age is not None and age > FAST["stale_after_s"]
            reg = bridge.metrics.registry
            assert reg.get_sample_value("pulsescale_bridge_samples_stopped_total", {"model": "a"}) == 1
            # Back on the same port: its samples resume, as a new run (seq from 1).
            ea.set(5, 0, 0)
            await ea.start()
            await wait_for(lambda: got_a.last is not None and got_a.last.queue_depth == 5, 10, "a back")
            assert got_a.since(quiet_from)[0].seq == 1


async def test_bad_input_is_named_counted_and_the_rest_goes_on(nats_server: NatsServer, nc: Client) -> None:
    good, html, status, slow, garbage, nan = (Engine(served=n) for n in ("good", "h", "s", "w", "g", "n"))
    html.mode, status.mode, slow.mode, garbage.mode = "html", "status", "slow", "garbage"
    nan.extra = 'vllm:num_requests_waiting{model_name="nan"} NaN\nvllm:num_requests_running{model_name="nan"} 1\n'
    async with engines(good, html, status, slow, garbage, nan):
        for e in (good, html, status, slow, garbage, nan):
            e.set(1, 1, 0)
        bound = {html: "h", status: "s", slow: "w", garbage: "g"}
        targets = [Target.parse(f"{m}={e.url}") for e, m in bound.items()]
        targets += [Target.parse(good.url), Target.parse(nan.url)]
        expected = {html: "bad_body", status: "http_status", slow: "timeout", garbage: "bad_body", nan: "not_finite"}
        async with (
            samples_of(nc, "good") as got_good,
            samples_of(nc, "h") as got_h,
            samples_of(nc, "nan") as got_nan,
            running_bridge(nc, nats_server.url, targets=tuple(targets)) as bridge,
        ):
            for e, reason in expected.items():
                source = f"{e.url}/metrics"
                await wait_for(lambda s=source, r=reason: errors(bridge, s, r) >= 2, 10, f"{reason} counted twice")
            assert got_good.last is not None and got_good.last.queue_depth == 1
            assert got_h.got == [] and got_nan.got == []
            assert gauge(bridge, "pulsescale_bridge_publishing", "nan") == 0
            assert gauge(bridge, "pulsescale_bridge_publishing", "good") == 1
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{bridge.port}/healthz") as r:
                assert r.status == 200
                health = await r.json()
            assert health["models"]["good"]["publishing"] is True
            assert health["sources"][f"{html.url}/metrics"]["error"].startswith("bad_body")
            n = len(got_good.got)
            await asyncio.sleep(0.3)
            assert len(got_good.got) > n and bridge.crashed() is None


async def test_a_counter_reset_is_counted_and_the_counters_stay_monotonic(nats_server: NatsServer, nc: Client) -> None:
    async with engines(Engine()) as (e,):
        e.set(0, 1, 100)
        async with (
            samples_of(nc, "tiny") as got,
            running_bridge(nc, nats_server.url, targets=(Target.parse(e.url),)) as b,
        ):
            await wait_for(lambda: got.last is not None, 10, "a first sample")
            before = got.last
            assert before is not None
            e.restart_counters()
            e.set(0, 0, 3)  # the engine restarted: 3 finished since, its old request lost
            await wait_for(lambda: errors(b, f"{e.url}/metrics", "counter_reset") == 1, 10, "the reset counted")
            await wait_for(lambda: got.last is not None and got.last.inflight == 0, 10, "the new figures")
            after = got.last
            assert after is not None
            assert after.completions_total == before.completions_total + 3
            assert after.arrivals_total == before.arrivals_total + 3
            assert gauge(b, "pulsescale_bridge_publishing", "tiny") == 1  # a reset is no reason to stop


async def test_ready_slots_are_read_for_their_model_and_dropped_when_they_leave(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    async with engines(Engine(served="Some/Served-Name")) as (e,):
        e.set(4, 3, 0)
        async with samples_of(nc, "tiny") as got, running_bridge(nc, nats_server.url, slots=True) as bridge:
            await wait_for(lambda: bridge.routes is not None and bridge.routes.listed.is_set(), 10, "slots listed")
            key = await set_slot(store, "n1", "ready", e.url)
            await wait_for(lambda: got.last is not None, 10, "samples from the ready slot")
            assert got.last is not None and (got.last.queue_depth, got.last.inflight) == (4, 3)
            assert bridge.health()["sources"][key]["url"] == f"{e.url}/metrics"
            await set_slot(store, "n1", "releasing")
            await wait_for(lambda: key not in bridge.health()["sources"], 10, "the slot's source dropped")
            quiet_from = asyncio.get_running_loop().time() + 0.05
            await asyncio.sleep(0.4)
            assert got.since(quiet_from) == []
            reg = bridge.metrics.registry
            assert reg.get_sample_value("pulsescale_bridge_reads_total", {"source": key}) is None
            assert reg.get_sample_value("pulsescale_bridge_sources", {"kind": "slot"}) == 0


async def test_promql_queries_give_each_model_its_demand(nats_server: NatsServer, nc: Client) -> None:
    prom = await PrometheusDouble().start()
    try:
        prom.vector("sum(demand_ok)", "4")
        prom.vector("sum(demand_many)", "1", "2")
        prom.vector("sum(demand_nan)", "NaN")
        prom.error("sum(demand_err")
        queries = tuple(
            Query.parse(f"{m}={q}")
            for m, q in [("ok", "sum(demand_ok)"), ("none", "sum(demand_none)"), ("many", "sum(demand_many)"),
                         ("nan", "sum(demand_nan)"), ("err", "sum(demand_err")]
        )  # fmt: skip
        async with (
            samples_of(nc, "ok") as got_ok,
            samples_of(nc, "many") as got_many,
            running_bridge(nc, nats_server.url, prometheus_url=prom.url, queries=queries) as bridge,
        ):
            await wait_for(lambda: got_ok.last is not None, 10, "a sample from the query")
            assert got_ok.last is not None and (got_ok.last.queue_depth, got_ok.last.inflight) == (0, 4)
            for model, reason in [("none", "no_series"), ("many", "several_series"), ("nan", "not_finite"),
                                  ("err", "query_error")]:  # fmt: skip
                await wait_for(lambda m=model, r=reason: errors(bridge, f"query:{m}", r) >= 2, 10, reason)
                assert gauge(bridge, "pulsescale_bridge_publishing", model) == 0
            assert got_many.got == []
            prom.vector("sum(demand_ok)", "9")
            await wait_for(lambda: got_ok.last is not None and got_ok.last.inflight == 9, 10, "the new value")
            assert got_ok.last is not None and got_ok.last.arrivals_total == got_ok.got[0].arrivals_total  # no rates
    finally:
        await prom.stop()


@pytest.fixture
def gateway_role_server(tmp_path: Path) -> NatsServer:
    """A nats-server with an ``admin`` user and a ``gateway`` user with exactly the gateway role's permissions."""
    users = [
        natsauth.User("admin", "autoscaler", "admin-pw", natsauth.Permissions((">",), (">",), allow_responses=True)),
        natsauth.User("gateway", "gateway", "gw-pw", natsauth.permissions("gateway")),
    ]
    return NatsServer(tmp_path / "nats", extra_config=natsauth.render_authorization(users))


async def test_the_gateway_role_is_all_it_needs(gateway_role_server: NatsServer) -> None:
    with gateway_role_server as server:
        admin = await connect.connect(connect.NatsOptions(servers=(server.url,), user="admin", password="admin-pw"))
        try:
            store = await KvSlotStore.open(admin)  # creates the buckets, as the autoscaler does
            async with engines(Engine(), Engine(served="other")) as (slot_engine, target_engine):
                slot_engine.set(2, 2, 0)
                target_engine.set(1, 0, 0)
                await set_slot(store, "n1", "ready", slot_engine.url)
                settings = BridgeSettings(
                    nats=connect.NatsOptions(servers=(server.url,), user="gateway", password="gw-pw"),
                    port=0,
                    slots=True,
                    targets=(Target.parse(target_engine.url),),
                    **FAST,
                )
                stop, ready = asyncio.Event(), asyncio.Event()
                async with samples_of(admin, "tiny") as got, samples_of(admin, "other") as other:
                    # As the CLI runs it: a permission the server refuses before `ready` would end it at once.
                    task = asyncio.create_task(
                        connect.run_daemon(settings.nats, lambda o: daemon.run(settings, stop=stop, ready=ready), ready)
                    )
                    try:
                        await wait_for(lambda: got.last is not None and other.last is not None, 15, "samples of both")
                        assert got.last is not None and got.last.queue_depth == 2
                        assert not task.done()
                    finally:
                        stop.set()
                        await asyncio.wait_for(task, 10)
            await store.close()
        finally:
            await admin.close()


async def test_what_the_bridge_publishes_is_the_contract(nats_server: NatsServer, nc: Client) -> None:
    # Decoded with the contract's own decoder (as the autoscaler does): a sample that broke it would raise.
    async with engines(Engine()) as (e,):
        e.set(1, 1, 1)
        got: list[bytes] = []

        async def on_msg(msg: object) -> None:
            got.append(msg.data)  # type: ignore[attr-defined]

        sub = await nc.subscribe(protocol.queue_subject("tiny"), cb=on_msg)
        try:
            async with running_bridge(nc, nats_server.url, targets=(Target.parse(e.url),)):
                await wait_for(lambda: len(got) >= 3, 10, "three samples")
        finally:
            await sub.unsubscribe()
        samples = [protocol.decode(raw, protocol.QueueSample) for raw in got]
        assert [s.seq for s in samples[:3]] == [1, 2, 3] and all(s.model == "tiny" for s in samples)
