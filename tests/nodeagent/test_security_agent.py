"""Issue 8 (security), the node agent's network surface, attacked with real parts: a real nats-server, the real
agent (`agent.run`, its zygotes and engines real processes), real HTTP and real sockets against a real engine
process.

- HTTP `/status` and `/metrics` listen on loopback unless told otherwise, and no claim id leaves the agent in a
  status reply (HTTP or NATS): with the token it is what deactivates a slot.
- The local engine bounds its connections (idle ones are closed to make room, silent ones time out), so a
  completion is served past a crowd of idle clients, and a client that resets is never a traceback in the log.
- Requests in flight per agent are bounded: beyond the limit the agent answers ``busy`` at once and counts it;
  status has its own allowance.
- A KV writer that rewrites a ready slot's endpoint under the holder's claim is corrected; one that rewrites its
  token is fenced (engine stopped, slot failed).
- A request that would stay valid beyond `MAX_REQUEST_TTL_S` is refused ``too_late``, counted, not remembered.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client

from nodeagent.engine import local
from tests.nodeagent_helpers import (
    NODE,
    activate,
    alive,
    completion,
    deactivate,
    key,
    listening_addresses,
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

# --- 1. HTTP on loopback, no claim ids in status -------------------------------------------------------------


async def test_http_status_listens_on_loopback_and_no_status_shows_a_claim_id(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(model_dir, shm_dir, nats_server.url, metrics_port=0)  # the default host
    async with running_agent(cfg) as (agent, _):
        assert agent.metrics_port is not None
        assert listening_addresses(agent.metrics_port) == {"0100007F"}  # 127.0.0.1 only, not 0.0.0.0

        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        ready = await activate(nc, claim)
        assert ready.ok, ready.error
        url = f"http://127.0.0.1:{agent.metrics_port}/status"
        http = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        body = {"v": 1, "id": secrets.token_hex(8), "expires_at": time.time() + 30}
        over_nats = (await nc.request(protocol.agent_subject(NODE, "status"), json.dumps(body).encode(), 5)).data
        for raw in (http, over_nats):
            reply = protocol.decode(raw, protocol.AgentStatusReply)
            [s0] = reply.slots
            assert s0.phase == "active" and s0.state == "ready" and s0.endpoint  # still says what serves where
            assert claim.claim_id.encode() not in raw  # anywhere in the JSON, reasons included
        assert (await deactivate(nc, claim)).ok  # the claimer, who holds the id, still can


async def test_no_refusal_tells_the_asker_the_holders_claim_id(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (_agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        before = [  # claimed, not yet active: the refusals come from the registry's view
            await request(nc, "activate", slot="s0", token=claim.token, claim_id="guess"),
            await request(nc, "deactivate", slot="s0", token=claim.token, claim_id="guess"),
        ]
        assert (await activate(nc, claim)).ok
        after = [  # serving: the refusals come from the running engine's claim too
            await request(nc, "activate", slot="s0", token=claim.token, claim_id="guess"),
            await request(nc, "activate", slot="s0", token=claim.token + 7, claim_id="guess"),
            await request(nc, "deactivate", slot="s0", token=claim.token, claim_id="guess"),
            await request(nc, "deactivate", slot="s0", token=claim.token + 7, claim_id="guess"),
        ]
        for reply in before + after:
            assert not reply.ok and reply.error is not None
            assert claim.claim_id not in reply.error.message, reply.error
            assert claim.claim_id not in json.dumps(reply.fields), reply.fields
        assert (await deactivate(nc, claim)).ok  # the holder, who knows its id, still can


# --- 2. the local engine: bounded connections, timeouts, quiet drops -------------------------------------------

COMPLETION_BEHIND_CROWD_S = 3.0
"""How long a completion may take with three times the connection limit of idle clients connected."""
ENGINE_READ_TIMEOUT_S = 4.0
"""The test engine's silent-client timeout: longer than `COMPLETION_BEHIND_CROWD_S`, so a completion that only got
in once silent clients timed out still fails the bound (the engine must make room by closing idle ones), and
shorter than the engine's 10 s default (local.READ_TIMEOUT_S), which the wait for a silent client's close would
otherwise spend."""

ENGINE = """
import sys
import numpy as np
from nodeagent.engine import local
cfg = local.read_config(sys.argv[1])
rng = np.random.default_rng(0)
tensors = {n: rng.standard_normal(s, dtype=np.float32) for n, s in local.expected_shapes(cfg).items()}
server = local.EngineServer(local.TinyMoE(cfg, tensors), "tiny", "127.0.0.1", 0, read_timeout_s=float(sys.argv[2]))
print(server.port, flush=True)
server.serve_forever()
"""


@pytest.fixture
def engine_process(tiny_source: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """A real local engine process on a free port, built as the zygote's child builds it; (process, port, the
    file its stderr goes to). Killed at teardown."""
    log = tmp_path / "engine.stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE, str(tiny_source), str(ENGINE_READ_TIMEOUT_S)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, port, log
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


def connect(port: int, first_bytes: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    if first_bytes:
        s.sendall(first_bytes)
    return s


def reset(s: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a client that crashes or a middlebox does."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def closed_by_peer(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.slow
async def test_the_engine_bounds_connections_times_out_silent_ones_and_logs_no_traceback_for_dropped_clients(
    engine_process: tuple[subprocess.Popen[str], int, Path],
) -> None:
    proc, port, log = engine_process
    limit = getattr(local, "MAX_CONNECTIONS", 32)
    crowd: list[socket.socket] = []
    try:
        # Connected and silent, and slowloris-style (half a request line, then nothing): three times the limit.
        for i in range(3 * limit):
            crowd.append(connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if i % 2 else b""))
        t0 = time.perf_counter()
        out = await completion(f"http://127.0.0.1:{port}", max_tokens=4)
        took_s = time.perf_counter() - t0
        assert out["choices"], out
        assert took_s < COMPLETION_BEHIND_CROWD_S, f"a completion waited {took_s:.1f} s behind idle clients"
        # Threads: the accept loop, one per admitted connection; not one per connection ever opened.
        assert threads_of(proc.pid) <= limit + 4
    finally:
        for s in crowd:
            s.close()

    # A client that sends part of a request and then nothing is closed by the engine, not held forever.
    silent = connect(port, b"GET /health HTTP/1.1\r\n")
    try:
        timeout_s = ENGINE_READ_TIMEOUT_S
        closed = await asyncio.to_thread(closed_by_peer, silent, timeout_s + 5)
        assert closed, f"a silent client was still connected after {timeout_s + 5:.0f} s"
    finally:
        silent.close()

    # Clients that reset mid-request, and one that resets while its reply is written: no traceback, one line.
    for _ in range(20):
        reset(connect(port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"))
    body = json.dumps({"prompt": "hi", "max_tokens": 4096}).encode()
    s = connect(port, b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    reset(s)
    out = await completion(f"http://127.0.0.1:{port}")  # still serving
    assert out["choices"]
    assert proc.poll() is None
    text = log.read_text()
    assert "Traceback" not in text, text
    assert len(text.splitlines()) <= 2, text


# --- 3. requests in flight per agent -------------------------------------------------------------------------


async def _ask(nc: Client, verb: str, **fields: object) -> protocol.Reply:
    body = {"v": 1, "id": secrets.token_hex(8), "expires_at": time.time() + 60, **fields}
    msg = await nc.request(protocol.agent_subject(NODE, verb), protocol._encoder.encode(body), timeout=30)
    return protocol.decode_reply(msg.data)


async def test_a_flood_of_requests_is_answered_busy_beyond_the_limit_and_the_agent_stays_responsive(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, registry):
        limit = getattr(agent.settings, "max_requests_in_flight", 64)
        await wait_state(store, key("s0"), "warm")
        s0 = agent.slots["s0"]
        await s0.lock.acquire()  # a long activation holds the slot: activations for it wait, in flight
        try:
            flood = [
                asyncio.create_task(_ask(nc, "activate", slot="s0", token=1, claim_id="x", deadline=time.time() + 60))
                for _ in range(4 * limit)
            ]
            garbage = asyncio.create_task(
                nc.request(protocol.agent_subject(NODE, "deactivate"), b"\xff not json", timeout=30)
            )

            def busy_replies() -> list[protocol.Reply]:
                done = [t.result() for t in flood if t.done()]
                return [r for r in done if r.error is not None and r.error.code == "busy"]

            await wait_for(lambda: len(busy_replies()) == 3 * limit, 20, "busy answers beyond the limit")
            assert sum(not t.done() for t in flood) == limit  # exactly the limit is in flight, waiting
            assert agent.keeper.task_count <= limit + 16  # not one task per message
            busy = registry.get_sample_value("pulsescale_agent_busy_requests_total", {"verb": "activate"})
            assert busy == 3 * limit

            # On-call can still see the agent: status has its own allowance.
            status = await _ask(nc, "status")
            assert status.ok, status.error
            # The garbage got its bad_message, busy or not; the agent did not die of it.
            bad = protocol.decode_reply((await garbage).data)
            assert bad.error is not None and bad.error.code in ("bad_message", "busy")
        finally:
            s0.lock.release()
        replies = await asyncio.gather(*flood)
        assert all(not r.ok for r in replies)  # the waiting ones are refused on their merits (a bogus claim)
        assert sum(r.error is not None and r.error.code == "busy" for r in replies) == 3 * limit

        # Afterwards the agent is itself again: a real claim activates.
        claim = await store.claim_slot(key("s0"))
        ready = await activate(nc, claim)
        assert ready.ok, ready.error
        assert (await deactivate(nc, claim)).ok


# --- 4. a rewritten ready record ------------------------------------------------------------------------------


async def _rewrite(nc: Client, store: KvSlotStore, slot_key: str, **fields: object) -> int:
    """Rewrite the slot's record as another KV writer would (same claim, same everything else); its revision."""
    kv = await nc.jetstream().key_value(protocol.SLOTS_BUCKET)
    rec, rev = await store.get(slot_key)
    return await kv.update(slot_key, protocol.encode(msgspec.structs.replace(rec, **fields)), last=rev)


