"""The operator keeps `pulse_assignments` from where its standby pods are scheduled (kube/assignments.py): on a
Kubernetes install every node is bound to the models of the ScaledObjects whose standby pods it runs, so an agent
credential cannot offer another model (the security review's M3) without anyone running `pulsescale assign`.

Real kopf and the real `kubernetes` client against the API double (tests/k8s_api_double.py), a real nats-server;
slots are written to `pulse_slots` as an agent would (the standby keeper's view follows them), and the claim side is
the real registry (`KvSlotStore`) with ``require_assignment`` as deploy/base runs the autoscaler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from kube import assignments, standby
from kube.context import OperatorContext
from tests import k8s_api_double
from tests.helpers import wait_for
from tests.k8s_api_double import K8sApiDouble
from tests.kube.test_operator import api_client, running_operator
from tests.kube.test_operator_parts import NS, SO, Running, deployment, scaled_object, schedule
from warmpool import protocol
from warmpool.cli import _hand_back
from warmpool.errors import NoSlotAvailable
from warmpool.protocol import AgentLease, NodeAssignment, SlotRecord
from warmpool.registry import KvSlotStore, ensure_buckets

k8s_api = k8s_api_double.k8s_api  # the fixture

OPERATOR = NodeAssignment.OPERATOR


@contextlib.asynccontextmanager
async def operator(api: K8sApiDouble, nc: Client, *, write: bool = True) -> AsyncIterator[Running]:
    api.prune_with_crds()
    names = [protocol.SCALERS_BUCKET, protocol.SLOTS_BUCKET, protocol.ASSIGNMENTS_BUCKET, protocol.OBJECTS_BUCKET]
    buckets = await ensure_buckets(nc.jetstream(), names=names)
    ctx = OperatorContext(
        nc=nc, scalers=buckets[protocol.SCALERS_BUCKET], slots=buckets[protocol.SLOTS_BUCKET], api=api_client(api),
        namespaces=(NS,), status_every_s=0.3, home_namespace="pulsescale",
        assignments=buckets[protocol.ASSIGNMENTS_BUCKET] if write else None, assignments_settle_s=0.5,
    )  # fmt: skip
    async with running_operator(ctx):
        keeper = ctx.extra.get("assignments")
        if keeper is not None:
            keeper.every_s = 0.2  # a pass per 200 ms: slot releases wake nothing of it
        yield Running(api, ctx)


async def kv(nc: Client, bucket: str) -> KeyValue:
    return await nc.jetstream().key_value(bucket)


async def assignment(nc: Client, node: str) -> NodeAssignment | None:
    try:
        entry = await (await kv(nc, protocol.ASSIGNMENTS_BUCKET)).get(node)
    except nats.js.errors.KeyNotFoundError:
        return None
    return None if not entry.value else protocol.decode(entry.value, NodeAssignment)


async def wait_assignment(api: K8sApiDouble, nc: Client, node: str, models: list[str], what: str) -> NodeAssignment:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10.0
    while True:
        rec = await assignment(nc, node)
        if rec is not None and rec.models == models:
            return rec
        if loop.time() > deadline:
            raise AssertionError(f"{what}: node {node} never listed {models}; last {rec!r}")
        await asyncio.sleep(0.05)


async def put_slot(nc: Client, model: str, node: str, slot: str, state: str) -> None:
    rec = SlotRecord(model=model, node=node, slot=slot, state=state)  # type: ignore[arg-type]
    if state in ("claimed", "activating", "ready"):
        rec = SlotRecord(model=model, node=node, slot=slot, state=state, token=1, claim_id="c1")  # type: ignore[arg-type]
    await (await kv(nc, protocol.SLOTS_BUCKET)).put(rec.key, protocol.encode(rec))


def on_node(running: Running, node: str) -> list[dict[str, Any]]:
    return [p for p in running.standby_pods() if (p.get("spec") or {}).get("nodeName") == node]


@pytest.fixture
async def qwen(k8s_api: K8sApiDouble) -> K8sApiDouble:
    k8s_api.create("deployments", NS, deployment())
    return k8s_api


async def test_each_node_is_assigned_the_models_of_its_standby_pods_by_the_operator(
    qwen: K8sApiDouble, nc: Client
) -> None:
    api = qwen
    async with operator(api, nc) as running:
        api.create(SO, NS, scaled_object(size=2))
        a, b = await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods")
        schedule(api, a, "gpu-0")
        schedule(api, b, "gpu-1")
        for node in ("gpu-0", "gpu-1"):
            rec = await wait_assignment(api, nc, node, ["qwen"], "the operator's assignment")
            assert rec.by == OPERATOR
        assert await assignment(nc, "gpu-2") is None  # no standby pod there: nothing written
        # M3: gpu-1's agent credential advertises a warm slot of a model nobody gave it (and gpu-2, which has no
        # standby pod, one of qwen). The registry as deploy/base runs the autoscaler never offers either.
        store = await KvSlotStore.open(nc, assignments=True, require_assignment=True)
        await store.start()
        try:
            for node, model in (("gpu-0", "qwen"), ("gpu-1", "llama"), ("gpu-2", "qwen")):
                lease = AgentLease(node=node, slots=["s0"], heartbeat_at=time.time(), lease_s=30)
                await (await kv(nc, protocol.AGENTS_BUCKET)).put(node, protocol.encode(lease))
                await put_slot(nc, model, node, "s0", "warm")
            await wait_for(lambda: [r.key for r in store.claimable("qwen")] == ["qwen.gpu-0.s0"], 5, "gpu-0 only")
            assert store.claimable("llama") == []
            with pytest.raises(NoSlotAvailable, match="not assigned to node gpu-1"):
                await store.claim_slot("llama.gpu-1.s0")
        finally:
            await store.close()


async def test_a_model_leaves_a_node_only_after_its_slot_there_is_released(qwen: K8sApiDouble, nc: Client) -> None:
    api = qwen
    async with operator(api, nc) as running:
        api.create(SO, NS, scaled_object(size=1))
        (pod,) = await running.wait_pods(lambda ps: len(ps) == 1, "one standby pod")
        schedule(api, pod, "gpu-0")
        await wait_assignment(api, nc, "gpu-0", ["qwen"], "assigned")
        await put_slot(nc, "qwen", "gpu-0", "s0", "ready")  # serving on gpu-0
        await api.wait_for(
            lambda: on_node(running, "gpu-0") and all(
                p["metadata"]["labels"][standby.SERVING_LABEL] == "true" for p in on_node(running, "gpu-0")),
            what="the standby pod to serve",
        )  # fmt: skip
        # The pod leaves gpu-0 (evicted, say) while its slot there still serves: the model stays assigned, or the
        # gateways would drop the slot at once and a new autoscaler leader would never adopt (nor release) it.
        api.delete("pods", NS, pod["metadata"]["name"])
        await api.wait_for(lambda: not on_node(running, "gpu-0"), what="no standby pod on gpu-0")
        keeper = running.ctx.extra["assignments"]
        passes = keeper.writes
        await asyncio.sleep(1.5)  # several passes, past the settle time
        rec = await assignment(nc, "gpu-0")
        assert rec is not None and rec.models == ["qwen"], rec
        assert keeper.writes == passes
        # Released back to warm: now it goes, and the record stays, listing no model (the node offers nothing).
        await put_slot(nc, "qwen", "gpu-0", "s0", "warm")
        rec = await wait_assignment(api, nc, "gpu-0", [], "the model taken off gpu-0 once its slot is free")
        assert rec.by == OPERATOR


async def test_other_operators_models_are_kept_and_a_manual_assignment_is_left_alone_until_handed_back(
    qwen: K8sApiDouble, nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    api = qwen
    bucket = (await ensure_buckets(nc.jetstream(), names=[protocol.ASSIGNMENTS_BUCKET]))[protocol.ASSIGNMENTS_BUCKET]
    # gpu-0: kept by another operator (namespaced mode) for a model of a namespace this one does not watch.
    await bucket.put("gpu-0", protocol.encode(NodeAssignment(node="gpu-0", models=["phi"], by=OPERATOR)))
    # gpu-1: assigned by a person.
    await bucket.put("gpu-1", protocol.encode(NodeAssignment(node="gpu-1", models=["phi"], by="alice@laptop")))
    caplog.set_level(logging.WARNING, logger="pulsescale.operator.assignments")
    async with operator(api, nc) as running:
        api.create(SO, NS, scaled_object(size=2))
        a, b = await running.wait_pods(lambda ps: len(ps) == 2, "two standby pods")
        schedule(api, a, "gpu-0")
        schedule(api, b, "gpu-1")
        await wait_assignment(api, nc, "gpu-0", ["phi", "qwen"], "ours added beside the other operator's")
        await api.wait_for(lambda: "assigned by hand" in caplog.text, what="the manual assignment said")
        await asyncio.sleep(1.0)
        rec = await assignment(nc, "gpu-1")
        assert rec is not None and (rec.by, rec.models) == ("alice@laptop", ["phi"]), "a manual record was changed"
        assert caplog.text.count("assigned by hand") == 1, "said once, not every pass"
        assert "pulsescale assign gpu-1 --hand-back" in caplog.text
        # Handed back: the operator's from now on (phi stays: no operator here manages it).
        await _hand_back(nc, "gpu-1")
        rec = await wait_assignment(api, nc, "gpu-1", ["phi", "qwen"], "the operator's again")
        assert rec.by == OPERATOR
        # Our pod leaves gpu-0: ours goes (no slot held), the other operator's stays.
        api.delete("pods", NS, a["metadata"]["name"])
        await wait_assignment(api, nc, "gpu-0", ["phi"], "only the other operator's model left")


async def test_no_assignments_writes_nothing(qwen: K8sApiDouble, nc: Client) -> None:
    api = qwen
    async with operator(api, nc, write=False) as running:
        assert "assignments" not in running.ctx.extra
        api.create(SO, NS, scaled_object(size=1))
        (pod,) = await running.wait_pods(lambda ps: len(ps) == 1, "one standby pod")
        schedule(api, pod, "gpu-0")
        await asyncio.sleep(1.0)
        assert await assignment(nc, "gpu-0") is None


@pytest.mark.parametrize(
    ("current", "desired", "ours", "held", "may_remove", "expected"),
    [
        (None, set(), {"a"}, set(), True, None),  # nothing to say about an unknown node
        (None, {"a"}, {"a"}, set(), False, ["a"]),  # adding never waits
        (["a"], {"a"}, {"a"}, set(), True, None),  # unchanged: no write
        (["a", "x"], set(), {"a"}, set(), True, ["x"]),  # only ours go
        (["a"], set(), {"a"}, {"a"}, True, None),  # held there: stays
        (["a"], set(), {"a"}, set(), False, None),  # not settled, or the slot view is stale: stays
        (["a"], set(), {"a"}, set(), True, []),  # the last model goes: the record stays, empty
    ],
)
def test_node_models_table(
    current: list[str] | None, desired: set[str], ours: set[str], held: set[str], may_remove: bool,
    expected: list[str] | None,
) -> None:  # fmt: skip
    assert assignments.node_models(current, desired, ours, held, may_remove=may_remove) == expected
