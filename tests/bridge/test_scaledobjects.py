"""`pulsescale bridge --scaledobjects` against real parts (contract revision 14): ScaledObject records written to the
real `pulse_scalers` of a real nats-server, engines serving vLLM-shaped pages on loopback (`helpers.Engine`), ready
slots in the real `pulse_slots`, the protocol-level double of the Prometheus query API; the bridge's real samples
decoded with the contract's decoder (`helpers.samples_of`)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from bridge import daemon
from bridge.daemon import Bridge
from bridge.scalers import Wanted, wanted
from bridge.settings import BridgeSettings, Query, Target
from tests.bridge.helpers import FAST, Engine, PrometheusDouble, engines, errors, gauge, running_bridge, samples_of
from tests.gateway_helpers import set_slot
from tests.helpers import wait_for
from warmpool import connect, natsauth, protocol
from warmpool.bucketview import Snapshot
from warmpool.embedded import NatsServer
from warmpool.errors import BadMessage
from warmpool.protocol import ScalerRecord
from warmpool.registry import KvSlotStore, ensure_buckets


def _record(model: str, name: str | None = None, **meta: Any) -> dict[str, Any]:
    """A `pulse_scalers` value as JSON, as any writer may put it (the validator is not in the way)."""
    return {
        "v": 1,
        "namespace": "inference",
        "name": name or model,
        "spec": {
            "scaleTargetRef": {"name": model},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": model, **meta}}],
        },
    }


async def _scalers(nc: Client) -> KeyValue:
    return (await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]


async def _put(kv: KeyValue, doc: dict[str, Any]) -> str:
    key = f"{doc['namespace']}.{doc['name']}"
    await kv.put(key, json.dumps(doc).encode())
    return key


def _rejected(bridge: Bridge, reason: str) -> float:
    value = bridge.metrics.registry.get_sample_value("pulsescale_bridge_rejected_records_total", {"reason": reason})
    return value or 0.0


def _quiet_from() -> float:
    return asyncio.get_running_loop().time() + 0.05  # a sample already on its way


# --- the pure part: what a record asks ------------------------------------------------------------------------------


def test_what_a_record_asks_the_bridge_to_read() -> None:
    def rec(**meta: Any) -> ScalerRecord:
        return protocol.decode(json.dumps(_record("qwen", **meta)).encode(), ScalerRecord)

    assert wanted(rec()) is None and wanted(rec(source="gateway")) is None
    assert wanted(rec(source="vllm-metrics")) == Wanted("inference.qwen", "qwen", "vllm-metrics")
    pages = wanted(rec(source="vllm-metrics", metricsURL=" http://a:8000 ,http://b:8000/m"))
    assert pages is not None and pages.pages == ("http://a:8000/metrics", "http://b:8000/m") and not pages.slots
    query = wanted(rec(source="prometheus", serverAddress="http://p:9090", query=" sum(x) "))
    assert query == Wanted("inference.qwen", "qwen", "prometheus", server="http://p:9090", promql="sum(x)")
    for meta, words in (
        ({"source": "kafka"}, "spec.triggers[0].metadata.source: 'kafka' is not a source"),
        ({"source": "prometheus", "query": "up"}, "spec.triggers[0].metadata.serverAddress: required"),
        ({"metricsURL": "http://a:1"}, "spec.triggers[0].metadata.metricsURL: belongs to source vllm-metrics"),
    ):
        with pytest.raises(BadMessage) as err:
            wanted(rec(**meta))
        assert err.value.reason == "bad_source" and words in str(err.value), str(err.value)


# --- against nats-server ----------------------------------------------------------------------------------------


async def test_a_vllm_metrics_scaledobject_is_read_for_its_model_until_it_says_gateway_or_goes(
    nats_server: NatsServer, nc: Client
) -> None:
    kv = await _scalers(nc)
    async with engines(Engine(served="Qwen/Qwen2.5-0.5B-Instruct")) as (e,):
        e.set(3, 2, 0)  # a served name that is no pulsescale name: the trigger's model binds the page
        async with samples_of(nc, "qwen") as got, running_bridge(nc, nats_server.url, scaledobjects=True) as bridge:
            key = await _put(kv, _record("qwen", source="vllm-metrics", metricsURL=e.url))
            await wait_for(lambda: got.last is not None, 10, "samples from the ScaledObject's page")
            last = got.last
            assert last is not None and (last.gateway, last.queue_depth, last.inflight) == ("bridge-test", 3, 2)
            page = f"{e.url}/metrics"
            health = bridge.health()
            assert health["sources"][page]["scaledobject"] == key and health["sources"][page]["model"] == "qwen"
            assert health["models"]["qwen"]["sources"] == [page]
            assert health["scaledobjects"]["bucket"] == "listed"
            assert health["scaledobjects"]["models"]["qwen"]["scaledobject"] == key
            assert health["scaledobjects"]["models"]["qwen"]["sources"] == [page]
            e.set(6, 1, 0)
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 6, 10, "the new figures")

            # The record changes to the gateways' own demand: the page is no longer read, nothing more published.
            await _put(kv, _record("qwen", source="gateway"))
            await wait_for(lambda: page not in bridge.health()["sources"], 10, "the page dropped")
            quiet = _quiet_from()
            await asyncio.sleep(0.4)
            assert got.since(quiet) == []
            assert bridge.health()["scaledobjects"]["models"] == {}
            assert bridge.metrics.registry.get_sample_value("pulsescale_bridge_reads_total", {"source": page}) is None

            # Back to the engines, then deleted: read again, then dropped again.
            await _put(kv, _record("qwen", source="vllm-metrics", metricsURL=e.url))
            await wait_for(lambda: got.last is not None and got.since(quiet) != [], 10, "samples again")
            assert got.since(quiet)[0].seq == 1  # a new run for the autoscaler
            await kv.delete(key)
            await wait_for(lambda: page not in bridge.health()["sources"], 10, "dropped with the record")
            quiet = _quiet_from()
            await asyncio.sleep(0.4)
            assert got.since(quiet) == []
            reg = bridge.metrics.registry
            assert reg.get_sample_value("pulsescale_bridge_sources", {"kind": "target"}) == 0


async def test_without_metrics_urls_the_models_ready_slots_are_read(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    kv = await _scalers(nc)
    async with engines(Engine(), Engine(), Engine(served="other")) as (mine, mine2, theirs):
        mine.set(4, 1, 0)
        mine2.set(2, 0, 0)
        theirs.set(9, 9, 0)
        async with (
            samples_of(nc, "tiny") as got,
            samples_of(nc, "other") as other,
            running_bridge(nc, nats_server.url, scaledobjects=True) as bridge,
        ):
            assert bridge.routes is not None
            await wait_for(lambda: bridge.routes is not None and bridge.routes.listed.is_set(), 10, "slots listed")
            key = await set_slot(store, "n1", "ready", mine.url)  # ready before the ScaledObject asks
            await set_slot(store, "n1", "ready", theirs.url, model="other")  # no ScaledObject names it
            await _put(kv, _record("tiny", source="vllm-metrics"))
            await wait_for(lambda: got.last is not None, 10, "samples from the ready slot")
            assert got.last is not None and (got.last.queue_depth, got.last.inflight) == (4, 1)
            source = bridge.health()["sources"][key]
            assert (source["kind"], source["url"], source["scaledobject"]) == (
                "slot",
                f"{mine.url}/metrics",
                "inference.tiny",
            )
            key2 = await set_slot(store, "n2", "ready", mine2.url)  # a second slot, ready after: read too
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 6, 10, "both slots summed")
            await set_slot(store, "n1", "releasing")
            await wait_for(lambda: key not in bridge.health()["sources"], 10, "the released slot dropped")
            assert key2 in bridge.health()["sources"]
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 2, 10, "the other slot alone")
            await asyncio.sleep(0.3)
            assert other.got == [] and theirs.hits == 0


async def test_a_prometheus_scaledobject_asks_its_query_of_its_server(nats_server: NatsServer, nc: Client) -> None:
    kv = await _scalers(nc)
    prom = await PrometheusDouble().start()
    try:
        prom.vector('sum(vllm:num_requests_waiting{model_name="llama"})', "7")
        query = 'sum(vllm:num_requests_waiting{model_name="llama"})'
        async with samples_of(nc, "llama") as got, running_bridge(nc, nats_server.url, scaledobjects=True) as bridge:
            key = await _put(kv, _record("llama", source="prometheus", serverAddress=prom.url, query=query))
            await wait_for(lambda: got.last is not None, 10, "a sample from the query")
            assert got.last is not None and (got.last.queue_depth, got.last.inflight) == (0, 7)
            assert query in prom.asked
            source = bridge.health()["sources"]["query:llama"]
            assert (source["kind"], source["url"], source["scaledobject"]) == ("query", prom.url, key)
            # A new query in the record is asked from then on.
            prom.vector("sum(other)", "2")
            await _put(kv, _record("llama", source="prometheus", serverAddress=prom.url, query="sum(other)"))
            await wait_for(lambda: got.last is not None and got.last.inflight == 2, 10, "the new query's value")
            n = len(prom.asked)
            await asyncio.sleep(0.3)
            assert query not in prom.asked[n:]
    finally:
        await prom.stop()


async def test_a_bad_source_block_is_a_named_counted_rejection_and_the_last_good_one_stands(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    kv = await _scalers(nc)
    caplog.set_level(logging.WARNING, logger="pulsescale.bridge")
    async with engines(Engine(served="qwen")) as (e,):
        e.set(2, 2, 0)
        async with samples_of(nc, "qwen") as got, running_bridge(nc, nats_server.url, scaledobjects=True) as bridge:
            key = await _put(kv, _record("qwen", source="vllm-metrics", metricsURL=e.url))
            await wait_for(lambda: got.last is not None, 10, "samples")
            # A foreign writer's block: an unknown source. The record still decodes (the autoscaler reads it).
            await _put(kv, _record("qwen", source="kafka", metricsURL=e.url))
            await wait_for(lambda: _rejected(bridge, "bad_source") == 1, 10, "bad_source counted")
            assert any("'kafka' is not a source" in r.getMessage() and key in r.getMessage() for r in caplog.records)
            # One that breaks the contract's types does not decode at all: counted by its reason.
            await _put(kv, _record("qwen", source=7))
            await wait_for(lambda: _rejected(bridge, "wrong_type") == 1, 10, "wrong_type counted")
            # A ScaledObject seen bad from the start reads nothing.
            await _put(kv, _record("llama", source="prometheus", query="up"))
            await wait_for(lambda: _rejected(bridge, "bad_source") == 2, 10, "the second bad block counted")
            n = len(got.got)
            await asyncio.sleep(0.3)
            assert len(got.got) > n  # the last good block stands
            assert list(bridge.health()["scaledobjects"]["models"]) == ["qwen"]
            assert bridge.crashed() is None
            # A re-list brings the same records: judged once, not counted again.
            view = bridge.scalers.view if bridge.scalers is not None else None
            assert bridge.scalers is not None and view is not None
            bridge.scalers.apply(Snapshot({k: v for k, v, _ in view.entries()}))
            assert _rejected(bridge, "bad_source") == 2


async def test_the_flags_win_for_a_model_they_read(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    kv = await _scalers(nc)
    caplog.set_level(logging.INFO, logger="pulsescale.bridge")
    prom = await PrometheusDouble().start()
    try:
        prom.vector("sum(flag)", "5")
        async with engines(Engine(served="qwen"), Engine(served="bound")) as (e, bound_engine):
            e.set(1, 1, 0)
            bound_engine.set(3, 0, 0)
            flags: dict[str, Any] = {
                "scaledobjects": True,
                "prometheus_url": prom.url,
                "queries": (Query.parse("qwen=sum(flag)"),),
                "targets": (Target.parse(f"bound={bound_engine.url}"),),
            }
            async with samples_of(nc, "qwen") as got, running_bridge(nc, nats_server.url, **flags) as bridge:
                key = await _put(kv, _record("qwen", source="vllm-metrics", metricsURL=e.url))
                await _put(kv, _record("bound", source="prometheus", serverAddress=prom.url, query="sum(x)"))
                await wait_for(
                    lambda: len(bridge.health()["scaledobjects"]["models"]) == 2, 10, "both ScaledObjects seen"
                )
                held = bridge.health()["scaledobjects"]["models"]
                assert held["qwen"]["held"].startswith("--query qwen=... reads it (the flags win")
                assert held["bound"]["held"].startswith("--target bound=... reads it")
                assert held["qwen"]["sources"] == [] and held["qwen"]["scaledobject"] == key
                await wait_for(lambda: got.last is not None, 10, "samples from the flag's query")
                await asyncio.sleep(0.3)
                assert got.last is not None and got.last.inflight == 5 and got.last.queue_depth == 0
                assert e.hits == 0 and "sum(x)" not in prom.asked  # the ScaledObjects' sources are not read
                assert bridge.health()["sources"]["query:qwen"]["scaledobject"] is None
                said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
                assert any(f"ScaledObject {key}" in m and "the flags win" in m for m in said), said
    finally:
        await prom.stop()


async def test_a_second_scaledobject_of_a_model_is_counted_and_not_read(nats_server: NatsServer, nc: Client) -> None:
    kv = await _scalers(nc)
    async with engines(Engine(served="a"), Engine(served="b")) as (first, second):
        first.set(1, 0, 0)
        second.set(8, 0, 0)
        async with samples_of(nc, "qwen") as got, running_bridge(nc, nats_server.url, scaledobjects=True) as bridge:
            key = await _put(kv, _record("qwen", "qwen-a", source="vllm-metrics", metricsURL=first.url))
            await wait_for(lambda: got.last is not None, 10, "samples from the first")
            await _put(kv, _record("qwen", "qwen-b", source="vllm-metrics", metricsURL=second.url))
            await wait_for(lambda: _rejected(bridge, "bad_value") == 1, 10, "the second counted")
            await _put(kv, _record("qwen", "qwen-b", source="vllm-metrics", metricsURL=f"{second.url}/metrics"))
            await asyncio.sleep(0.3)
            assert _rejected(bridge, "bad_value") == 1  # once per pair, not per change
            assert bridge.health()["scaledobjects"]["models"]["qwen"]["scaledobject"] == key
            assert second.hits == 0 and got.last is not None and got.last.queue_depth == 1
            # The first goes: the second is read from then on.
            await kv.delete(key)
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 8, 10, "the second read")
            assert gauge(bridge, "pulsescale_bridge_publishing", "qwen") == 1


async def test_a_bridge_of_scaledobjects_alone_waits_for_the_bucket(nats_server: NatsServer, nc: Client) -> None:
    """No `pulse_scalers` yet (no autoscaler has made it): said, looked for again, followed once it exists."""
    settings = BridgeSettings(scaledobjects=True, port=0, gateway_id="bridge-test")
    settings.check()  # --scaledobjects alone is something to read
    async with engines(Engine(served="qwen")) as (e,):
        e.set(5, 0, 0)
        async with samples_of(nc, "qwen") as got, running_bridge(nc, nats_server.url, scaledobjects=True) as bridge:
            await wait_for(lambda: bridge.health()["scaledobjects"]["bucket"] == "absent", 10, "absent said")
            assert errors(bridge, f"{e.url}/metrics", "unreachable") == 0
            kv = await _scalers(nc)
            await _put(kv, _record("qwen", source="vllm-metrics", metricsURL=e.url))
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 5, 15, "samples once it exists")


@pytest.fixture
def gateway_role_server(tmp_path: Path) -> NatsServer:
    """A nats-server with an ``admin`` user and a ``gateway`` user with exactly the gateway role's permissions."""
    users = [
        natsauth.User("admin", "autoscaler", "admin-pw", natsauth.Permissions((">",), (">",), allow_responses=True)),
        natsauth.User("gateway", "gateway", "gw-pw", natsauth.permissions("gateway")),
    ]
    return NatsServer(tmp_path / "nats", extra_config=natsauth.render_authorization(users))


