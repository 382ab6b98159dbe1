"""The autoscaler's metrics and its HTTP port, read from the registry and scraped over real HTTP."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

from nats.aio.client import Client

from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    cancel_gateways,
    put_scaler,
    running_autoscaler,
)
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore


async def test_decision_seconds_is_observed_once_per_scale_up_decision_not_per_evaluation(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """While the pool is short the policy keeps deciding the same target on every sample; only the decision
    that asked for capacity, and only at its first claim, is a `pulsescale_decision_seconds` observation."""
    agent = await AgentDouble(nc, store, "node-0", "m", slots=1).start()
    await put_scaler(nc, "m")
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            value = scaler.metrics.registry.get_sample_value
            gw = Gateway(nc, "m")
            await gw.send(12)  # 3 replicas wanted, 1 slot in the pool
            await wait_for(lambda: value("pulsescale_decision_seconds_count") == 1, 3, "the first claim")
            await gw.steady(12, 2.0)  # 20 more samples and 8 housekeeping ticks with the pool short
            assert value("pulsescale_samples_total", {"outcome": "accepted"}) >= 15
            assert value("pulsescale_decision_seconds_count") == 1
            assert value("pulsescale_decision_seconds_sum") < 0.5, "a growing age, not sample -> claim"
            assert value("pulsescale_decision_to_claim_seconds_count") is None, "one name for one measurement"
    finally:
        await agent.stop()


async def test_activation_stages_have_the_autoscalers_own_name(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=2, activation_delay_s=0.05).start()
    await put_scaler(nc, "m")
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            value = scaler.metrics.registry.get_sample_value
            await Gateway(nc, "m").send(8)
            name = "pulsescale_autoscaler_activation_seconds"
            total, claim_to_ready = {"model": "m", "stage": "total"}, {"model": "m", "stage": "claim_to_ready"}
            await wait_for(lambda: value(f"{name}_count", total) == 2, 3, "two activations")
            assert value(f"{name}_count", claim_to_ready) == 2
            assert value(f"{name}_sum", claim_to_ready) >= 2 * 0.05, "measured from the claim"
            assert value("pulsescale_activation_seconds_count", {"stage": "total"}) is None, "the agent's name"
    finally:
        await agent.stop()


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


async def get(port: int, path: str) -> tuple[int, str]:
    return await asyncio.to_thread(_get, port, path)


async def test_the_port_serves_metrics_health_and_readiness_and_nothing_else(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    await put_scaler(nc, "m")
    async with running_autoscaler(nats_server.url, metrics_host="127.0.0.1", metrics_port=0) as scaler:
        port = scaler.metrics_port
        assert port
        status, text = await get(port, "/metrics")
        assert status == 200
        for series in ('pulsescale_build_info{component="autoscaler",version=', "process_cpu_seconds_total",
                       "python_info{", "pulsescale_leader 1.0", "pulsescale_registry_rejected_records_total",
                       "pulsescale_nats_connected 1.0"):  # fmt: skip
            assert series in text, f"{series} missing from /metrics"
        status, text = await get(port, "/healthz")
        assert status == 200 and json.loads(text)["leader"] is True
        await wait_for(scaler.ready, 3, "views listed and ScaledObjects followed")
        status, text = await get(port, "/readyz")
        assert status == 200 and json.loads(text)["ready"] is True
        status, _ = await get(port, "/nope")
        assert status == 404, "every path answered with metrics"

        async def ready_is(code: int) -> bool:
            return (await get(port, "/readyz"))[0] == code

        # No broker: the lease lapses and the views go stale. Not ready, saying why; but alive: a restart cannot
        # bring NATS back, and a liveness probe failing here would restart every replica at once.
        nats_server.kill()
        await wait_for(lambda: ready_is(503), 5, "not ready without a broker")
        status, text = await get(port, "/readyz")
        assert status == 503 and json.loads(text)["reason"] == "NATS is not connected (reconnecting)", text
        await wait_for(lambda: not scaler.fleet.holds_shards(), 5, "the lease lapsed: no longer leading either")
        status, text = await get(port, "/healthz")
        assert status == 200 and json.loads(text)["leader"] is False, text
        nats_server.restart()
        await wait_for(lambda: ready_is(200), 10, "ready again")
        assert "reason" not in json.loads((await get(port, "/readyz"))[1])


async def test_a_second_replica_is_healthy_with_current_views_and_takes_its_share(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """A replica joining one that holds every shard is healthy (current views) before it holds any, and then
    takes its share: the two split the 32 shards, each acting for half."""
    await put_scaler(nc, "m")
    lead = running_autoscaler(nats_server.url, identity="first")
    follow = running_autoscaler(
        nats_server.url, identity="second", metrics_host="127.0.0.1", metrics_port=0, wait_to_lead=False
    )
    async with lead as first, follow as second:
        port = second.metrics_port
        assert port
        await wait_for(second.ready, 3, "the second replica's views")
        status, text = await get(port, "/healthz")
        assert status == 200, text
        assert (await get(port, "/readyz"))[0] == 200

        def split() -> bool:
            a, b = first.fleet.shards.held(), second.fleet.shards.held()  # type: ignore[union-attr]
            return len(a) == len(b) == protocol.SHARDS // 2 and not a & b

        await wait_for(split, 5, "the shards split between the two")
        health = json.loads((await get(port, "/healthz"))[1])
        assert health["leader"] is True and len(health["shards"]) == protocol.SHARDS // 2
