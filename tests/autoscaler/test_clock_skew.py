"""Clock skew between machines (contract revision 10), against a real nats-server.

The fault review: an agent 3 s ahead of the autoscaler (faketime) kept fresh leases, so its slots were claimed 132
times in an 8 s pulse and none became ready (each activate refused ``expired ... 0.5 s ago``: the autoscaler stamped
`expires_at` with its clock, the agent judged it with its own); 30 s either way and the node looked stale, the
pulse went to the cold path. Here the agent's clock is injected (`ShiftedClock`), never faked for the process.

What must hold: an agent 3 s or 30 s ahead of or behind the autoscaler serves like any other; a lease is fresh for
`lease_s` after it was *heard* (the reader's monotonic clock), whatever its stamp; a heartbeat stamped far off
(a broken clock, or a forgery dated an hour ahead: tests/autoscaler/test_security_autoscaler.py) is still not trusted,
and is counted; requests to an agent are stated in that agent's clock; the measured skew is shown by ``pulsescale pool``
and ``pulsescale_agent_clock_skew_seconds``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from autoscaler.act.agentclient import AgentClient
from oncall import verbs
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    cancel_gateways,
    put_scaler,
    running_autoscaler,
)
from tests.helpers import HandClock, ShiftedClock, wait_for
from tests.nodeagent_helpers import (
    MODEL,
    NODE,
    activate,
    completion,
    key,
    running_agent,
    settings,
    wait_state,
)
from warmpool import connect, protocol
from warmpool.agentclocks import SKEW_WINDOW_S, AgentClocks
from warmpool.embedded import NatsServer
from warmpool.errors import BadMessage, NoSlotAvailable
from warmpool.protocol import ActivateReply, AgentLease, DeactivateReply, PoolReply, SlotRecord
from warmpool.registry import Changed, Claim, KvSlotStore
from warmpool.rejects import Rejections

SKEWS = [-30.0, -3.0, 3.0, 30.0]
"""What the fault review saw: chrony not yet synced at boot, a VM after a suspend."""


@contextlib.asynccontextmanager
async def node_writer(url: str, skew_s: float) -> AsyncIterator[KvSlotStore]:
    """A node agent's side of the registry on its own connection, its clock `skew_s` off ours."""
    c = await connect.connect(connect.NatsOptions(servers=(url,), name="skewed-node"))
    s = await KvSlotStore.open(c, clock=ShiftedClock(skew_s))
    await s.start()
    try:
        yield s
    finally:
        await s.close()
        await c.close()


async def beat(writer: KvSlotStore, node: str = "n1", lease_s: float = 2.0) -> None:
    await writer.heartbeat(AgentLease(node=node, slots=["s0"], heartbeat_at=writer.clock(), lease_s=lease_s))


# --- the registry: freshness by arrival, skew measured ---------------------------------------------------------


@pytest.mark.parametrize("skew_s", SKEWS)
async def test_a_lease_is_fresh_for_its_lease_after_it_was_heard_whatever_the_agents_clock(
    nats_server: NatsServer, nc: Client, skew_s: float
) -> None:
    passing = ShiftedClock()  # its `monotonic`: time passing for the reader; the reader's wall clock is true
    async with node_writer(nats_server.url, skew_s) as writer:
        reader = await KvSlotStore.open(nc, monotonic=passing.monotonic)
        await reader.start()
        try:
            await writer.register(SlotRecord(model="m", node="n1", slot="s0", state="warm"))
            await beat(writer)
            await wait_for(lambda: reader.index.lease("n1") is not None and reader.record("m.n1.s0") is not None, 5)
            assert reader.index.lease_verdict("n1") == "fresh"
            assert [r.key for r in reader.claimable("m")] == ["m.n1.s0"]
            assert reader.index.clock_skew("n1") == pytest.approx(skew_s, abs=0.5)
            passing.shift = 1.9  # within its 2 s lease of when we heard it
            assert reader.index.lease_fresh("n1")
            passing.shift = 2.1  # a lease after we heard it, and no renewal: lapsed, whatever the stamp says
            assert reader.index.lease_verdict("n1") == "lapsed" and reader.claimable("m") == []
            with pytest.raises(NoSlotAvailable):
                await reader.claim("m")
            await beat(writer)  # renewed: heard now, fresh again
            await wait_for(lambda: reader.index.lease_fresh("n1"), 5, "the renewal")
            assert (await reader.claim("m")).node == "n1"
        finally:
            await reader.close()


