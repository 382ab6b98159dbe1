"""A flood of samples against the daemon on a real nats-server: the samples' own connection, coalescing and the
drain keep the lease renewed and a claim going, and every sample published is accounted for (accepted into a
model, coalesced into a newer one, or dropped with the oldest key)."""

from __future__ import annotations

import time

from nats.aio.client import Client

from autoscaler.controller import ControllerSettings
from tests.agent_double import AgentDouble
from tests.helpers import wait_for
from tests.test_autoscaler import Gateway, put_scaler, running_autoscaler
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import QueueSample
from warmpool.registry import KvSlotStore, ensure_buckets

GATEWAYS = 300
ROUNDS = 200  # 60,000 samples: longer than a lease renewal period to fold in here


def _flood() -> list[bytes]:
    out = []
    now = time.time()
    for seq in range(1, ROUNDS + 1):
        for g in range(GATEWAYS):
            s = QueueSample(
                gateway=f"flood-{g}",
                model="m",
                seq=seq,
                ts=now + seq * 1e-3,
                queue_depth=seq % 2,  # changes every time: each folded sample asks for a decision
                inflight=0,
                arrivals_total=seq,
                completions_total=seq,
                timeouts_total=0,
            )
            out.append(protocol.encode(s))
    return out


async def test_a_flood_of_samples_costs_neither_the_lease_nor_a_claim(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    agent = await AgentDouble(nc, store, "node-0", "m", slots=4).start()
    await put_scaler(nc, "m")
    flood = _flood()
    try:
        # A buffer smaller than the flood's keys: some samples are dropped, and must be counted.
        async with running_autoscaler(nats_server.url, sample_buffer=100, controller=ControllerSettings()) as scaler:
            m = scaler.metrics
            subject = protocol.queue_subject("m")
            leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
            shard_key = protocol.shard_key(protocol.shard_of("m"))
            revision = (await leases.get(shard_key)).revision
            for data in flood:
                await nc.publish(subject, data)
            pulse = Gateway(nc, "m", "pulse")
            await pulse.send(24)  # queued behind the flood: a claim must still follow
            await nc.flush()
            # Generous bounds: the machine is shared. The lease is 1 s, renewed every 0.2 s.
            await wait_for(lambda: [r for r in store.records("m") if r.state != "warm"], 20, "a claim for the pulse")
            published = len(flood) + 1

            def counted() -> float:
                return sum(s.value for s in m.samples.collect()[0].samples if s.name.endswith("_total"))

            await wait_for(lambda: counted() == published, 30, f"{published} samples accounted for")
            by = {s.labels["outcome"]: s.value for s in m.samples.collect()[0].samples if s.name.endswith("_total")}
            assert by.get("dropped", 0) > 0, by  # the bound was reached, and said so
            assert by.get("accepted", 0) + by.get("coalesced", 0) + by["dropped"] == published, by
            assert scaler.is_leader()
            assert (await leases.get(shard_key)).revision != revision, "m's shard lease not renewed during the flood"
            assert m.lease_lost._value.get() == 0  # type: ignore[attr-defined]
    finally:
        await agent.stop()


async def test_a_lone_sample_is_folded_in_at_once(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    await put_scaler(nc, "m")
    async with running_autoscaler(nats_server.url) as scaler:
        await Gateway(nc, "m").send(3)
        await wait_for(lambda: scaler.by_model["m"].decider.demand.gateways, 5, "the sample folded in")
        assert len(scaler.samples) == 0
        assert scaler.metrics.sample("accepted")._value.get() == 1  # type: ignore[attr-defined]
