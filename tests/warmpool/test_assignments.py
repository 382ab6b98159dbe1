"""The registry's side of contract revision 11 (agents bound to their models), against a real nats-server: a store
that follows `pulse_assignments` offers, claims and adopts a node's slots only of the models its `NodeAssignment`
lists, counts the others once per record (``unassigned_model``), and follows the assignment as it changes.

The daemon's side (a pulse, the metric) is tests/autoscaler/test_assignments.py; the permissions are
tests/warmpool/test_permissions.py and tests/test_security_review.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js.kv import KeyValue

from tests.helpers import wait_for
from warmpool import protocol
from warmpool.errors import BadMessage, NoSlotAvailable
from warmpool.protocol import AgentLease, NodeAssignment, SlotRecord
from warmpool.registry import KvSlotStore, ensure_buckets


@pytest.fixture
async def buckets(nc: Client) -> dict[str, KeyValue]:
    return await ensure_buckets(nc.jetstream(timeout=5.0))


@pytest.fixture
async def bound(nc: Client, buckets: dict[str, KeyValue]) -> AsyncIterator[KvSlotStore]:
    """A store that follows the assignments, as the autoscaler's does."""
    s = await KvSlotStore.open(nc, assignments=True)
    await s.start()
    try:
        yield s
    finally:
        await s.close()


async def assign(buckets: dict[str, KeyValue], node: str, *models: str) -> None:
    rec = NodeAssignment(node=node, models=list(models), by="test", updated_at=time.time())
    await buckets[protocol.ASSIGNMENTS_BUCKET].put(node, protocol.encode(rec))


async def agent(buckets: dict[str, KeyValue], node: str, *slots: SlotRecord) -> None:
    """What a node's agent writes: its lease listing its slots, and the slot records (any model it likes)."""
    lease = AgentLease(node=node, slots=[s.slot for s in slots], heartbeat_at=time.time(), lease_s=30)
    await buckets[protocol.AGENTS_BUCKET].put(node, protocol.encode(lease))
    for s in slots:
        await buckets[protocol.SLOTS_BUCKET].put(s.key, protocol.encode(s))


def warm(model: str, node: str, slot: str = "s0") -> SlotRecord:
    return SlotRecord(model=model, node=node, slot=slot, state="warm", updated_at=time.time())


def unassigned(store: KvSlotStore) -> int:
    return store.rejected.counts["unassigned_model"]


async def test_a_slot_of_a_model_its_node_was_not_assigned_is_neither_offered_nor_claimed(
    bound: KvSlotStore, buckets: dict[str, KeyValue]
) -> None:
    await assign(buckets, "rogue", "other")
    await assign(buckets, "honest", "m")
    await agent(buckets, "rogue", warm("m", "rogue"))
    await agent(buckets, "honest", warm("m", "honest"))
    await wait_for(lambda: unassigned(bound) == 1, 5, "the rogue slot counted")
    await wait_for(lambda: [r.key for r in bound.claimable("m")] == ["m.honest.s0"], 5, "the honest slot offered")
    assert bound.index.lease_fresh("rogue")  # its agent is alive: only the assignment keeps its slot out
    with pytest.raises(NoSlotAvailable, match="model m is not assigned to node rogue"):
        await bound.claim_slot("m.rogue.s0")
    claim = await bound.claim("m")
    assert claim.key == "m.honest.s0"
    with pytest.raises(NoSlotAvailable):
        await bound.claim("m")  # the rogue slot is all that is left: never taken
    assert bound.record("m.rogue.s0") is not None and bound.record("m.rogue.s0").state == "warm"  # type: ignore[union-attr]
    assert unassigned(bound) == 1  # once per record, however often a claim looked


