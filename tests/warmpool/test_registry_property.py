"""Hypothesis-generated interleavings of claims, releases and heartbeats against one real nats-server.

Each example runs its batches of operations concurrently over three clients (three connections), then
checks the broker: no slot is held twice, and every slot is held exactly by the claim that believes it holds it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from warmpool import connect
from warmpool.embedded import NatsServer
from warmpool.errors import ClaimConflict, NoSlotAvailable
from warmpool.protocol import AgentLease, SlotRecord
from warmpool.registry import Claim, KvSlotStore

NODES = 3
SLOTS_PER_NODE = 2
SLOT_NAMES = [f"s{i}" for i in range(SLOTS_PER_NODE)]
CLIENTS = 3

claim_op = st.tuples(st.just("claim"), st.integers(0, CLIENTS - 1))
release_op = st.tuples(st.just("release"), st.integers(0, CLIENTS - 1))
heartbeat_op = st.tuples(st.just("heartbeat"), st.integers(0, NODES - 1), st.booleans())
batches = st.lists(
    st.lists(st.one_of(claim_op, release_op, heartbeat_op), min_size=1, max_size=8), min_size=1, max_size=6
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    s = NatsServer(tmp_path_factory.mktemp("nats-prop")).start()
    try:
        yield s
    finally:
        s.kill()


_models = (f"prop-{i}" for i in itertools.count())


async def scenario(url: str, model: str, plan: list[list[tuple]]) -> None:  # type: ignore[type-arg]
    conns = [await connect.connect(connect.NatsOptions(servers=(url,))) for _ in range(CLIENTS)]
    stores = [await KvSlotStore.open(c) for c in conns]
    for s in stores:
        await s.start()
    try:
        now = time.time()
        for n in range(NODES):
            await stores[0].heartbeat(AgentLease(node=f"{model}-n{n}", slots=SLOT_NAMES, heartbeat_at=now, lease_s=60))
            for i in range(SLOTS_PER_NODE):
                await stores[0].register(SlotRecord(model=model, node=f"{model}-n{n}", slot=f"s{i}", state="warm"))
        held: dict[str, Claim] = {}
        wins = [0]
        refused = [0]
        mine: list[list[Claim]] = [[] for _ in range(CLIENTS)]

        async def run(op: tuple) -> None:  # type: ignore[type-arg]
            if op[0] == "claim":
                try:
                    c = await stores[op[1]].claim(model)
                except (ClaimConflict, NoSlotAvailable):
                    refused[0] += 1
                    return
                assert c.key not in held, f"{c.key} held twice"
                wins[0] += 1
                held[c.key] = c
                mine[op[1]].append(c)
            elif op[0] == "release":
                if not mine[op[1]]:
                    return
                c = mine[op[1]].pop(0)  # taken before the await: no two ops release one claim
                await stores[op[1]].release(c)
                del held[c.key]
            else:
                alive = op[2]
                beat = time.time() if alive else time.time() - 120  # a lapsed lease
                await stores[op[1] % CLIENTS].heartbeat(
                    AgentLease(node=f"{model}-n{op[1]}", slots=SLOT_NAMES, heartbeat_at=beat, lease_s=60)
                )

        for batch in plan:
            await asyncio.gather(*(run(op) for op in batch))
            for n, i in itertools.product(range(NODES), range(SLOTS_PER_NODE)):
                key = f"{model}.{model}-n{n}.s{i}"
                rec, rev = await stores[0].get(key)
                if key in held:
                    assert rec.state == "claimed" and rec.claim_id == held[key].claim_id
                    assert rev == held[key].token
                else:
                    assert rec.state == "warm" and rec.claim_id is None
        claims = sum(op[0] == "claim" for batch in plan for op in batch)
        assert wins[0] + refused[0] == claims
        if claims:
            # The first claim of a run always finds a free slot (6 slots, all warm, leases fresh at the start).
            assert wins[0] >= 1
    finally:
        for s in stores:
            await s.close()
        for c in conns:
            await c.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=batches)
def test_interleavings_never_hold_a_slot_twice(server: NatsServer, plan: list[list[tuple]]) -> None:  # type: ignore[type-arg]
    asyncio.run(scenario(server.url, next(_models), plan))
