"""The bridge reads ready slots as the gateway routes them (review finding 3; contract revision 11), against a real
nats-server, the real `pulse_slots` and `pulse_assignments`, and engines serving vLLM-shaped pages on loopback: a
node's agent may write a ``ready`` record of any model pointing at a page it serves, so a node whose assignment does
not list the model is never read, and with ``require_assignment`` (``--require-assignment``, ``require_assignment:``
in the config file, as the secure deployment runs the gateway and the autoscaler) a node without one is not read
either. Both ``--slots`` and ``--scaledobjects`` read ready slots; both are held to it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from nats.aio.client import Client

from bridge.daemon import Bridge
from tests.bridge.helpers import Engine, engines, running_bridge, samples_of
from tests.gateway_helpers import set_slot
from tests.helpers import wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.registry import KvSlotStore, ensure_buckets

UNASSIGNED = {"reason": "unassigned_model"}


async def assign(nc: Client, node: str, *models: str) -> None:
    """Write `node`'s assignment as the operator (or `pulsescale assign`) would, the bucket made if need be."""
    kv = (await ensure_buckets(nc.jetstream(), names=[protocol.ASSIGNMENTS_BUCKET]))[protocol.ASSIGNMENTS_BUCKET]
    await kv.put(node, protocol.encode(protocol.NodeAssignment(node=node, models=list(models))))


async def ask_for_slots_of(nc: Client, model: str) -> None:
    """A ScaledObject of `model` with ``source: vllm-metrics`` and no metricsURL: its ready slots are read."""
    kv = (await ensure_buckets(nc.jetstream(), names=[protocol.SCALERS_BUCKET]))[protocol.SCALERS_BUCKET]
    doc = {
        "v": 1,
        "namespace": "inference",
        "name": model,
        "spec": {
            "scaleTargetRef": {"name": model},
            "triggers": [{"type": "gateway-queue", "metadata": {"model": model, "source": "vllm-metrics"}}],
        },
    }
    await kv.put(f"inference.{model}", json.dumps(doc).encode())


def unassigned(bridge: Bridge) -> float:
    value = bridge.metrics.registry.get_sample_value("pulsescale_bridge_rejected_records_total", UNASSIGNED)
    return value or 0.0


async def listed(bridge: Bridge) -> None:
    """Wait until the bridge reads `pulse_slots` and the assignments (and, with --scaledobjects, tiny's record)."""
    await wait_for(lambda: bridge.routes is not None and bridge.routes.listed.is_set(), 10, "slots listed")
    if bridge.settings.scaledobjects:
        await wait_for(
            lambda: bridge.scalers is not None and "tiny" in bridge.scalers.health()["models"],  # type: ignore[operator]
            10,
            "tiny's ScaledObject read",
        )
    assert bridge.health()["assignments"] == "listed"


READS: list[dict[str, Any]] = [{"slots": True}, {"scaledobjects": True}]


@pytest.mark.parametrize("reads", READS, ids=["slots", "scaledobjects"])
async def test_a_node_assigned_other_models_is_never_read_for_this_one(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, reads: dict[str, Any]
) -> None:
    """The gateway's rule without the flag: n2, assigned ``llama``, writes a ``ready`` record of ``tiny`` pointing at
    its own page (999 waiting); the bridge publishes n1's figures alone (n1 has no assignment: unbound, read), and
    counts the forged record once. Once n2 is assigned tiny its page counts too."""
    await assign(nc, "n2", "llama")
    if reads.get("scaledobjects"):
        await ask_for_slots_of(nc, "tiny")
    async with engines(Engine(), Engine()) as (honest, rogue):
        honest.set(3, 1, 0)
        rogue.set(999, 0, 0)
        async with samples_of(nc, "tiny") as got, running_bridge(nc, nats_server.url, **reads) as bridge:
            await listed(bridge)
            await set_slot(store, "n1", "ready", honest.url)
            forged = await set_slot(store, "n2", "ready", rogue.url)
            await wait_for(lambda: got.last is not None, 10, "samples from n1")
            await wait_for(lambda: unassigned(bridge) == 1, 10, "the forged record counted")
            await asyncio.sleep(0.3)
            assert got.last is not None and got.last.queue_depth == 3
            assert max(s.queue_depth for s in got.got) == 3 and rogue.hits == 0
            assert forged not in bridge.health()["sources"]

            await assign(nc, "n2", "llama", "tiny")
            await wait_for(lambda: got.last is not None and got.last.queue_depth == 1002, 10, "n2 read once assigned")


@pytest.mark.parametrize("reads", READS, ids=["slots", "scaledobjects"])
async def test_require_assignment_reads_no_node_without_one(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, reads: dict[str, Any]
) -> None:
    """With ``require_assignment`` a node the assignments do not name is not read, whatever it advertises: nothing
    is published for tiny until `pulsescale assign n1 tiny`, then n1's page is."""
    await assign(nc, "other", "llama")  # the bucket exists and is read: n1 is simply not in it
    if reads.get("scaledobjects"):
        await ask_for_slots_of(nc, "tiny")
    async with engines(Engine()) as (e,):
        e.set(7, 2, 0)
        async with (
            samples_of(nc, "tiny") as got,
            running_bridge(nc, nats_server.url, require_assignment=True, **reads) as bridge,
        ):
            await listed(bridge)
            key = await set_slot(store, "n1", "ready", e.url)
            await wait_for(lambda: unassigned(bridge) == 1, 10, "n1's record counted")
            await asyncio.sleep(0.4)
            assert got.got == [] and e.hits == 0 and key not in bridge.health()["sources"]

            await assign(nc, "n1", "tiny")
            await wait_for(lambda: got.last is not None, 10, "n1 read once assigned")
            assert got.last is not None and (got.last.queue_depth, got.last.inflight) == (7, 2)
