"""The agent's side of the wire contract, against a real agent: fenced deactivation (revision 2), typed replies
on NATS and HTTP, and its metrics of what breaks the contract."""

from __future__ import annotations

import asyncio
import secrets
import time
import urllib.request
from pathlib import Path

import msgspec
from nats.aio.client import Client

from tests.nodeagent_helpers import (
    NODE,
    activate,
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
from warmpool.registry import KvSlotStore


async def test_a_deactivate_needs_the_holders_claim_id_and_the_slot_keeps_serving(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        reply = await activate(nc, claim)
        assert reply.ok, reply.error
        endpoint = reply.fields["endpoint"]

        # Only the public half of the claim: the token, which anyone who reads pulse_slots sees.
        reply = await request(nc, "deactivate", slot="s0", token=claim.token)
        assert not reply.ok and reply.error is not None and reply.error.code == "bad_message", reply
        assert reply.fields["reason"] == "missing_field" and "claim_id" in reply.error.message
        assert registry.get_sample_value("pulsescale_agent_rejected_messages_total", {"reason": "missing_field"}) == 1
        await completion(endpoint)

        # The right token with another claim id: not the holder.
        reply = await request(nc, "deactivate", slot="s0", token=claim.token, claim_id="not-the-claimer")
        assert not reply.ok and reply.error is not None and reply.error.code == "foreign_claim", reply
        assert f"token {claim.token}" in reply.error.message  # names the holder by its public token ...
        assert claim.claim_id not in reply.error.message  # ... never by the id that would deactivate it
        await completion(endpoint)

        rec = state(store, key("s0"))
        assert rec is not None and rec.state == "ready" and rec.claim_id == claim.claim_id
        assert registry.get_sample_value("pulsescale_agent_deactivations_total", {"outcome": "refused"}) == 1
        active = agent.slots["s0"].active
        assert active is not None and active.started.endpoint == endpoint
        assert (await deactivate(nc, claim)).ok  # the holder still can
        await wait_state(store, key("s0"), "warm")


async def _raw(nc: Client, verb: str, **fields: object) -> bytes:
    body = {"v": 1, "id": secrets.token_hex(8), "expires_at": time.time() + 30, **fields}
    msg = await nc.request(protocol.agent_subject(NODE, verb), protocol._encoder.encode(body), timeout=10)
    return msg.data


async def test_every_verb_answers_with_its_typed_reply_and_http_status_serves_the_same(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, metrics_port=0, metrics_host="127.0.0.1")
    async with running_agent(cfg) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        now = time.time()
        ready = protocol.decode(
            await _raw(nc, "activate", slot="s0", token=claim.token, claim_id=claim.claim_id, deadline=now + 5),
            protocol.ActivateReply,
        )
        assert ready.ok and ready.state == "ready" and ready.endpoint and ready.timings is not None
        assert ready.token == claim.token and ready.claim_id == claim.claim_id and ready.loaded_bytes > 0

        status = protocol.decode(await _raw(nc, "status"), protocol.AgentStatusReply)
        assert status.ok and status.node == NODE and status.weights is not None and status.weights.files > 0
        [s0] = status.slots
        assert s0.phase == "active" and s0.state == "ready" and s0.endpoint == ready.endpoint
        assert s0.last_timings == ready.timings and s0.engine is not None and s0.engine["armed"]

        assert agent.metrics_port is not None
        url = f"http://127.0.0.1:{agent.metrics_port}/status"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        http = protocol.decode(body, protocol.AgentStatusReply)
        assert msgspec.structs.replace(http, uptime_s=0) == msgspec.structs.replace(status, uptime_s=0)

        refused = protocol.decode(await _raw(nc, "prewarm", slot="s9"), protocol.PrewarmReply)
        assert not refused.ok and refused.error is not None and refused.error.code == "unknown_slot"
        assert refused.error.code in protocol.ERROR_CODES
        skipped = protocol.decode(await _raw(nc, "prewarm"), protocol.PrewarmReply)
        assert skipped.ok and skipped.skipped_serving == ["s0"] and skipped.accepted == []

        done = protocol.decode(
            await _raw(nc, "deactivate", slot="s0", token=claim.token, claim_id=claim.claim_id),
            protocol.DeactivateReply,
        )
        assert done.ok and done.state == "warm" and done.note == "released"


async def test_registry_records_that_break_the_contract_are_counted(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (_agent, registry):
        await wait_state(store, key("s0"), "warm")
        kv = await nc.jetstream().key_value(protocol.SLOTS_BUCKET)
        await kv.put("tiny.node-b.s0", b"not json")
        await kv.put("tiny.node-b.s1", b'{"v": 1, "model": "tiny"}')

        def rejected(reason: str) -> float:
            return registry.get_sample_value("pulsescale_registry_rejected_records_total", {"reason": reason}) or 0

        await wait_for(lambda: rejected("bad_json") == 1 and rejected("missing_field") == 1, 10, "the rejections")
        rec = await wait_state(store, key("s0"), "warm")  # the agent's own slot is untouched
        assert rec.claim_id is None
