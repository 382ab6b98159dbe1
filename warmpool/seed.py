"""Populate a registry with warm slots and fresh agent leases, without running agents.

For benchmarks, the simulator and tests that exercise the claim path on its own. The records are exactly what
an agent writes after staging, so everything downstream sees a real pool.
"""

from __future__ import annotations

from warmpool.protocol import MAX_LEASE_S, AgentLease, SlotRecord
from warmpool.registry import KvSlotStore

__all__ = ["seed_pool"]


async def seed_pool(
    store: KvSlotStore,
    model: str,
    *,
    nodes: int,
    slots_per_node: int,
    racks: int = 1,
    lease_s: float = MAX_LEASE_S,
    node_prefix: str = "node",
) -> list[str]:
    """Register `nodes` x `slots_per_node` warm slots of `model`; returns their keys. Nothing renews the leases:
    they stay fresh for `lease_s` (by default the longest a reader honours, `protocol.MAX_LEASE_S`), which covers
    a benchmark or a test; a longer run re-seeds."""
    now = store.clock()
    keys = []
    for n in range(nodes):
        node = f"{node_prefix}-{n}"
        rack = f"rack-{n % racks}"
        names = [f"s{i}" for i in range(slots_per_node)]
        await store.heartbeat(AgentLease(node=node, slots=names, heartbeat_at=now, lease_s=lease_s, rack=rack))
        for name in names:
            rec = SlotRecord(
                model=model,
                node=node,
                slot=name,
                state="warm",
                rack=rack,
                weights_resident=True,
                rootfs_mounted=True,
                updated_at=now,
            )
            await store.register(rec)
            keys.append(rec.key)
    return keys