@pytest.mark.parametrize(
    "skew_s", [-3600.0, -(protocol.MAX_TRUSTED_SKEW_S + 5), protocol.MAX_TRUSTED_SKEW_S + 5, 3600.0]
)
async def test_a_heartbeat_stamped_beyond_the_trusted_skew_is_not_offered_and_is_counted(
    nats_server: NatsServer, nc: Client, skew_s: float
) -> None:
    """The future-dated lease of the security review, and its mirror: heard, renewing, not trusted. It is not
    lapsed either (its agent did not stop), so a release of one of its slots gives it back `warm`."""
    reasons: list[str] = []
    async with node_writer(nats_server.url, skew_s) as writer:
        reader = await KvSlotStore.open(nc, on_reject=reasons.append)
        await reader.start()
        try:
            await writer.register(SlotRecord(model="m", node="n1", slot="s0", state="warm"))
            await beat(writer)
            await wait_for(lambda: reader.index.lease("n1") is not None and reader.record("m.n1.s0") is not None, 5)
            assert reader.index.lease_verdict("n1") == "skewed"
            assert reader.claimable("m") == []
            with pytest.raises(NoSlotAvailable):
                await reader.claim("m")
            with pytest.raises(NoSlotAvailable):
                await reader.claim_slot("m.n1.s0")
            assert reasons.count("clock_skew") == 1 and reader.rejected.counts["clock_skew"] == 1
            assert not reader.index.lease_lapsed("n1", time.time())
            assert reader.index.clock_skew("n1") == pytest.approx(skew_s, abs=0.5)
        finally:
            await reader.close()


@pytest.mark.parametrize("skew_s", [3.0, 30.0])
async def test_a_lease_only_listed_is_judged_by_its_stamp_until_a_heartbeat_is_heard(
    nats_server: NatsServer, nc: Client, skew_s: float
) -> None:
    """A reader that starts after the heartbeat has only the listing, not its arrival, and has not measured the
    agent's clock: its slots are not offered (a request stated in our clock could arrive expired), nor is it
    lapsed; the agent's next heartbeat is heard, and from then on it is fresh. (3 s ahead is within revision 3's
    5 s tolerance for a stamp: offered at once, that agent refused every activation until its next heartbeat.)"""
    async with node_writer(nats_server.url, skew_s) as writer:
        await writer.register(SlotRecord(model="m", node="n1", slot="s0", state="warm"))
        await beat(writer)
        reader = await KvSlotStore.open(nc)
        await reader.start()
        try:
            assert reader.index.lease("n1") is not None and reader.index.clock_skew("n1") is None
            assert reader.index.lease_verdict("n1") == "unheard" and reader.claimable("m") == []
            assert not reader.index.lease_lapsed("n1", time.time())
            await beat(writer)
            await wait_for(lambda: reader.index.lease_fresh("n1"), 5, "the next heartbeat heard")
            assert reader.index.clock_skew("n1") == pytest.approx(skew_s, abs=0.5)
        finally:
            await reader.close()


