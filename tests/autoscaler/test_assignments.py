"""Issue 25, finding M3: agents bound to their models (contract revision 11), against a real nats-server and the
real daemon. A node is the protocol-level double in tests/agent_double.py; everything else is real.

A node's agent user may write any key under its node in `pulse_slots`, the model part included. The models a node
may offer are its `NodeAssignment` in `pulse_assignments`, which only the operator's user writes: a warm slot of
another model is never claimed, and it is counted in ``pulsescale_registry_rejected_records_total`` with reason
``unassigned_model``. The role permissions themselves are tested in tests/warmpool/test_permissions.py and
tests/test_security_review.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client

from autoscaler.controller import ControllerSettings
from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways: autouse, stops the samples
    Gateway,
    cancel_gateways,
    collect_events,
    put_scaler,
    running_autoscaler,
)
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore, ensure_buckets

REJECTED = "pulsescale_registry_rejected_records_total"


async def assign(nc: Client, node: str, *models: str) -> None:
    """What ``pulsescale assign NODE MODEL...`` writes (with the operator's user in production)."""
    kv = (await ensure_buckets(nc.jetstream()))[protocol.ASSIGNMENTS_BUCKET]
    await kv.put(node, protocol.encode(protocol.NodeAssignment(node=node, models=list(models), by="test")))


def ready_nodes(store: KvSlotStore, model: str) -> list[str]:
    return sorted(r.node for r in store.records(model) if r.state == "ready")


@contextlib.asynccontextmanager
async def taken(store: KvSlotStore, node: str) -> AsyncIterator[set[str]]:
    """The keys of `node` that ever left `warm` while in the block (a claim is the first such write)."""
    seen: set[str] = set()

    async def watch() -> None:
        async for ev in store.watch():
            rec = getattr(ev, "record", None)
            if rec is not None and rec.node == node and rec.state != "warm":
                seen.add(rec.key)

    watcher = asyncio.create_task(watch())
    try:
        yield seen
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def test_a_warm_slot_of_a_model_its_node_was_not_assigned_is_never_claimed_and_is_counted(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """The reproduction: node ``rogue`` was assigned ``other``, yet its agent advertises two warm slots of ``m``,
    better placed than the honest node's (weights resident). A pulse wants four replicas of ``m``: the honest node's
    two are claimed and serve, the rogue's never, the pool is called exhausted, and both rogue slots are counted."""
    await assign(nc, "rogue", "other")
    await assign(nc, "honest", "m")
    rogue = await AgentDouble(nc, store, "rogue", "m", slots=2).start()
    honest = await AgentDouble(nc, store, "honest", "m", slots=2, resident=False).start()
    await put_scaler(nc, "m", maxReplicaCount=4)
    events = await collect_events(nc, "m")
    try:
        async with taken(store, "rogue") as rogue_taken, running_autoscaler(nats_server.url) as scaler:
            Gateway(nc, "m").background(16, 5.0)  # 16 queued at 4 per replica: 4 replicas, more than honest holds

            def settled() -> bool:  # all four serving, or the pool called exhausted with two
                ready = len(ready_nodes(store, "m"))
                return ready == 4 or (ready == 2 and any(e.type == "pool.exhausted" for e in events))

            await wait_for(settled, 5, "the bring-ups to settle")
            assert rogue_taken == set() and rogue.activations == []
            assert ready_nodes(store, "m") == ["honest", "honest"]
            assert [r.state for r in store.records("m") if r.node == "rogue"] == ["warm", "warm"]
            rejected = scaler.metrics.registry.get_sample_value(REJECTED, {"reason": "unassigned_model"})
            assert rejected == 2  # once per record, however often a claim looked at the pool
            assert sorted(honest.activations) == ["m.honest.s0", "m.honest.s1"]
    finally:
        for agent in (rogue, honest):
            await agent.stop()


async def test_with_require_assignment_an_unassigned_node_serves_once_it_is_assigned(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """The rollout: an agent started with ``--model m`` before anyone assigned its node. With ``--require-assignment``
    its slot is counted and not offered; once the operator assigns ``m`` to it, the next bring-up takes it."""
    await assign(nc, "a", "m")
    a = await AgentDouble(nc, store, "a", "m", slots=1).start()
    b = await AgentDouble(nc, store, "b", "m", slots=1).start()
    await put_scaler(nc, "m", maxReplicaCount=2)
    events = await collect_events(nc, "m")
    try:
        async with running_autoscaler(nats_server.url, require_assignment=True) as scaler:
            Gateway(nc, "m").background(8, 10.0)  # 2 replicas

            def settled() -> bool:  # both serving, or the pool called exhausted with one
                ready = len(ready_nodes(store, "m"))
                return ready == 2 or (ready == 1 and any(e.type == "pool.exhausted" for e in events))

            await wait_for(settled, 5, "the bring-ups to settle")
            assert b.activations == [] and ready_nodes(store, "m") == ["a"]
            assert scaler.metrics.registry.get_sample_value(REJECTED, {"reason": "unassigned_model"}) == 1
            await assign(nc, "b", "m")
            await wait_for(lambda: ready_nodes(store, "m") == ["a", "b"], 5, "node b's slot ready once assigned")
    finally:
        for agent in (a, b):
            await agent.stop()


async def test_a_held_slot_of_an_unassigned_model_is_left_alone_not_adopted_every_tick(
    nats_server: NatsServer, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A `ready` record of ``m`` on node ``rogue``, which was assigned only ``other`` (an agent's forgery, or a model
    unassigned before its slot was drained): the leader never adopts it, counts it once, and its sweep does not
    take it for an orphan to adopt on every housekeeping tick (it logged "adopting" 17 times in 4 s)."""
    await assign(nc, "rogue", "other")
    kv = (await ensure_buckets(nc.jetstream()))[protocol.SLOTS_BUCKET]
    rec = protocol.SlotRecord(model="m", node="rogue", slot="s0", state="ready", endpoint="http://127.0.0.1:9",
                              token=1, claim_id="c" * 16, updated_at=time.time())  # fmt: skip
    await kv.put(rec.key, protocol.encode(rec))
    await put_scaler(nc, "m", minReplicaCount=0)
    caplog.set_level(logging.WARNING, logger="pulsescale.scaler")
    async with running_autoscaler(nats_server.url, controller=ControllerSettings(activation_deadline_s=0.2)) as scaler:
        await wait_for(lambda: "m" in scaler.fleet.by_model, 10, "the model's controller")
        await wait_for(
            lambda: scaler.metrics.registry.get_sample_value(REJECTED, {"reason": "unassigned_model"}) == 1,
            10, "the record to be counted",
        )  # fmt: skip
        await asyncio.sleep(2.0)  # past two activation deadlines: eight housekeeping ticks
        assert scaler.fleet.by_model["m"].scaler.held == {}
        adopting = [r.getMessage() for r in caplog.records if "adopting" in r.getMessage()]
        assert adopting == [], adopting
        assert scaler.metrics.registry.get_sample_value(REJECTED, {"reason": "unassigned_model"}) == 1
