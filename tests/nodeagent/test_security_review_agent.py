"""Issue 8 follow-up: what an independent reviewer broke on the node agent's side, attacked again with real parts.

A real nats-server, the real agent (`agent.run`) with its zygotes and engines as real processes, real files in
/dev/shm and /tmp, real HTTP. The attacker holds another node's agent permissions (writes under its own keys,
creates consumers on the buckets it reads, publishes requests with any reply subject) or is a local user (another
process of the engine user, a directory of its own under /tmp).

- Requests only from the exact subject, answered only to an inbox: a DeactivateRequest relayed from KV by a push
  consumer is dropped, a reply subject naming a KV key is never written (findings 2 and 3).
- No NATS credential in an engine's environment (finding 5).
- Records under the agent's node for its model that are not its slots are deleted, at start and when they appear
  (finding 7).
- A serving engine that stops answering (SIGSTOP) loses its claim within a bound (finding 8).
- A link in any directory above ``--shm-dir`` is refused (finding 9).
- No claim id in the agent's log (finding 11).
- Engine output goes to the slot's log file, never to the agent's stderr (finding 12).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import stat
import struct
import time
from pathlib import Path

import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from nodeagent import staging
from nodeagent.errors import UnsafeStagingDir
from tests.nodeagent_helpers import (
    MODEL,
    NODE,
    activate,
    alive,
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
from warmpool.protocol import SlotRecord
from warmpool.registry import KvSlotStore

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the attacker is another uid (chown)")
REJECTED = "pulsescale_agent_rejected_messages_total"


def _body(**fields: object) -> bytes:
    return protocol._encoder.encode({"v": 1, "id": secrets.token_hex(8), "expires_at": time.time() + 30, **fields})


# --- findings 2 and 3: the exact subject, replies to inboxes only ------------------------------------------------


async def test_a_deactivate_relayed_from_kv_by_a_push_consumer_is_dropped_and_the_slot_keeps_serving(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        active = agent.slots["s0"].active
        assert active is not None

        # As node-b's agent: the request (claim id and token read from pulse_slots) written under its own key,
        # relayed to node-a's deactivate subject by a push consumer on the bucket's stream.
        js = nc.jetstream()
        kv = await js.key_value(protocol.SLOTS_BUCKET)
        relay = "tiny.node-b.relay"
        await kv.put(relay, _body(slot="s0", token=claim.token, claim_id=claim.claim_id))
        await js.add_consumer(
            f"KV_{protocol.SLOTS_BUCKET}",
            ConsumerConfig(
                deliver_subject=protocol.agent_subject(NODE, "deactivate"),
                filter_subject=f"$KV.{protocol.SLOTS_BUCKET}.{relay}",
                deliver_policy=DeliverPolicy.ALL,
                ack_policy=AckPolicy.NONE,
            ),
        )

        def dropped() -> float:
            return registry.get_sample_value(REJECTED, {"reason": "subject_mismatch"}) or 0.0

        await wait_for(
            lambda: dropped() >= 1 or (r := state(store, key("s0"))) is None or r.state != "ready",
            15,
            "the relayed request to reach the agent",
        )
        rec = state(store, key("s0"))
        assert rec is not None and rec.state == "ready" and rec.claim_id == claim.claim_id, rec
        assert agent.slots["s0"].active is active and alive(active.started.pid)
        assert dropped() >= 1
        assert (await deactivate(nc, claim)).ok  # the real request still works


async def test_a_request_whose_reply_names_a_kv_key_is_never_answered_there_nor_applied(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (_agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        _, rev = await store.get(key("s0"))
        target = f"$KV.{protocol.SLOTS_BUCKET}.{key('s0')}"
        await nc.publish(protocol.agent_subject(NODE, "status"), _body(), reply=target)
        await nc.publish(
            protocol.agent_subject(NODE, "deactivate"),
            _body(slot="s0", token=claim.token, claim_id=claim.claim_id),
            reply=target,
        )
        await nc.publish(protocol.agent_subject(NODE, "status"), _body())  # no reply subject at all

        def dropped() -> float:
            return registry.get_sample_value(REJECTED, {"reason": "bad_value"}) or 0.0

        await wait_for(
            lambda: dropped() >= 3 or ((hit := store.entry(key("s0"))) is not None and hit[1] != rev),
            15,
            "the three requests to reach the agent",
        )
        rec, now = await store.get(key("s0"))  # read from the bucket, not the view
        assert now == rev, f"the key was written by a reply: revision {rev} -> {now}"
        assert rec.state == "ready" and rec.claim_id == claim.claim_id  # the deactivate was not applied
        assert dropped() == 3
        assert (await request(nc, "status")).ok  # an inbox reply is answered as ever
        assert (await deactivate(nc, claim)).ok


# --- finding 5: no NATS credential in an engine's environment ----------------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode(errors="replace").partition("=")[::2] for item in raw.split(b"\0") if item)


async def test_the_zygote_and_its_engine_get_no_nats_credentials_in_their_environment(
    nats_server: NatsServer,
    nc: Client,
    store: KvSlotStore,
    model_dir: Path,
    shm_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = secrets.token_hex(16)
    monkeypatch.setenv("PULSESCALE_NATS_USER", "agent-node-a")
    monkeypatch.setenv("PULSESCALE_NATS_PASSWORD", secret)
    monkeypatch.setenv("NATS_PASSWORD", secret)
    monkeypatch.setenv("PULSESCALE_ENGINE_SETTING", "x")
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        engine = agent.slots["s0"].engine
        active = agent.slots["s0"].active
        assert engine is not None and active is not None
        zygote_pid = engine.status()["zygote_pid"]
        for pid in (zygote_pid, active.started.pid):
            env = _environ(pid)
            leaked = sorted(k for k in env if k.startswith(("NATS_", "PULSESCALE_")))
            assert leaked == [], f"process {pid} got {leaked}"
            assert secret not in "\0".join(env.values())
            assert env.get("PATH")  # the rest of the environment is still there
        assert (await deactivate(nc, claim)).ok


# --- finding 7: records under this node that are not its slots ----------------------------------------------------


async def test_records_under_the_node_that_are_not_its_slots_are_deleted_at_start_and_when_they_appear(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    kv = await nc.jetstream().key_value(protocol.SLOTS_BUCKET)

    def fake(node: str, slot: str, model: str = MODEL) -> bytes:
        return protocol.encode(SlotRecord(model=model, node=node, slot=slot, state="warm", updated_at=time.time()))

    for i in range(5):
        await kv.put(f"{MODEL}.{NODE}.x{i}", fake(NODE, f"x{i}"))
    await kv.put(f"{MODEL}.{NODE}.junk", b"not a record")  # undecodable: still a key the autoscaler lists
    await kv.put(f"{MODEL}.node-b.s0", fake("node-b", "s0"))  # another node's: not ours to judge
    await kv.put(f"other.{NODE}.s0", fake(NODE, "s0", model="other"))  # another model's agent on this node

    async def exists(k: str) -> bool:
        try:
            await kv.get(k)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return False
        return True

    async def none_left(keys: list[str]) -> bool:
        return not any([await exists(k) for k in keys])

    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (_agent, registry):
        at_start = [f"{MODEL}.{NODE}.x{i}" for i in range(5)] + [f"{MODEL}.{NODE}.junk"]
        await wait_for(lambda: none_left(at_start), 15, "the foreign records deleted at start")
        await wait_state(store, key("s0"), "warm")

        await kv.put(f"{MODEL}.{NODE}.late", fake(NODE, "late"))  # written while the agent runs
        await wait_for(lambda: none_left([f"{MODEL}.{NODE}.late"]), 15, "the late foreign record deleted")

        assert await exists(f"{MODEL}.node-b.s0") and await exists(f"other.{NODE}.s0")
        assert await exists(key("s0"))  # its own slot stays
        removed = registry.get_sample_value("pulsescale_agent_foreign_records_removed_total")
        assert removed == 7


# --- finding 8: a stopped engine loses its claim ----------------------------------------------------------------


async def test_a_stopped_engine_fails_its_claim_within_the_probe_bound_and_the_slot_comes_back_warm(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, model_dir: Path, shm_dir: Path
) -> None:
    cfg = settings(
        model_dir, shm_dir, nats_server.url, engine_probe_interval_s=0.2, engine_probe_timeout_s=0.3
    )  # 3 failures: about 1.5 s
    async with running_agent(cfg) as (agent, registry):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        active = agent.slots["s0"].active
        assert active is not None
        pid = active.started.pid
        os.kill(pid, signal.SIGSTOP)  # what another process of the engine user can do
        try:
            t0 = time.monotonic()
            rec = await wait_state(store, key("s0"), "failed", "warm", timeout_s=15)
            took_s = time.monotonic() - t0
            assert rec.claim_id is None and rec.endpoint is None  # released: the autoscaler replaces it
            assert took_s < 8, f"left ready after {took_s:.1f} s"
            await wait_for(lambda: not alive(pid), 10, "the stopped engine to be killed")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert registry.get_sample_value("pulsescale_agent_engines_unresponsive_total") == 1
        rec = await wait_state(store, key("s0"), "warm")  # re-armed: offered again
        s0 = agent.slots["s0"]
        assert s0.active is None
        again = await store.claim_slot(key("s0"))
        assert (await activate(nc, again)).ok  # and it serves
        assert (await deactivate(nc, again)).ok


# --- finding 9: no link above the shm directory -------------------------------------------------------------------


@needs_root
def test_a_link_in_another_users_directory_above_the_shm_dir_is_refused(model_dir: Path, tmp_path: Path) -> None:
    # The reviewer's repro: as nobody, mkdir /tmp/rv-anc (0755) and ln -s /tmp/rv/victimdir2 /tmp/rv-anc/a.
    victim = tmp_path / "rv" / "victimdir2"
    victim.mkdir(parents=True)
    anc = tmp_path / "rv-anc"
    anc.mkdir(mode=0o755)
    os.chown(anc, NOBODY, NOBODY)
    (anc / "a").symlink_to(victim)
    os.lchown(anc / "a", NOBODY, NOBODY)
    with pytest.raises(UnsafeStagingDir, match=r"rv-anc.*owned by uid 65534"):
        staging.stage(model_dir, anc / "a" / "sub", MODEL)
    assert list(victim.iterdir()) == []  # nothing made or staged through the link


def test_a_link_in_any_directory_above_the_shm_dir_is_refused(model_dir: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "link").symlink_to(elsewhere)  # even one made by the agent's own user: never followed
    with pytest.raises(UnsafeStagingDir, match=r"up/link .*symbolic link.*realpath"):
        staging.stage(model_dir, tmp_path / "up" / "link" / "deeper" / "pulsescale", MODEL)
    assert list(elsewhere.iterdir()) == []
    staged = staging.stage(model_dir, elsewhere / "pulsescale", MODEL)  # the real path works
    staged.close()


# --- finding 11: no claim id in the agent's log -------------------------------------------------------------------


async def test_no_claim_id_reaches_the_agents_log(
    nats_server: NatsServer,
    nc: Client,
    store: KvSlotStore,
    model_dir: Path,
    shm_dir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="pulsescale")
    ids = []
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        ids.append(claim.claim_id)
        assert (await activate(nc, claim)).ok
        # The holder's own id with a wrong token, and a guess: both refused, both logged.
        assert not (await request(nc, "activate", slot="s0", token=claim.token + 5, claim_id=claim.claim_id)).ok
        assert not (await request(nc, "activate", slot="s0", token=claim.token, claim_id="guess")).ok
        assert (await deactivate(nc, claim)).ok
        await wait_state(store, key("s0"), "warm")

        # Released behind the engine's back: the watch fences it (logged with the reason).
        second = await store.claim_slot(key("s0"))
        ids.append(second.claim_id)
        assert (await activate(nc, second)).ok
        await store.release(second)
        await wait_for(lambda: agent.slots["s0"].active is None, 15, "the fenced engine to stop")
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "ready at" in text and "stopped" in text  # the lines are there, by token
    for claim_id in ids:
        assert claim_id not in text, [r.getMessage() for r in caplog.records if claim_id in r.getMessage()]


# --- finding 12: engine output in the slot's log, not the agent's stderr --------------------------------------------


async def test_engine_output_goes_to_the_slots_log_file_not_the_agents_stderr(
    nats_server: NatsServer,
    nc: Client,
    store: KvSlotStore,
    model_dir: Path,
    shm_dir: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    async with running_agent(settings(model_dir, shm_dir, nats_server.url)) as (agent, _):
        await wait_state(store, key("s0"), "warm")
        claim = await store.claim_slot(key("s0"))
        assert (await activate(nc, claim)).ok
        active = agent.slots["s0"].active
        assert active is not None
        port = int(active.started.endpoint.rsplit(":", 1)[1])
        # A client that resets mid-request: the engine writes one line about it to its stderr.
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()

        st = agent.status().slots[0]
        assert st.log_path is not None, "a local engine has no log file"
        log_path = Path(st.log_path)
        await wait_for(lambda: "client(s) dropped" in log_path.read_text(), 15, "the engine's line in its log")
        log_file, log_dir = os.stat(log_path), os.stat(log_path.parent)
        assert stat.S_IMODE(log_file.st_mode) == 0o600
        assert stat.S_IMODE(log_dir.st_mode) == 0o700 and log_dir.st_uid == os.geteuid()
        st = agent.status().slots[0]
        assert any("client(s) dropped" in line for line in st.log_tail)
        assert any("zygote" in line and "started" in line for line in st.log_tail)
        assert (await deactivate(nc, claim)).ok  # the event channel still works: started and stopped
    out, err = capfd.readouterr()
    assert "client(s) dropped" not in err and "client(s) dropped" not in out