def test_the_skew_estimate_takes_the_fastest_recent_heartbeat_and_follows_steps() -> None:
    """Each heartbeat's sample is the skew less its travel: the estimate is the highest of the last
    `SKEW_WINDOW_S`, so a late delivery does not move it, a forward step shows at once, a backward one within the
    window. A listing that brings the lease we heard keeps its arrival; one that brings another lease does not."""
    wall, mono = HandClock(), HandClock(start=1000.0)
    clocks = AgentClocks(Rejections(logging.getLogger("test")), clock=wall, monotonic=mono)

    def tick(dt: float) -> None:
        wall.advance(dt)
        mono.advance(dt)

    def hear(skew_s: float, *, late_s: float = 0.0) -> AgentLease:
        lease = AgentLease(node="n", heartbeat_at=wall() + skew_s - late_s, lease_s=6.0)
        clocks.heard("n", lease)
        clocks.listed("n", lease)  # what the view does next: the same object
        return lease

    hear(3.0)
    assert clocks.skew_s("n") == pytest.approx(3.0)
    tick(2)
    hear(3.0, late_s=5.0)  # buffered through a reconnect: delivered 5 s late
    assert clocks.skew_s("n") == pytest.approx(3.0)
    tick(2)
    lease = hear(33.0)  # the agent's clock stepped forward
    assert clocks.skew_s("n") == pytest.approx(33.0)
    for _ in range(int(SKEW_WINDOW_S / 2) + 1):  # stepped back: followed once the window has passed
        tick(2)
        lease = hear(0.0)
    assert clocks.skew_s("n") == pytest.approx(0.0)
    assert clocks.judge("n", lease, wall()) == "fresh"
    same = msgspec.json.decode(msgspec.json.encode(lease), type=AgentLease)  # a re-list: equal, another object
    clocks.listed("n", same)
    mono.advance(6.5)
    assert clocks.judge("n", same, wall()) == "lapsed"  # judged by when it was heard, 6.5 s ago
    newer = AgentLease(node="n", heartbeat_at=wall() + 30.0, lease_s=6.0)  # written while we were away
    clocks.listed("n", newer)
    assert clocks.judge("n", newer, wall()) == "unheard"  # its stamp is 30 s ahead of its clock as measured
    older = AgentLease(node="n", heartbeat_at=wall() - 3.0, lease_s=6.0)
    clocks.listed("n", older)
    assert clocks.judge("n", older, wall()) == "fresh"  # by its stamp, on its clock as measured: 3 s old
    clocks.listed("n", None)
    assert clocks.skew_s("n") is None and clocks.skews() == {}


# --- the autoscaler's requests: in the agent's clock ---------------------------------------------------------------


async def test_requests_to_an_agent_are_stated_in_its_clock(nc: Client) -> None:
    got: list[Msg] = []

    async def agent(msg: Msg) -> None:
        got.append(msg)
        reply = ActivateReply() if msg.subject.endswith(".activate") else DeactivateReply()
        await msg.respond(protocol.encode(reply))

    for verb in ("activate", "deactivate"):
        await nc.subscribe(protocol.agent_subject("n1", verb), cb=agent)
    client = AgentClient(nc, skew=lambda node: 30.0 if node == "n1" else None)
    rec = SlotRecord(model="m", node="n1", slot="s0", state="claimed", claim_id="c1", token=7)
    claim = Claim(key=rec.key, token=7, claim_id="c1", revision=7, record=rec)
    t0 = time.time()
    assert (await client.activate(claim, deadline_s=2.5)).ok
    assert (await client.deactivate(claim, timeout_s=2.0)).ok
    act = protocol.decode(got[0].data, protocol.ActivateRequest)
    assert act.deadline_s == 2.5 and act.deadline == act.expires_at
    assert act.expires_at == pytest.approx(t0 + 30.0 + 2.5, abs=0.5)
    protocol.check_fresh(act, t0 + 30.0 + 0.1)  # what the agent, 30 s ahead, makes of it on arrival: fresh
    deact = protocol.decode(got[1].data, protocol.DeactivateRequest)
    assert deact.expires_at == pytest.approx(t0 + 30.0 + 2.0, abs=0.5)


@pytest.mark.parametrize("deadline_s", [0.0, -1.0, protocol.MAX_REQUEST_TTL_S + 1])
def test_an_activation_deadline_out_of_range_is_refused_by_name(deadline_s: float) -> None:
    body = {"v": 1, "id": "r1", "expires_at": 2e9, "slot": "s0", "token": 1, "claim_id": "c", "deadline": 2e9}
    with pytest.raises(BadMessage) as err:
        protocol.decode(msgspec.json.encode({**body, "deadline_s": deadline_s}), protocol.ActivateRequest)
    assert err.value.reason == "bad_value" and "`deadline_s`" in str(err.value)
    with pytest.raises(BadMessage) as err:
        protocol.decode(msgspec.json.encode({**body, "deadline_s": "soon"}), protocol.ActivateRequest)
    assert err.value.reason == "wrong_type"