async def test_a_forged_held_record_of_an_unassigned_model_is_not_adopted(
    bound: KvSlotStore, buckets: dict[str, KeyValue]
) -> None:
    """An agent can also write a ``ready`` (or ``claimed``) record under its node, claim id and all: a new leader
    adopting it would count it as capacity, and activate a ``claimed`` one."""
    await assign(buckets, "rogue", "other")
    forged = SlotRecord(model="m", node="rogue", slot="s0", state="ready", claim_id="forged", token=1,
                        endpoint="http://203.0.113.66:8000", updated_at=time.time())  # fmt: skip
    await agent(buckets, "rogue", forged)
    await wait_for(lambda: unassigned(bound) == 1, 5, "the forged record counted")
    assert bound.adopt("m.rogue.s0") is None
    await assign(buckets, "rogue", "other", "m")  # assigned after all: the same record is adopted
    await wait_for(lambda: bound.adopt("m.rogue.s0") is not None, 5, "adopted once assigned")


async def test_the_binding_follows_the_assignment_as_the_operator_changes_it(
    bound: KvSlotStore, buckets: dict[str, KeyValue]
) -> None:
    """Without a record a node is unbound (the rollout default); an assignment binds it at once, a new one that
    lists the model again offers the slot again, and each refusal of the same record is counted once."""
    await agent(buckets, "n", warm("m", "n"))
    await wait_for(lambda: [r.key for r in bound.claimable("m")] == ["m.n.s0"], 5, "an unassigned node offers")
    assert unassigned(bound) == 0
    await assign(buckets, "n", "other")
    await wait_for(lambda: bound.claimable("m") == [], 5, "the assignment binds the node")
    assert unassigned(bound) == 1
    await assign(buckets, "n", "other", "extra")  # still not m: the same record, not counted again
    await assign(buckets, "n", "m")
    await wait_for(lambda: [r.key for r in bound.claimable("m")] == ["m.n.s0"], 5, "offered again once assigned")
    assert unassigned(bound) == 1
    await assign(buckets, "n")  # an empty list: the node offers nothing
    await wait_for(lambda: bound.claimable("m") == [], 5, "no model: nothing offered")
    assert unassigned(bound) == 2


async def test_require_assignment_offers_nothing_of_a_node_without_one(
    nc: Client, buckets: dict[str, KeyValue]
) -> None:
    await agent(buckets, "n", warm("m", "n"))
    async with await KvSlotStore.open(nc, require_assignment=True) as strict:
        await wait_for(lambda: strict.index.lease_fresh("n"), 5, "the lease")
        assert strict.claimable("m") == [] and unassigned(strict) == 1
        await assign(buckets, "n", "m")
        await wait_for(lambda: [r.key for r in strict.claimable("m")] == ["m.n.s0"], 5, "offered once assigned")


async def test_a_store_without_the_bucket_binds_nothing_and_cannot_require_it(
    nc: Client, store: KvSlotStore, buckets: dict[str, KeyValue]
) -> None:
    """The agents' and tools' stores do not follow `pulse_assignments` (an agent never judges itself)."""
    await assign(buckets, "n", "other")
    await agent(buckets, "n", warm("m", "n"))
    await wait_for(lambda: [r.key for r in store.claimable("m")] == ["m.n.s0"], 5, "offered: no binding here")
    without = {b: kv for b, kv in buckets.items() if b != protocol.ASSIGNMENTS_BUCKET}
    with pytest.raises(ValueError, match="pulse_assignments"):
        KvSlotStore(nc, without, require_assignment=True)


def test_an_assignment_is_held_to_the_contract() -> None:
    ok = {"v": 1, "node": "gpu-0", "models": ["qwen"]}
    assert protocol.decode(json.dumps(ok).encode(), NodeAssignment).key == "gpu-0"
    too_many = {**ok, "models": [f"m{i}" for i in range(protocol.MAX_MODELS_PER_NODE + 1)]}
    bad_name = {**ok, "models": ["Qwen.7b"]}
    for body, reason in ((too_many, "bad_value"), (bad_name, "bad_name")):
        with pytest.raises(BadMessage) as refused:
            protocol.decode(json.dumps(body).encode(), NodeAssignment)
        assert refused.value.reason == reason
    assert "unassigned_model" in protocol.REASONS and protocol.CONTRACT_REVISION >= 11
