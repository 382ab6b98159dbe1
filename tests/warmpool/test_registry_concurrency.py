"""Concurrent claimers sharing one registry client: a slot whose claim is in flight is reserved locally, so a
second claimer of the same process neither tries it (a lost compare-and-set costs two round trips) nor piles
onto its node (an in-flight claim counts as load, as it would if the claims ran one after the other)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from nats.aio.client import Client

from tests.helpers import wait_for
from warmpool.errors import ClaimConflict, NoSlotAvailable
from warmpool.registry import Claim, KvSlotStore
from warmpool.seed import seed_pool


async def test_sixteen_local_claimers_get_sixteen_slots_without_a_lost_race(store: KvSlotStore) -> None:
    keys = await seed_pool(store, "m", nodes=8, slots_per_node=2, racks=2)
    for _ in range(5):  # several rounds: the draw is random, a collision is not certain in any one round
        claims = await asyncio.gather(*(store.claim("m") for _ in range(16)))
        assert sorted(c.key for c in claims) == sorted(keys)
        await asyncio.gather(*(store.release(c) for c in claims))
    assert store.claimer.claim_conflicts == 0
    assert not store.index.reserved  # every reservation was given back


async def test_in_flight_claims_count_as_load(store: KvSlotStore) -> None:
    """16 concurrent claims on 16 nodes x 4 equal slots land on 16 different nodes, as 16 claims in a row do."""
    await seed_pool(store, "m", nodes=16, slots_per_node=4, racks=4)
    for _ in range(3):
        claims = await asyncio.gather(*(store.claim("m") for _ in range(16)))
        assert Counter(c.node for c in claims).most_common(1)[0][1] == 1
        assert Counter(c.record.rack for c in claims) == {f"rack-{r}": 4 for r in range(4)}
        await asyncio.gather(*(store.release(c) for c in claims))
    assert store.claimer.claim_conflicts == 0


async def test_a_reserved_slot_taken_by_another_process_is_not_offered_again(nc: Client, store: KvSlotStore) -> None:
    """Races with other processes still go through the compare-and-set: the loser is counted and moves on, and a
    slot whose reservation ends after someone else took it stays out of the pool."""
    await seed_pool(store, "m", nodes=1, slots_per_node=2)
    async with await KvSlotStore.open(nc) as peer:
        # Seen in CI as "its agent is stale": its views went ready before they held what was written (nats-py ended
        # the watch's initial values early). `BucketView` now waits for the bucket's newest revision; kept as a check.
        await wait_for(lambda: peer.index.lease("node-0") is not None, 5, "the peer sees node-0's agent")
        await peer.claim_slot("m.node-0.s0")  # our view may not have this yet: our claim can lose the race
        outcomes: list[Claim | ClaimConflict | NoSlotAvailable] = []
        for _ in range(2):
            try:
                outcomes.append(await store.claim("m"))
            except (ClaimConflict, NoSlotAvailable) as err:
                outcomes.append(err)
        got = [o.key for o in outcomes if isinstance(o, Claim)]
        assert got == ["m.node-0.s1"]
        assert not store.index.reserved
        pool = store.index.pools["m"]
        assert pool.pick(usable=lambda node, keys: list(keys), skip=(), rng=store.rng) is None


async def test_a_named_claim_of_a_slot_whose_claim_is_in_flight_loses_at_once(store: KvSlotStore) -> None:
    """`claim_slot` (the on-call path) on a slot this process is already claiming: one of the two would lose the
    compare-and-set, so it is refused before the round trip; the claim in flight wins."""
    await seed_pool(store, "m", nodes=1, slots_per_node=1)
    first = asyncio.ensure_future(store.claim("m"))
    await asyncio.sleep(0)  # the claim is picked, reserved and sent
    assert "m.node-0.s0" in store.index.reserved
    with pytest.raises(ClaimConflict, match="being claimed by this process"):
        await store.claim_slot("m.node-0.s0")
    assert (await first).key == "m.node-0.s0"
    assert store.claimer.claim_conflicts == 0 and not store.index.reserved