async def test_a_ready_endpoint_rewritten_under_the_claim_is_written_back(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (_agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        rec = await wait_state(store, key("s0"), "ready")
        true_endpoint = rec.endpoint
        assert true_endpoint is not None

        tampered_at = await _rewrite(nc, store, key("s0"), endpoint="http://203.0.113.9:1")

        def back() -> bool:
            hit = store.entry(key("s0"))
            return hit is not None and hit[1] > tampered_at and hit[0].endpoint == true_endpoint

        await wait_for(back, 10, f"the endpoint written back (now {state(store, key('s0'))})")
        rec = await wait_state(store, key("s0"), "ready")
        assert rec.claim_id == claim.claim_id and rec.token == claim.token  # still the holder's
        assert registry.get_sample_value("pulsescale_agent_record_corrections_total", {"action": "corrected"}) == 1
        assert (await completion(true_endpoint))["choices"]
        assert (await deactivate(nc, claim)).ok  # the holder's claim still works
        await wait_state(store, key("s0"), "warm")


async def test_a_ready_token_rewritten_under_the_claim_fences_the_slot(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        active = agent.slots["s0"].active
        assert active is not None
        pid = active.started.pid

        await _rewrite(nc, store, key("s0"), token=claim.token + 1000, endpoint="http://203.0.113.9:1")
        rec = await wait_state(store, key("s0"), "failed")
        assert rec.endpoint is None and rec.claim_id is None and rec.reason and "rewritten" in rec.reason
        await wait_for(lambda: not alive(pid), 10, "the fenced engine to stop")
        assert registry.get_sample_value("pulsescale_agent_record_corrections_total", {"action": "fenced"}) == 1


# --- 5. requests valid too long ------------------------------------------------------------------------------


async def test_a_request_expiring_beyond_the_max_ttl_is_refused_too_late_and_not_remembered(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        req_id = secrets.token_hex(8)
        far = time.time() + protocol.MAX_REQUEST_TTL_S + 600
        for verb in ("status", "prewarm"):
            reply = await request(nc, verb, id=req_id, expires_at=far)
            assert not reply.ok and reply.error is not None and reply.error.code == "bad_message"
            assert reply.fields["reason"] == "too_late"
        assert registry.get_sample_value("pulsescale_agent_rejected_messages_total", {"reason": "too_late"}) == 2
        assert agent.requests.ledger.seen(req_id) is None
        again = await request(nc, "status", id=req_id)  # the same id, now with a sane expiry: handled, not replayed
        assert again.ok, again.error
