"""The autoscaler under faults, against a real nats-server: broker outages, dead agents, agents that refuse,
corrupt records in the buckets. Agents are the protocol-level double (tests/agent_double.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client

from autoscaler.shards.leader import LeaseSettings
from tests.agent_double import AgentDouble
from tests.autoscaler.test_autoscaler import (  # noqa: F401 - cancel_gateways is an autouse fixture
    Gateway,
    cancel_gateways,
    collect_events,
    put_scaler,
    running_autoscaler,
    spec,
)
from tests.helpers import broker_subscriptions, wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import Override, OverrideRecord, ScalerRecord
from warmpool.registry import KvSlotStore, Snapshot, ensure_buckets


def ready_claims(store: KvSlotStore, model: str) -> dict[str, str | None]:
    return {r.key: r.claim_id for r in store.records(model) if r.state == "ready"}


async def broker_claims(store: KvSlotStore, keys: list[str]) -> dict[str, tuple[str, str | None]] | None:
    """(state, claim_id) of each key read from the broker, or None while it cannot answer."""
    try:
        return {key: ((rec := (await store.get(key))[0]).state, rec.claim_id) for key in keys}
    except Exception:
        return None


# --- broker outage (issue 7, section 2) ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "leader_lease_s",
    [
        pytest.param(10.0, id="leader-keeps-its-lease"),
        pytest.param(1.0, id="leader-lease-lapses-and-is-taken-again"),
    ],
)
async def test_a_broker_outage_longer_than_the_agent_lease_takes_no_serving_slot_out_of_service(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, leader_lease_s: float
) -> None:
    """Agents renew every 0.3 s a lease of 1 s; the broker is gone for 3 s. When it is back, every agent's last
    heartbeat in the view is 3 s old until the agents view has re-listed and the agents have renewed: no serving
    slot may be judged dead from that."""
    quick = {"lease_s": 1.0, "heartbeat_every_s": 0.3}
    agents = [await AgentDouble(nc, store, f"node-{i}", "m", slots=2, rack=f"r{i}", **quick).start() for i in range(2)]
    await put_scaler(nc, "m")
    events = await collect_events(nc, "m")
    lease = LeaseSettings(lease_s=leader_lease_s, renew_every_s=leader_lease_s / 5)
    try:
        async with running_autoscaler(nats_server.url, lease=lease, housekeeping_every_s=0.05) as scaler:
            Gateway(nc, "m").background(8, 30.0)  # two replicas
            await wait_for(lambda: "m" in scaler.fleet.by_model, 5, "m followed")
            controller = scaler.fleet.by_model["m"]
            # Ready in the registry and in the autoscaler's books (its activations answered, not still in flight).
            await wait_for(lambda: len(ready_claims(store, "m")) == 2 and controller.scaler.ready == 2, 5, "2 ready")
            serving = ready_claims(store, "m")
            keys = sorted(serving)
            released_while_away: list[str] = []

            async def watch_books() -> None:
                while True:
                    released_while_away.extend(k for k, h in controller.scaler.held.items() if h.phase == "releasing")
                    await asyncio.sleep(0.01)

            books = asyncio.create_task(watch_books())
            nats_server.kill()
            await asyncio.sleep(3.0)
            nats_server.restart()
            back = time.monotonic()
            checks = 0
            while time.monotonic() - back < 4.0:  # several agent leases and heartbeat intervals after the return
                now = await broker_claims(store, keys)
                if now is not None:
                    checks += 1
                    assert now == {k: ("ready", serving[k]) for k in keys}, f"a serving slot was taken out: {now}"
                await asyncio.sleep(0.1)
            books.cancel()
            assert checks >= 10, "the broker never answered after its restart"
            assert not released_while_away, f"the autoscaler started releasing {set(released_while_away)}"
            assert not [e for e in events if e.type in ("slot.released", "slot.failed")]
    finally:
        for a in agents:
            await a.stop()


async def test_a_dead_agent_is_still_replaced(nats_server: NatsServer, nc: Client, store: KvSlotStore) -> None:
    a = await AgentDouble(nc, store, "node-a", "m", slots=1, lease_s=1.0, heartbeat_every_s=0.3).start()
    b = await AgentDouble(nc, store, "node-b", "m", slots=1, resident=False, lease_s=1.0, heartbeat_every_s=0.3).start()
    await put_scaler(nc, "m")
    try:
        async with running_autoscaler(nats_server.url):
            Gateway(nc, "m").background(4, 30.0)  # one replica
            await wait_for(lambda: ready_claims(store, "m").keys() == {"m.node-a.s0"}, 5, "node-a's slot ready")
            a.stop_heartbeat()  # node-a dies to the registry (its engine would keep answering)
            await wait_for(lambda: ready_claims(store, "m").keys() == {"m.node-b.s0"}, 6, "node-b's slot ready")
            dead = store.record("m.node-a.s0")
            assert dead is not None and dead.state == "failed", "released as warm although its agent is gone"
    finally:
        await a.stop()
        await b.stop()


# --- on-call commands after a broker restart -------------------------------------------------------------------------

RESTART_OUTAGE_S = 2.5
"""Longer than a shard term without renewals (``lease_s * stop_fraction``, 1.6 s) and than the lease itself (2 s):
the autoscaler loses every shard while the broker is gone and takes them all again once it is back."""


def command_subscriptions(nats_server: NatsServer) -> Counter[tuple[str, str]]:
    """The broker's subscriptions on command subjects for the autoscaler's connection (`running_autoscaler`'s)."""
    subs = broker_subscriptions(nats_server, "test-autoscaler")
    return Counter({s: n for s, n in subs.items() if ".cmd." in s[0]})


def oncall_commands(model: str) -> list[protocol.Command]:
    """One of every verb, as the CLI sends it; every one must be answered."""
    exp = time.time() + 10

    def ids() -> str:
        return uuid.uuid4().hex

    return [
        protocol.StatusCommand(id=ids(), expires_at=exp, by="test"),
        protocol.ScaleCommand(id=ids(), expires_at=exp, by="test", model=model, replicas=2, for_s=60.0),
        protocol.PauseCommand(id=ids(), expires_at=exp, by="test", model=model),
        protocol.StatusCommand(id=ids(), expires_at=exp, by="test", model=model),
        protocol.ResumeCommand(id=ids(), expires_at=exp, by="test", model=model),
        protocol.PoolCommand(id=ids(), expires_at=exp, by="test"),
        protocol.DrainCommand(id=ids(), expires_at=exp, by="test", node="node-x"),
        protocol.UndrainCommand(id=ids(), expires_at=exp, by="test", node="node-x"),
    ]


@pytest.mark.slow
@pytest.mark.serial  # "answered within 1 s of convergence" is a wall-clock bound: run alone (tests/conftest.py)
async def test_every_oncall_command_is_answered_after_each_broker_restart(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """Three broker restarts, each longer than a shard term: the autoscaler loses its shards while the broker is
    gone and takes them again. Within 1 s of its views re-listing and every shard held again, every on-call verb
    is answered, and the broker holds exactly one subscription per command subject for it. (nats-py replays on
    reconnect a subscription made, and dropped, while it reconnected: the queue group had a second member nobody
    read, and every other command went unanswered.)"""
    await put_scaler(nc, "m")
    verbs = {t: v for v, t in protocol.COMMAND_TYPES.items()}
    async with running_autoscaler(nats_server.url, lease=LeaseSettings()) as scaler:
        shards, service = scaler.fleet.shards, scaler.fleet.commands
        assert shards is not None and service is not None
        own = protocol.replica_subject(shards.identity, "*")  # the hand-over subject, no queue group
        expected = Counter({(protocol.CMD_WILDCARD, service.settings.queue_group): 1, (own, ""): 1})
        assert command_subscriptions(nats_server) == expected

        def converged() -> bool:
            views = (scaler.store.slots, scaler.store.agents, scaler.scalers)
            return all(v.current() for v in views) and len(shards.held()) == protocol.SHARDS

        for run in range(3):
            nats_server.kill()
            await asyncio.sleep(RESTART_OUTAGE_S)
            assert not scaler.fleet.holds_shards(), "the shard terms outlived the outage"
            nats_server.restart()
            await wait_for(converged, 10, "views re-listed and every shard held again")
            deadline = time.monotonic() + 1.0
            while True:  # the first answer within 1 s of convergence (no responders: ask again)
                req = protocol.StatusCommand(id=uuid.uuid4().hex, expires_at=time.time() + 10, by="test")
                left = deadline - time.monotonic()
                assert left > 0, f"restart {run}: no answer within 1 s of convergence"
                try:
                    msg = await nc.request(protocol.cmd_subject("status"), protocol.encode(req), timeout=left)
                    break
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    await asyncio.sleep(0.05)
            assert msgspec.json.decode(msg.data)["ok"], msg.data
            for cmd in [*oncall_commands("m"), *oncall_commands("m")]:
                verb = verbs[type(cmd)]
                try:
                    msg = await nc.request(protocol.cmd_subject(verb), protocol.encode(cmd), timeout=1.0)
                except nats.errors.Error as err:
                    raise AssertionError(f"restart {run}: {verb} went unanswered ({err!r})") from err
                reply = msgspec.json.decode(msg.data)
                if verb in ("drain", "undrain"):
                    assert reply["error"]["code"] == "unknown_node", reply
                else:
                    assert reply["ok"], (verb, reply)
            assert command_subscriptions(nats_server) == expected, f"restart {run}"


# --- status counts only claimable slots as warm (issue 7, section 2) -------------------------------------------------


async def test_status_counts_warm_slots_of_a_stale_agent_as_stale(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    live = await AgentDouble(nc, store, "live", "m", slots=2, lease_s=1.0, heartbeat_every_s=0.3).start()
    gone = await AgentDouble(nc, store, "gone", "m", slots=3, lease_s=1.0, heartbeat_every_s=0.3).start()
    await put_scaler(nc, "m")
    try:
        async with running_autoscaler(nats_server.url) as scaler:
            gone.stop_heartbeat()
            rows: list[protocol.StatusRow] = []

            async def counted_stale() -> bool:
                """The autoscaler's own view judges the lease (lease_s after it heard the last heartbeat, on its
                monotonic clock: revision 10), a few ms after this test's store does: asked until it says so."""
                req = protocol.StatusCommand(id=uuid.uuid4().hex, expires_at=time.time() + 5, by="test", model="m")
                msg = await nc.request(protocol.cmd_subject("status"), protocol.encode(req), timeout=5)
                reply = protocol.decode(msg.data, protocol.StatusReply)
                assert reply.ok, reply.error
                rows[:] = reply.models
                return (rows[0].warm, rows[0].stale) == (2, 3)

            await wait_for(counted_stale, 5, "the gone agent's 3 warm slots counted stale, the live one's 2 warm")
            assert scaler.status("m")[0] == rows[0]
    finally:
        await live.stop()
        await gone.stop()


# --- what an agent's refusal code means ------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["stale_token", "foreign_claim"])
async def test_a_claim_the_agent_calls_gone_is_dropped_not_released(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, code: str
) -> None:
    """`stale_token` / `foreign_claim`: a newer claim holds the slot. Ours holds nothing: no release as holder
    (which could only fail or, worse, undo the other claim's work); the next slot is claimed."""
    refusing = await AgentDouble(nc, store, "refusing", "m", slots=1, behaviour="refuse", refuse_code=code).start()
    fine = await AgentDouble(nc, store, "fine", "m", slots=1, resident=False).start()
    await put_scaler(nc, "m")
    events = await collect_events(nc, "m")
    try:
        async with running_autoscaler(nats_server.url):
            await Gateway(nc, "m").send(4)
            await wait_for(lambda: ready_claims(store, "m").keys() == {"m.fine.s0"}, 5, "the next slot ready")
            refused = store.record("m.refusing.s0")
            assert refused is not None and refused.state == "claimed", "released although the agent said it is gone"
            failed = [e for e in events if e.type == "slot.failed"]
            assert failed and failed[0].node == "refusing" and code in (failed[0].reason or "")
            assert not [e for e in events if e.type == "slot.released"]
    finally:
        await refusing.stop()
        await fine.stop()


@pytest.mark.parametrize("code", ["engine_failed", "deadline", "not_ready", "slot_unavailable"])
async def test_a_failed_activation_is_released_and_the_next_slot_claimed(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, code: str
) -> None:
    refusing = await AgentDouble(nc, store, "refusing", "m", slots=1, behaviour="refuse", refuse_code=code).start()
    fine = await AgentDouble(nc, store, "fine", "m", slots=1, resident=False).start()
    await put_scaler(nc, "m")
    events = await collect_events(nc, "m")
    try:
        async with running_autoscaler(nats_server.url):
            await Gateway(nc, "m").send(4)
            await wait_for(lambda: ready_claims(store, "m").keys() == {"m.fine.s0"}, 5, "the next slot ready")
            await wait_for(lambda: any(e.type == "slot.released" and e.node == "refusing" for e in events), 3)
            refused = store.record("m.refusing.s0")
            assert refused is not None and refused.state == "warm" and refused.claim_id is None
    finally:
        await refusing.stop()
        await fine.stop()


# --- stored overrides ---------------------------------------------------------------------------------------------


async def test_overrides_are_stored_as_records_and_a_corrupt_one_is_counted(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    for model in ("m", "n", "k"):
        await put_scaler(nc, model)
    paused = Override(kind="pause", replicas=1, expires_at=None, by="carol")
    await leases.put(protocol.override_key("n"), protocol.encode(OverrideRecord(model="n", override=paused)))
    await leases.put(protocol.override_key("m"), b"{not json")
    # A record of another model under m's key (a hand edit gone wrong): not applied to either.
    await leases.put(protocol.override_key("k"), protocol.encode(OverrideRecord(model="n", override=paused)))
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(
            lambda: scaler.fleet.by_model.get("n") and scaler.fleet.by_model["n"].override == paused, 5, "n restored"
        )
        assert scaler.fleet.by_model["m"].override is None and scaler.fleet.by_model["k"].override is None
        rejected = scaler.metrics.registry.get_sample_value
        assert rejected("pulsescale_registry_rejected_records_total", {"reason": "bad_json"}) == 1
        assert rejected("pulsescale_registry_rejected_records_total", {"reason": "subject_mismatch"}) == 1
        await scaler.overrides.load()  # read again (another shard taken later): the same records, not counted again
        assert rejected("pulsescale_registry_rejected_records_total", {"reason": "bad_json"}) == 1

        held = Override(kind="scale", replicas=2, expires_at=time.time() + 60, by="dave")
        await scaler.set_override("m", held)
        stored = protocol.decode((await leases.get(protocol.override_key("m"))).value or b"", OverrideRecord)
        assert stored == OverrideRecord(model="m", override=held)
        await scaler.set_override("m", None)
        assert await scaler.overrides.load() == {"n": paused}


async def test_an_override_is_restored_for_a_scaled_object_seen_after_its_shard_was_taken(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """At start the shard leases may be taken before the ScaledObjects are listed (CI saw that order under load):
    a model whose ScaledObject arrives in a shard already held gets its stored override too, not the policy."""
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    paused = Override(kind="pause", replicas=1, expires_at=None, by="carol")
    await leases.put(protocol.override_key("n"), protocol.encode(OverrideRecord(model="n", override=paused)))
    async with running_autoscaler(nats_server.url) as scaler:  # leads every shard, follows no model yet
        assert scaler.fleet.owns_shard(protocol.shard_of("n")) and "n" not in scaler.fleet.by_model
        await put_scaler(nc, "n")
        await wait_for(lambda: "n" in scaler.fleet.by_model, 5, "n followed")
        await wait_for(lambda: scaler.fleet.by_model["n"].override == paused, 5, "n's stored pause restored")


async def test_a_resume_while_the_stored_overrides_are_read_is_not_undone(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    """On-call resumes a model whose stored pause `take_over` has just read: the resume stands (it is newer)."""
    leases = (await ensure_buckets(nc.jetstream()))[protocol.LEASES_BUCKET]
    paused = Override(kind="pause", replicas=1, expires_at=None, by="carol")
    await leases.put(protocol.override_key("n"), protocol.encode(OverrideRecord(model="n", override=paused)))
    async with running_autoscaler(nats_server.url) as scaler:
        read, go_on = asyncio.Event(), asyncio.Event()
        ownership, load = scaler.ownership, scaler.overrides.load

        async def slow_load() -> dict[str, Override]:
            found = await load()
            read.set()
            await go_on.wait()  # the read is done; the resume lands before it is applied
            return found

        scaler.overrides.load = slow_load  # type: ignore[method-assign]
        await put_scaler(nc, "n")
        await asyncio.wait_for(read.wait(), 5)
        await scaler.set_override("n", None)  # the resume, deleting the stored pause
        go_on.set()
        await wait_for(lambda: ownership._takeover is not None and ownership._takeover.done(), 5, "n taken over")
        assert scaler.fleet.by_model["n"].override is None, "the stale pause was put back over the resume"


# --- following the ScaledObjects --------------------------------------------------------------------------------


async def test_a_bad_edit_of_a_scaled_object_keeps_the_last_good_one(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    scalers = (await ensure_buckets(nc.jetstream()))[protocol.SCALERS_BUCKET]
    await put_scaler(nc, "m", maxReplicaCount=2)
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(lambda: "m" in scaler.fleet.by_model, 5, "m followed")
        await scalers.put("test.m", b'{"v": 1, "namespace": "test"}')
        count = scaler.metrics.registry.get_sample_value
        await wait_for(lambda: count("pulsescale_registry_rejected_records_total", {"reason": "missing_field"}), 3)
        await asyncio.sleep(0.1)
        assert scaler.fleet.by_model["m"].spec.max_replica_count == 2, "the last good ScaledObject stands"
        await put_scaler(nc, "m", maxReplicaCount=3)
        await wait_for(lambda: scaler.fleet.by_model["m"].spec.max_replica_count == 3, 3, "the next good edit applied")


async def test_a_relisting_drops_scaled_objects_deleted_meanwhile(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    await put_scaler(nc, "m")
    await put_scaler(nc, "n")
    async with running_autoscaler(nats_server.url) as scaler:
        await wait_for(lambda: set(scaler.fleet.by_model) == {"m", "n"}, 5, "both followed")
        assert scaler.ready()
        # What the view hands over after a reconnect when test.n was deleted while we were away.
        kept = ScalerRecord(namespace="test", name="m", spec=spec("m", maxReplicaCount=4))
        scaler.apply_scalers_event(Snapshot({"test.m": kept}))
        assert set(scaler.fleet.by_model) == {"m"}
        assert scaler.fleet.by_model["m"].spec.max_replica_count == 4


async def test_a_slot_record_that_breaks_the_contract_is_counted(
    nats_server: NatsServer, nc: Client, store: KvSlotStore
) -> None:
    slots = (await ensure_buckets(nc.jetstream()))[protocol.SLOTS_BUCKET]
    async with running_autoscaler(nats_server.url) as scaler:
        bad = msgspec.json.encode({"v": 1, "model": "m", "node": "x", "slot": "s0", "state": "sleepy"})
        await slots.put("m.x.s0", bad)
        count = scaler.metrics.registry.get_sample_value
        await wait_for(lambda: count("pulsescale_registry_rejected_records_total", {"reason": "bad_value"}), 3)
        assert scaler.store.record("m.x.s0") is None