# --- the agent: its own clock, and the deadline as seconds -----------------------------------------------------------


async def test_the_agent_stops_at_deadline_s_after_arrival_whatever_its_wall_clock_says(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    """An estimate of the agent's clock that is too high (the agent's clock stepped back since its last heartbeat)
    puts `deadline` late on the agent's clock; `deadline_s`, timed from arrival on its monotonic clock, still ends
    the activation when the autoscaler stops waiting. Here the slot is busy, so the activation waits for it."""
    cfg = settings(model_dir, shm_dir, nats_server.url)
    async with running_agent(cfg, clock=ShiftedClock(-30.0)) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        async with agent.slots["s0"].held("held by the test"):
            t0 = time.monotonic()
            reply = await activate(nc, claim, deadline=time.time() + 5.0, deadline_s=0.3)  # 35 s on its clock
            took_s = time.monotonic() - t0
        assert not reply.ok and reply.error is not None and reply.error.code == "deadline", reply
        assert "held by the test" in reply.error.message
        assert 0.25 <= took_s < 1.5, f"answered after {took_s:.2f} s, not at deadline_s"
        reply = await activate(nc, claim, deadline=time.time() + 5.0, deadline_s=5.0)  # free now: it serves
        assert reply.ok, reply.error


# --- end to end: a real agent whose clock is off, the autoscaler daemon, a pulse ----------------------------------


@pytest.mark.parametrize("skew_s", SKEWS)
async def test_an_agent_whose_clock_is_off_serves_a_pulse_like_any_other(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path, skew_s: float
) -> None:
    claims: list[str] = []

    async def watch() -> None:
        async for ev in store.watch():
            if isinstance(ev, Changed) and ev.record.state == "claimed":
                claims.append(ev.key)

    watcher = asyncio.create_task(watch())
    cfg = settings(model_dir, shm_dir, nats_server.url)
    try:
        async with running_agent(cfg, clock=ShiftedClock(skew_s)) as (_, agent_metrics):
            await wait_state(store, key("s0"), "warm")
            await put_scaler(nc, MODEL, maxReplicaCount=1)
            async with running_autoscaler(nats_server.url) as scaler:
                await wait_for(lambda: scaler.store.index.lease_fresh(NODE), 5, "the agent's heartbeat heard")
                pulse = Gateway(nc, MODEL).background(4, 5.0)  # one replica's worth
                await wait_for(lambda: store.record(key("s0")).state == "ready", 10, "the slot ready")  # type: ignore[union-attr]
                ready = store.record(key("s0"))
                assert ready is not None and ready.endpoint
                await completion(ready.endpoint)
                assert claims == [key("s0")], "claimed more than once: a claim loop"
                expired = agent_metrics.get_sample_value(
                    "pulsescale_agent_rejected_messages_total", {"reason": "expired"}
                )
                assert not expired, f"{expired} requests refused as expired"

                measured = scaler.metrics.registry.get_sample_value(
                    "pulsescale_agent_clock_skew_seconds", {"node": NODE}
                )
                assert measured == pytest.approx(skew_s, abs=0.5)
                body = {"v": 1, "id": uuid.uuid4().hex, "expires_at": time.time() + 5, "by": "test", "model": MODEL}
                msg = await nc.request(protocol.cmd_subject("pool"), msgspec.json.encode(body), timeout=5)
                pool = protocol.decode(msg.data, PoolReply)
                (slot,) = pool.slots
                assert slot.agent == "fresh" and slot.skew_s == pytest.approx(skew_s, abs=0.5)
                table = verbs.format_pool(pool).splitlines()
                assert table[1].split()[5] == "CLOCK" and table[2].split()[5] == verbs.format_skew(slot.skew_s)
                side = "ahead of" if skew_s > 0 else "behind"
                assert f"clock of {NODE} is {abs(slot.skew_s or 0):.1f} s {side} the autoscaler's" in "\n".join(table)
                pulse.cancel()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