async def test_the_gateway_role_is_all_it_needs(gateway_role_server: NatsServer) -> None:
    """Revision 14 changes no permission: the gateway user reads `pulse_scalers` and `pulse_slots` already."""
    with gateway_role_server as server:
        admin = await connect.connect(connect.NatsOptions(servers=(server.url,), user="admin", password="admin-pw"))
        try:
            store = await KvSlotStore.open(admin)  # creates the buckets, as the autoscaler does
            kv = await _scalers(admin)
            async with engines(Engine(), Engine(served="paged")) as (slot_engine, paged):
                slot_engine.set(2, 2, 0)
                paged.set(1, 0, 0)
                await set_slot(store, "n1", "ready", slot_engine.url)
                await _put(kv, _record("tiny", source="vllm-metrics"))
                await _put(kv, _record("paged", source="vllm-metrics", metricsURL=paged.url))
                settings = BridgeSettings(
                    nats=connect.NatsOptions(servers=(server.url,), user="gateway", password="gw-pw"),
                    port=0,
                    scaledobjects=True,
                    **FAST,
                )
                stop, ready = asyncio.Event(), asyncio.Event()
                async with samples_of(admin, "tiny") as got, samples_of(admin, "paged") as other:
                    task = asyncio.create_task(
                        connect.run_daemon(settings.nats, lambda o: daemon.run(settings, stop=stop, ready=ready), ready)
                    )
                    try:
                        await wait_for(lambda: got.last is not None and other.last is not None, 15, "samples of both")
                        assert got.last is not None and got.last.queue_depth == 2 and not task.done()
                    finally:
                        stop.set()
                        await asyncio.wait_for(task, 10)
            await store.close()
        finally:
            await admin.close()
