"""The agent double answers as the real agent does where the autoscaler's takeover depends on it: each request in
its own task (activations of different slots overlap), and a repeat of an activation that succeeded is answered
`ready` again. CI once saw a successor release a serving slot because the double refused such a repeat."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client

from autoscaler.act.agentclient import AgentClient
from tests.agent_double import AgentDouble
from warmpool.registry import KvSlotStore


async def test_activations_of_two_slots_overlap_and_a_repeat_is_answered_ready(nc: Client, store: KvSlotStore) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=2, activation_delay_s=0.5).start()
    client = AgentClient(nc)
    try:
        claims = [await store.claim_slot(f"m.node-0.s{i}") for i in range(2)]
        t0 = time.monotonic()
        first, second, repeat = await asyncio.gather(
            client.activate(claims[0], deadline_s=5),
            client.activate(claims[1], deadline_s=5),
            client.activate(claims[0], deadline_s=5),  # a successor finishing its predecessor's claim
        )
        took = time.monotonic() - t0
        assert first.ok and second.ok and repeat.ok, (first, second, repeat)
        assert repeat.repeated and repeat.claim_id == claims[0].claim_id and repeat.endpoint == first.endpoint
        assert took < 0.5 * 2, f"two slots' activations took {took:.2f} s: handled one after the other"
        assert [(await store.get(c.key))[0].state for c in claims] == ["ready", "ready"]
    finally:
        await agent.stop()
