"""What the Kubernetes operator reads from the autoscaler, against a real nats-server and the daemon in process:
the revision-5 fields of `pulsescale status` (the ScaledObject's key, fallback, paused, the cold path's ask, the
last active and scale times, decisions with reasons), through the real `status` command; and a deleted
ScaledObject giving its model's claimed slots back (the operator's finalizer waits for that). Agents are the
protocol-level double (tests/agent_double.py)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from autoscaler.controller import ControllerSettings
from pulsescale import cli as dispatcher
from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import Gateway, collect_events, running_autoscaler
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import ScaledObjectSpec, ScalerRecord
from warmpool.registry import KvSlotStore, ensure_buckets

HELD = ("claimed", "activating", "ready")


async def put_record(nc: Client, model: str, *, spec: dict[str, Any] | None = None, **fields: Any) -> ScalerRecord:
    raw = {
        "scaleTargetRef": {"name": model},
        "minReplicaCount": 0,
        "maxReplicaCount": 8,
        "triggers": [{"type": "gateway-queue", "metadata": {"model": model, "targetQueueDepth": 4}}],
        **(spec or {}),
    }
    rec = ScalerRecord(
        namespace="team",
        name=f"so-{model}",
        spec=protocol.decode(msgspec.json.encode(raw), ScaledObjectSpec),
        created_at=time.time(),
        **fields,
    )
    kv = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
    await kv.put(rec.key, protocol.encode(rec))
    return rec


async def status_json(url: str, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, Any]]:
    """`pulsescale status --json`, the real command (own event loop, in a thread), rows by model."""
    code = await asyncio.to_thread(dispatcher.main, ["status", "--json", "--nats", url])
    out = capsys.readouterr()
    assert code == 0, out.err
    return {row["model"]: row for row in json.loads(out.out)}


async def test_status_reports_what_the_operator_needs(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, capsys: pytest.CaptureFixture[str]
) -> None:
    agents = [await AgentDouble(nc, store, "node-0", "m", slots=1).start()]
    await put_record(nc, "m")
    await put_record(nc, "p", paused=True, paused_replicas=0)
    await put_record(nc, "f", spec={"fallback": {"failureThreshold": 1, "replicas": 2, "behavior": "currentReplicas"},
                                    "advanced": {"staleAfterSeconds": 0.3}})  # fmt: skip
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            t0 = time.time()
            await Gateway(nc, "m").send(12)  # 3 replicas wanted, 1 slot in the pool: 2 asked of the cold path
            await Gateway(nc, "f").send(8)  # then silent: the fallback after one missed interval
            await wait_for(lambda: scaler.fleet.by_model["m"].scaler.cold_requested == 2, 5, "the cold path's ask")
            await wait_for(lambda: scaler.fleet.by_model["f"].decider.state.mode == "fallback", 5, "f's fallback")
            rows = await status_json(nats_server.url, capsys)

            m, p, f = rows["m"], rows["p"], rows["f"]
            assert m["key"] == "team.so-m" and p["key"] == "team.so-p"
            assert m["desired"] == 3 and m["cold_requested"] == 2
            assert m["last_active_at"] is not None and m["last_active_at"] >= t0
            assert m["last_scale_at"] is not None and m["last_scale_at"] >= t0
            assert m["decisions"] and all(d["reason"] for d in m["decisions"]), m["decisions"]
            assert m["decisions"][-1]["desired"] == 3
            assert not m["paused"] and not m["fallback"]

            assert p["paused"] and p["desired"] == 0 and "paused at 0 by annotation" in p["reason"]
            assert f["fallback"] and f["mode"] == "fallback" and "currentReplicas" in f["reason"]
            assert not f["paused"] and f["desired"] == 2
    finally:
        for a in agents:
            await a.stop()


async def test_an_on_call_pause_shows_as_paused(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, capsys: pytest.CaptureFixture[str]
) -> None:
    await put_record(nc, "m")
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(lambda: "m" in scaler.fleet.by_model, 5)
        assert not (await status_json(nats_server.url, capsys))["m"]["paused"]
        code = await asyncio.to_thread(dispatcher.main, ["pause", "m", "--nats", nats_server.url])
        capsys.readouterr()
        assert code == 0
        assert (await status_json(nats_server.url, capsys))["m"]["paused"]


async def test_deleting_a_scaled_object_releases_its_slots(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agents = [await AgentDouble(nc, store, f"node-{i}", "m", slots=2, rack=f"r{i}").start() for i in range(2)]
    other = await AgentDouble(nc, store, "node-x", "o", slots=1).start()
    rec = await put_record(nc, "m")
    await put_record(nc, "o")
    events = await collect_events(nc, "m")
    kv = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
    try:
        async with running_autoscaler(nats_server.url):
            await Gateway(nc, "m").send(12)
            await Gateway(nc, "o").send(4)
            await wait_for(lambda: sum(r.state == "ready" for r in store.records("m")) == 3, 5, "3 slots of m ready")
            await wait_for(lambda: sum(r.state == "ready" for r in store.records("o")) == 1, 5, "o's slot ready")

            await kv.delete(rec.key)
            await wait_for(lambda: not any(r.state in HELD for r in store.records("m")), 5, "m's slots released")
            # Released is written first; the agent's write of `warm` (its slot ready again) follows it.
            await wait_for(
                lambda: all(r.state == "warm" and r.claim_id is None for r in store.records("m")), 5, "m's slots warm"
            )
            await wait_for(lambda: sum(e.type == "slot.released" for e in events) == 3, 5, "3 slot.released events")
            released = [e for e in events if e.type == "slot.released"]
            assert all(e.reason == "ScaledObject team.so-m deleted" for e in released)
            assert sum(a.activations.__len__() for a in agents) == 3, "nothing was activated after the delete"
            # Another model's slots are not touched.
            assert [r.state for r in store.records("o")] == ["ready"]
    finally:
        for a in [*agents, other]:
            await a.stop()


async def test_slots_of_a_scaled_object_deleted_while_no_leader_ran_are_released(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=2).start()
    rec = await put_record(nc, "m")
    kv = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            await Gateway(nc, "m").send(8)
            await wait_for(lambda: sum(r.state == "ready" for r in store.records("m")) == 2, 5, "2 slots ready")
            # And ready in the autoscaler's own book: one it still counts as activating is released at the stop
            # (a clean-clone CI run found 0 ready after it when this waited on our view alone; this race is the
            # likely cause, not a confirmed one).
            await wait_for(lambda: scaler.fleet.by_model["m"].scaler.ready == 2, 5, "2 slots ready in its book")
        # The leader stopped (its serving slots stay held for the next one); the ScaledObject goes meanwhile.
        assert sum(r.state == "ready" for r in store.records("m")) == 2
        await kv.delete(rec.key)
        async with running_autoscaler(nats_server.url, controller=ControllerSettings(activation_deadline_s=0.5)):
            await wait_for(lambda: not any(r.state in HELD for r in store.records("m")), 5, "m's slots released")
        assert all(r.state == "warm" for r in store.records("m"))
    finally:
        await agent.stop()
