"""The agent end to end: real nats-server, the agent's `run`, real zygotes and engines, real HTTP and /dev/shm."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client

from nodeagent import agent as agent_mod
from nodeagent import modelformat, tinymodel
from tests.helpers import ShiftedClock
from tests.nodeagent_helpers import (
    MODEL,
    NODE,
    activate,
    alive,
    completion,
    deactivate,
    key,
    request,
    running_agent,
    settings,
    state,
    wait_for,
    wait_state,
)
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.errors import PulsescaleError
from warmpool.registry import KvSlotStore


def flip_a_byte(model_dir: Path) -> Path:
    victim = sorted(model_dir.glob("*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[100] ^= 0x01
    victim.write_bytes(bytes(data))
    return victim


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


async def test_activate_ready_deactivate_warm_and_again_without_restaging(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, slots=2, rack="r1")
    async with running_agent(cfg) as (agent, registry):
        for slot in ("s0", "s1"):
            rec = await wait_state(store, key(slot), "warm")
            assert rec.weights_resident and rec.rack == "r1"
        await wait_for(lambda: store.index.lease(NODE) is not None, 5, "the lease")
        lease = store.index.lease(NODE)
        assert lease is not None and lease.slots == ["s0", "s1"] and lease.shm_free_bytes > 0
        assert lease.heartbeat_every_s == cfg.heartbeat_interval_s  # readers judge leases after an outage by it
        staged_at = agent.staged.staged_at if agent.staged else None
        zygote = agent.slots["s0"].engine.zygote_pid if agent.slots["s0"].engine else None
        staged_files = digests(shm_dir / MODEL)

        endpoints = []
        for _ in range(2):
            claim = await store.claim_slot(key("s0"))
            reply = await activate(nc, claim)
            assert reply.ok, reply.error
            endpoint = reply.fields["endpoint"]
            endpoints.append(endpoint)
            timings = protocol.StageTimings(**reply.fields["timings"])
            assert 0 < timings.load_ms < timings.total_ms and timings.readiness_ms > 0 and timings.token_ms > 0
            rec = await wait_state(store, key("s0"), "ready")  # our view of the registry catches up
            assert rec.endpoint == endpoint
            assert rec.claim_id == claim.claim_id and rec.token == claim.token
            out = await completion(endpoint)
            assert out["object"] == "text_completion"
            # A repeat of the same activation (a retry) is answered with the same endpoint, not a second engine.
            again = await activate(nc, claim)
            assert again.ok and again.fields["endpoint"] == endpoint and again.fields["repeated"]

            reply = await deactivate(nc, claim)
            assert reply.ok and reply.fields["state"] == "warm", reply
            rec = await wait_state(store, key("s0"), "warm")
            assert rec.claim_id is None and rec.endpoint is None
            try:
                await completion(endpoint)
                raise AssertionError("the engine still serves after deactivation")
            except aiohttp.ClientError:
                pass
        # Activated twice from one staging and one zygote: nothing was staged or imported again.
        assert agent.staged is not None and agent.staged.staged_at == staged_at
        assert agent.slots["s0"].engine is not None and agent.slots["s0"].engine.zygote_pid == zygote
        assert digests(shm_dir / MODEL) == staged_files
        assert registry.get_sample_value("pulsescale_agent_activation_seconds_count", {"stage": "total"}) == 2
        assert registry.get_sample_value("pulsescale_agent_activations_total", {"outcome": "ready"}) == 2
        assert registry.get_sample_value("pulsescale_agent_slots", {"state": "warm"}) == 2
        locked = registry.get_sample_value("pulsescale_agent_weights_locked_bytes")
        assert locked is not None and locked > 0

        status = await request(nc, "status")
        assert status.ok and status.fields["node"] == NODE
        weights = status.fields["weights"]
        assert weights["locked"] and weights["locked_bytes"] == locked and weights["lock_error"] is None
        s0 = status.fields["slots"][0]
        assert s0["activations"] == 2 and s0["state"] == "warm" and s0["engine"]["armed"]
        assert set(s0["last_timings"]) == {"token_ms", "load_ms", "engine_ms", "readiness_ms", "total_ms"}


async def test_fencing_refuses_stale_tokens_and_foreign_claims(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (_agent, registry):
        await wait_state(store, key("s0"), "warm")
        old = await store.claim_slot(key("s0"))
        await store.release(old)
        await wait_state(store, key("s0"), "warm")
        # A released claim: its token no longer holds the slot.
        reply = await activate(nc, old)
        assert not reply.ok and reply.error is not None and reply.error.code == "stale_token", reply

        claim = await store.claim_slot(key("s0"))
        foreign = dataclasses.replace(claim, claim_id="not-the-claimer")
        reply = await activate(nc, foreign)
        assert not reply.ok and reply.error is not None and reply.error.code == "foreign_claim", reply
        reply = await request(nc, "activate", slot="s0", token=claim.token + 100, claim_id=claim.claim_id)
        assert not reply.ok and reply.error is not None and reply.error.code in ("stale_token", "foreign_claim")

        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        # Lower than the highest token seen: refused without even asking the registry.
        reply = await activate(nc, old)
        assert not reply.ok and reply.error is not None and reply.error.code == "stale_token"
        assert "lower than" in reply.error.message
        reply = await deactivate(nc, old)
        assert not reply.ok and reply.error is not None and reply.error.code == "stale_token"
        rec = await wait_state(store, key("s0"), "ready")
        assert rec.claim_id == claim.claim_id  # none of that disturbed the holder

        # Bad messages are answered, counted by reason, and the agent keeps serving.
        subject = protocol.agent_subject(NODE, "activate")
        v2 = b'{"v": 2, "id": "x", "expires_at": 9e9, "slot": "s0", "token": 1, "claim_id": "c", "deadline": 9e9}'
        for data in (b"not json", v2, b'{"v": 1, "id": "x", "expires_at": 1, "slot": "s0"}'):
            msg = await nc.request(subject, data, timeout=5)
            assert protocol.decode_reply(msg.data).error is not None
        assert registry.get_sample_value("pulsescale_agent_rejected_messages_total", {"reason": "bad_json"}) == 1
        assert registry.get_sample_value("pulsescale_agent_rejected_messages_total", {"reason": "bad_version"}) == 1
        assert registry.get_sample_value("pulsescale_agent_rejected_messages_total", {"reason": "missing_field"}) == 1
        expired = await request(nc, "status", expires_at=time.time() - 1)
        assert expired.error is not None and "expired" in expired.error.message
        reply = await request(nc, "activate", slot="s9", token=1, claim_id="x")
        assert reply.error is not None and reply.error.code == "unknown_slot"
        # An id already applied is answered with its first reply, not applied again.
        body = {"v": 1, "id": "once", "expires_at": time.time() + 30}
        first = await nc.request(protocol.agent_subject(NODE, "status"), protocol._encoder.encode(body), timeout=5)
        second = await nc.request(protocol.agent_subject(NODE, "status"), protocol._encoder.encode(body), timeout=5)
        assert first.data == second.data
        assert (await deactivate(nc, claim)).ok


async def test_engine_faults_end_in_clear_failures_and_other_slots_keep_serving(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, slots=3, faults={"s1": "crash", "s2": "hang"})
    async with running_agent(cfg) as (_agent, registry):
        for slot in ("s0", "s1", "s2"):
            await wait_state(store, key(slot), "warm")
        staged = digests(shm_dir / MODEL)

        crash = await store.claim_slot(key("s1"))
        reply = await activate(nc, crash)
        assert not reply.ok and reply.error is not None and reply.error.code == "engine_failed"
        assert "SIGABRT" in reply.error.message and reply.fields["state"] == "warm"
        rec = await wait_state(store, key("s1"), "warm")
        assert rec.claim_id is None and rec.reason is not None and "SIGABRT" in rec.reason

        hang = await store.claim_slot(key("s2"))
        t0 = time.time()
        reply = await activate(nc, hang, deadline=t0 + 0.8)
        assert time.time() - t0 < 3
        assert not reply.ok and reply.error is not None and reply.error.code == "deadline", reply
        rec = await wait_state(store, key("s2"), "warm")
        assert rec.reason is not None and "not serving after" in rec.reason

        good = await store.claim_slot(key("s0"))  # the agent keeps serving its other slots
        reply = await activate(nc, good)
        assert reply.ok, reply.error
        await completion(reply.fields["endpoint"])

        # A slot that keeps crashing is quarantined, with the reason, instead of eating every claim.
        for _ in range(2):
            await wait_state(store, key("s1"), "warm")
            claim = await store.claim_slot(key("s1"))
            reply = await activate(nc, claim)
            assert not reply.ok
        rec = await wait_state(store, key("s1"), "failed")
        assert rec.reason is not None and "3 activations in a row failed" in rec.reason and "SIGABRT" in rec.reason
        assert registry.get_sample_value("pulsescale_agent_activations_total", {"outcome": "failed"}) == 3
        assert registry.get_sample_value("pulsescale_agent_activations_total", {"outcome": "deadline"}) == 1
        assert digests(shm_dir / MODEL) == staged  # nothing staged is lost
        rec = await wait_state(store, key("s0"), "ready")
        assert rec.claim_id == good.claim_id
        assert (await deactivate(nc, good)).ok


async def test_corrupt_weights_fail_the_slots_with_the_file_named_and_prewarm_recovers(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path, tiny_source: Path
) -> None:
    victim = flip_a_byte(model_dir)
    async with running_agent(settings(model_dir, shm_dir, nats_server.url, slots=2)) as _:
        for slot in ("s0", "s1"):
            rec = await wait_state(store, key(slot), "failed")
            assert rec.reason is not None and victim.name in rec.reason and "sha256 mismatch" in rec.reason
        status = await request(nc, "status")
        assert status.ok and victim.name in status.fields["weights"]["error"]
        claim_attempt = await request(nc, "activate", slot="s0", token=1, claim_id="x")
        assert not claim_attempt.ok  # refused, the daemon lives on

        victim.write_bytes((tiny_source / victim.name).read_bytes())  # the operator fixes the model
        reply = await request(nc, "prewarm")
        assert reply.ok and reply.fields["accepted"] == ["s0", "s1"]
        for slot in ("s0", "s1"):
            rec = await wait_state(store, key(slot), "warm")
            assert rec.reason is None and rec.weights_resident
        claim = await store.claim_slot(key("s1"))
        assert (await activate(nc, claim)).ok


async def test_a_claim_released_elsewhere_stops_its_engine(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok
        active = agent.slots["s0"].active
        assert active is not None
        pid = active.started.pid
        _, rev = await store.get(key("s0"))
        claim = dataclasses.replace(claim, revision=rev, record=(await store.get(key("s0")))[0])
        await store.release(claim, reason="scaled down")  # the autoscaler releases without a deactivate
        await wait_for(lambda: not alive(pid), 10, "the fenced engine to stop")
        assert agent.slots["s0"].active is None
        await wait_state(store, key("s0"), "warm")
        # And the slot activates again for the next claimer.
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok


async def test_an_engine_that_dies_while_serving_fails_its_claim_and_the_slot_comes_back(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok
        active = agent.slots["s0"].active
        assert active is not None
        os.kill(active.started.pid, signal.SIGKILL)
        await wait_for(
            lambda: (r := state(store, key("s0"))) is not None and r.state in ("failed", "warm") and r.claim_id is None,
            10,
            "the claim to be failed",
        )
        rec = await wait_state(store, key("s0"), "warm")
        assert rec.claim_id is None
        assert registry.get_sample_value("pulsescale_agent_engine_unexpected_exits_total") == 1
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok


def test_make_tiny_sizes_span_small_to_large(tmp_path: Path) -> None:
    assert tinymodel.plan(1_000_000).nbytes < 1_100_000
    big = tinymodel.plan(8 * 10**9)
    assert abs(big.nbytes - 8 * 10**9) / 8e9 < 0.01 and big.layers * big.experts * big.dim**2 * 4 < 8 * 10**9


def _corrupt_last_shard(model_dir: Path) -> Path:
    shard = sorted(model_dir.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x00")
    return shard


def _deeply_nested_header(model_dir: Path) -> Path:
    """A first shard whose header nests too deeply for the JSON parser, with a manifest that agrees."""
    victim = sorted(model_dir.glob("*.safetensors"))[0]
    raw = b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    victim.write_bytes(len(raw).to_bytes(8, "little") + raw)
    sums = modelformat.read_manifest(model_dir)
    sums[victim.name] = hashlib.sha256(victim.read_bytes()).hexdigest()
    modelformat.write_manifest(model_dir, sums)
    return victim


def _rewrite_model(model_dir: Path, **kw: int) -> None:
    for p in model_dir.iterdir():
        p.unlink()
    tinymodel.make_tiny(model_dir, 1_000_000, **{"shard_bytes": 600_000, **kw})


async def test_a_failed_restage_keeps_serving_the_complete_old_version(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url, slots=2)) as (agent, _):
        for slot in ("s0", "s1"):
            await wait_state(store, key(slot), "warm")
        v1, staged_v1 = digests(shm_dir / MODEL), agent.staged
        first = await store.claim_slot(key("s0"))
        reply = await activate(nc, first)
        assert reply.ok, reply.error
        answer = await completion(reply.fields["endpoint"])

        _rewrite_model(model_dir, seed=1)  # v2, whose second shard arrives corrupt
        shard2 = _corrupt_last_shard(model_dir)
        reply = await request(nc, "prewarm")
        assert reply.ok and reply.fields["skipped_serving"] == ["s0"]
        rec = await wait_state(store, key("s1"), "failed")
        assert rec.reason is not None and shard2.name in rec.reason and "sha256 mismatch" in rec.reason
        assert digests(shm_dir / MODEL) == v1 and agent.staged is staged_v1  # no v1/v2 mix, old set kept
        assert agent.locked is not None and agent.locked.mapped_bytes == staged_v1.weights_bytes

        assert (await deactivate(nc, first)).ok
        # The agent answers once it wrote `warm`; this store's view may not have seen that write yet.
        await wait_state(store, key("s0"), "warm")
        again = await store.claim_slot(key("s0"))
        reply = await activate(nc, again)
        assert reply.ok, reply.error
        assert (await completion(reply.fields["endpoint"]))["choices"] == answer["choices"]  # the same weights

        # The operator fixes v2: it is staged, and the serving slot's zygote is re-armed for it once released.
        _rewrite_model(model_dir, seed=1)
        assert (await request(nc, "prewarm")).ok
        await wait_state(store, key("s1"), "warm")
        assert agent.staged is not None and agent.staged.version != staged_v1.version
        assert digests(shm_dir / MODEL) == modelformat.read_manifest(model_dir)
        assert (await deactivate(nc, again)).ok
        engine = agent.slots["s0"].engine
        assert engine is not None and engine.spec["version"] == agent.staged.version and engine.armed


def _children(pid: int) -> str:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return f.read().strip()


async def test_an_activation_that_fails_after_the_engine_started_stops_it_and_gives_the_claim_back(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, faults={"s0": "badreply"})
    async with running_agent(cfg) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        engine = agent.slots["s0"].engine
        assert engine is not None and engine.zygote_pid is not None
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)  # the engine serves, then answers the readiness completion with `[]`
        assert not reply.ok and reply.error is not None and reply.error.code == "not_ready", reply
        assert "not an object" in reply.error.message
        rec = await wait_state(store, key("s0"), "warm")
        assert rec.claim_id is None and rec.endpoint is None
        await wait_for(lambda: _children(engine.zygote_pid or 0) == "", 5, "the engine process to be stopped")
        assert engine.serving is None and agent.slots["s0"].phase == "warm"


async def test_weights_that_crash_the_header_parser_fail_the_slots_instead_of_leaving_them_prewarming(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    victim = _deeply_nested_header(model_dir)
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        rec = await wait_state(store, key("s0"), "failed", timeout_s=10)
        assert rec.reason is not None and victim.name in rec.reason and "nested too deeply" in rec.reason
        assert agent.slots["s0"].phase == "failed"


async def test_a_stuck_slot_answers_activations_by_their_deadline_and_cleans_up_after(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        slot = agent.slots["s0"]
        assert slot.engine is not None and slot.engine.zygote_pid is not None
        zygote = slot.engine.zygote_pid
        claim = await store.claim_slot(key("s0"))
        os.kill(zygote, signal.SIGSTOP)  # a stuck zygote: the start misses the deadline, stopping it takes seconds
        try:
            t0 = time.time()
            reply = await activate(nc, claim, deadline=t0 + 0.3)
            late_s = time.time() - (t0 + 0.3)
            assert not reply.ok and reply.error is not None and reply.error.code == "deadline", reply
            assert late_s < 0.3, f"answered {late_s * 1e3:.0f} ms after the deadline, before cleaning up"
            assert reply.fields["timings"]["total_ms"] < 600
            # The clean-up holds the slot: a retry is told so by its deadline, not when the slot is free again.
            assert slot.busy is not None and "failed activation" in slot.busy
            t0 = time.time()
            reply = await activate(nc, claim, deadline=t0 + 0.2)
            late_s = time.time() - (t0 + 0.2)
            assert not reply.ok and reply.error is not None and reply.error.code == "deadline", reply
            assert "busy (cleaning up after a failed activation)" in reply.error.message
            assert "after its deadline" not in reply.error.message
            assert late_s < 0.3, f"answered {late_s * 1e3:.0f} ms after the deadline"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(zygote, signal.SIGCONT)
        rec = await wait_state(store, key("s0"), "warm", timeout_s=10)  # cleaned up after the replies
        assert rec.claim_id is None
        await wait_for(lambda: slot.busy is None and slot.phase == "warm", 10, "the clean-up to finish")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok


async def test_an_idle_slot_released_while_the_agent_seemed_dead_comes_back_warm(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    """A claimer whose view says the agent's lease lapsed gives the slot back as `failed` (not claimable); the
    agent, alive after all, sees its idle, armed slot failed with no claim and writes it `warm` again.

    A lease lapses by the time since it was heard (contract revision 10): the agent renews every 20 s, so the
    claimer hears nothing while it sees three leases pass (both its clocks moved on)."""
    cfg = settings(model_dir, shm_dir, nats_server.url, heartbeat_interval_s=20.0, lease_s=60.0)
    async with running_agent(cfg) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        clock = ShiftedClock()
        async with await KvSlotStore.open(nc, clock=clock, monotonic=clock.monotonic) as late:
            clock.shift = cfg.lease_s * 3  # for this claimer three leases passed without a renewal
            assert late.index.lease_lapsed(NODE, clock())
            await late.release(claim, reason="scaled down")
            released = late.record(key("s0"))
            assert released is not None and released.state == "failed" and released.claim_id is None
            assert released.reason is not None and "lease lapsed" in released.reason
        rec = await wait_state(store, key("s0"), "warm")
        assert rec.claim_id is None and rec.reason is None and rec.weights_resident
        assert agent.slots["s0"].phase == "warm"
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        await completion(reply.fields["endpoint"])


async def test_an_agent_whose_metrics_port_is_taken_says_so_and_leaves_no_loop_running(
    nats_server: NatsServer, model_dir: Path, shm_dir: Path
) -> None:
    # The start fails after the heartbeat began: the heartbeat must end with it, not write the lease forever.
    taken = socket.create_server(("127.0.0.1", 0))
    cfg = settings(model_dir, shm_dir, nats_server.url, metrics_host="127.0.0.1", metrics_port=taken.getsockname()[1])
    try:
        with pytest.raises(PulsescaleError, match=r"cannot serve metrics on 127\.0\.0\.1:\d+: .*pick another"):
            await asyncio.wait_for(agent_mod.run(cfg, stop=asyncio.Event()), 30)
    finally:
        taken.close()
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("agent-") and not t.done()]
    assert left == []
