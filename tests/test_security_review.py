"""The independent review of issue 8, attack by attack, under the production's NATS layout (a user per role).

Real processes throughout: a nats-server with the users `warmpool.natsauth` renders, the autoscaler as a
`pulsescale autoscaler` process with its own user, and each attacker as a client holding one role's credentials
(an agent user of its node, on-call). Each test is the reviewer's attack and what must hold after it:
- rollups: a rollup header on an agent's own key would purge the whole bucket (buckets refuse rollups; the
  autoscaler turns them off on buckets an older version made);
- relays: a consumer of a bucket the agent may read, with a deliver subject of ours, relays its KV values onto
  ``pulse.cmd.*`` / ``pulse.queue.*`` (dropped: they do not arrive on those subjects);
- reply injection: a command whose reply subject is a KV key would make the autoscaler write that key (answers go
  to ``_INBOX.`` only);
- events: agents may not publish ``pulse.events.>`` (gateways route on ``slot.ready``);
- records under another key, and fake slots that no lease lists, are not offered;
- a slot of a model its node was not assigned (issue 25, M3) is never claimed, and the agent cannot assign itself;
- the local secure broker serves no unauthenticated monitoring port unless asked.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from autoscaler.commands.service import CommandSettings
from tests.helpers import wait_for
from tests.nodeagent_helpers import listening_addresses
from warmpool import connect, natsauth, protocol
from warmpool.embedded import NatsServer, free_port
from warmpool.errors import NoSlotAvailable, PermissionDenied
from warmpool.protocol import MAX_SLOTS_PER_NODE
from warmpool.registry import ALL_BUCKETS, KvSlotStore, ensure_buckets

NODES = ("n1", "n2", "n3")
QUEUE_GROUP = CommandSettings().queue_group  # the command service's; the attacker reads it in the source
MODEL = "tiny"


class Cluster:
    def __init__(self, server: NatsServer, layout: natsauth.SecureLayout, metrics_port: int) -> None:
        self.server, self.layout, self.metrics_port = server, layout, metrics_port
        self.rollups_before: dict[str, bool] = {}

    def env(self, user: str) -> dict[str, str]:
        return {**os.environ, **natsauth.read_env_file(self.layout.credentials[user])}

    def options(self, user: str) -> connect.NatsOptions:
        return connect.options_from_args(argparse.Namespace(), name=f"review-{user}", env=self.env(user))

    @contextlib.asynccontextmanager
    async def client(self, user: str) -> AsyncIterator[Client]:
        nc = await connect.connect(self.options(user))
        try:
            yield nc
        finally:
            await nc.close()

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the autoscaler's /metrics (0 when the series does not exist yet)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        pattern = rf"^{re.escape(name)}{re.escape('{' + want + '}') if want else ''} (\S+)$"
        m = re.search(pattern, text, re.M)
        return float(m.group(1)) if m else 0.0


def command(verb: str, **fields: object) -> bytes:
    body = {"v": 1, "id": os.urandom(6).hex(), "expires_at": time.time() + 30, "by": "review", **fields}
    return json.dumps(body).encode()


async def status(nc: Client) -> protocol.StatusReply:
    """A well-formed status request, answered: every message the service got before it was handled."""
    msg = await nc.request(protocol.cmd_subject("status"), command("status"), timeout=5)
    return protocol.decode(msg.data, protocol.StatusReply)


async def _old_buckets(opts: connect.NatsOptions) -> dict[str, bool]:
    """The buckets as an older version made them (nats-py's `create_key_value`, which allows rollups)."""

    async def make(nc: Client) -> dict[str, bool]:
        js = nc.jetstream(timeout=5.0)
        out = {}
        for bucket in ALL_BUCKETS:
            await js.create_key_value(KeyValueConfig(bucket=bucket, history=5, storage=StorageType.FILE))
            out[bucket] = bool((await js.stream_info(f"KV_{bucket}")).config.allow_rollup_hdrs)
        return out

    return await connect.run_client(opts, make)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("review-nats")
    server = NatsServer(root / "nats")
    layout = natsauth.write_secure_layout(root / "auth", server.url, NODES, tls=False)
    server.extra_config = layout.authorization
    with server:
        c = Cluster(server, layout, free_port())
        c.rollups_before = asyncio.run(_old_buckets(c.options("autoscaler")))
        proc = subprocess.Popen(
            [sys.executable, "-m", "pulsescale", "autoscaler", "--metrics-port", str(c.metrics_port),
             "--log-level", "WARNING"],
            env=c.env("autoscaler"),
        )  # fmt: skip
        try:

            async def answering() -> None:
                async with c.client("oncall") as nc:

                    async def answered() -> bool:
                        with contextlib.suppress(nats.errors.NoRespondersError, nats.errors.TimeoutError):
                            return isinstance(await status(nc), protocol.StatusReply)
                        return False

                    await wait_for(answered, 30, "the autoscaler to lead and answer on-call commands")

            asyncio.run(answering())
            yield c
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def slot(node: str, name: str, **fields: object) -> bytes:
    return protocol.encode(protocol.SlotRecord(model=MODEL, node=node, slot=name, state="warm", **fields))  # type: ignore[arg-type]


# --- 1. rollups ---------------------------------------------------------------------------------------------------


async def test_the_autoscaler_turns_rollups_off_on_buckets_an_older_version_made(cluster: Cluster) -> None:
    assert cluster.rollups_before == dict.fromkeys(ALL_BUCKETS, True)  # as nats-py creates a bucket
    async with cluster.client("autoscaler") as nc:
        js = nc.jetstream(timeout=5.0)
        for bucket in ALL_BUCKETS:
            assert not (await js.stream_info(f"KV_{bucket}")).config.allow_rollup_hdrs, bucket


async def test_a_rollup_on_an_agents_own_key_is_refused_and_purges_nothing(cluster: Cluster) -> None:
    """The reviewer's attack: as agent-n2, ``Nats-Rollup: all`` on its own key wiped every slot of the bucket."""
    async with cluster.client("agent-n1") as n1, cluster.client("agent-n2") as n2:
        kv1 = await n1.jetstream(timeout=5.0).key_value(protocol.SLOTS_BUCKET)
        await kv1.put(f"{MODEL}.n1.r0", slot("n1", "r0"))
        js2 = n2.jetstream(timeout=5.0)
        before = (await js2.stream_info(f"KV_{protocol.SLOTS_BUCKET}")).state.messages
        with pytest.raises(nats.js.errors.APIError, match="rollup"):
            await js2.publish(f"$KV.{protocol.SLOTS_BUCKET}.{MODEL}.n2.roll", b"{}", headers={"Nats-Rollup": "all"})
        assert (await js2.stream_info(f"KV_{protocol.SLOTS_BUCKET}")).state.messages == before
        entry = await kv1.get(f"{MODEL}.n1.r0")
        assert entry.value == slot("n1", "r0")


async def _history(kv: KeyValue, key: str) -> list[bytes | None]:
    """`kv.history(key)`, read again when it comes back empty: nats-py's history watch may say "no more" before
    its first entry on a busy machine (CI saw `NoKeysError` once, right after both writes were acknowledged)."""
    for _ in range(20):
        with contextlib.suppress(nats.js.errors.NoKeysError):
            return [e.value for e in await kv.history(key)]
        await asyncio.sleep(0.1)
    return [e.value for e in await kv.history(key)]


async def test_buckets_refuse_rollups_and_key_value_still_does_all_we_use(nc: Client) -> None:
    """Fresh buckets from `ensure_buckets`: put, create, update, delete, get, watch and history all work without
    rollups; purge (which the registry never uses) is what needs them."""
    buckets = await ensure_buckets(nc.jetstream(timeout=5.0))
    js = nc.jetstream(timeout=5.0)
    for bucket in ALL_BUCKETS:
        assert not (await js.stream_info(f"KV_{bucket}")).config.allow_rollup_hdrs
    kv = buckets[protocol.SLOTS_BUCKET]
    watcher = await kv.watch("k.>")
    first = await kv.create("k.a", b"1")
    second = await kv.update("k.a", b"2", last=first)
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await kv.update("k.a", b"3", last=first)
    await kv.put("k.b", b"x")
    await kv.delete("k.b")
    assert (await kv.get("k.a")).value == b"2"
    assert await _history(kv, "k.a") == [b"1", b"2"]
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("k.b")
    seen: list[tuple[str, str | None]] = []
    while len(seen) < 4:
        e = await watcher.updates(timeout=2)
        if e is not None:
            seen.append((e.key, e.operation))
    await watcher.stop()
    assert seen[-1] == ("k.b", "DEL") and ("k.a", None) in seen
    assert second > first
    with pytest.raises(nats.js.errors.APIError, match="rollup"):
        await kv.purge("k.a")


# --- 2/3. relays and reply subjects ----------------------------------------------------------------------------------


async def test_a_command_reply_never_goes_to_a_kv_key(cluster: Cluster) -> None:
    """The reviewer's attack: on-call's status request with reply ``$KV.pulse_slots.<key>`` made the autoscaler
    overwrite that slot (its grants cover the bucket); the same for an override in ``pulse_leases``."""
    key = f"{MODEL}.n1.s1"
    async with cluster.client("agent-n1") as n1, cluster.client("oncall") as oncall:
        kv = await n1.jetstream(timeout=5.0).key_value(protocol.SLOTS_BUCKET)
        rev = await kv.put(key, slot("n1", "s1"))
        dropped = cluster.metric("pulsescale_rejected_messages_total", reason="bad_value")
        for target in (f"$KV.{protocol.SLOTS_BUCKET}.{key}", f"$KV.{protocol.LEASES_BUCKET}.override.{MODEL}"):
            await oncall.publish(protocol.cmd_subject("status"), command("status"), reply=target)
        await status(oncall)  # answered after both, so both were handled
        entry = await kv.get(key)
        assert (entry.revision, entry.value) == (rev, slot("n1", "s1"))
        async with cluster.client("autoscaler") as auto:
            leases = await auto.jetstream(timeout=5.0).key_value(protocol.LEASES_BUCKET)
            with pytest.raises(nats.js.errors.KeyNotFoundError):
                await leases.get(f"override.{MODEL}")
        assert cluster.metric("pulsescale_rejected_messages_total", reason="bad_value") == dropped + 2


async def _relay(agent: Client, key: str, value: bytes, deliver_subject: str, group: str | None = None) -> str:
    """As the agent: write `value` under its own `key`, then a push consumer of the slots bucket that delivers that
    key onto `deliver_subject` (a consumer's deliver subject is not checked against its creator's grants), to the
    subscribers' queue `group` if they have one (the server delivers to a queue group only when asked to)."""
    kv = await agent.jetstream(timeout=5.0).key_value(protocol.SLOTS_BUCKET)
    await kv.put(key, value)
    info = await agent.jetstream(timeout=5.0).add_consumer(
        f"KV_{protocol.SLOTS_BUCKET}",
        ConsumerConfig(
            name=f"relay-{os.urandom(4).hex()}",
            deliver_subject=deliver_subject,
            deliver_group=group,
            inactive_threshold=60.0,
            filter_subject=f"$KV.{protocol.SLOTS_BUCKET}.{key}",
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=60.0,
        ),
    )
    assert info.name is not None
    return info.name


async def test_a_kv_value_relayed_onto_the_autoscalers_subjects_is_not_acted_on(cluster: Cluster) -> None:
    """The reviewer's relay, aimed at the autoscaler: agent-n2's push consumers deliver a command it wrote onto
    ``pulse.cmd.pause`` and a sample onto ``pulse.queue.tiny``. Neither is acted on: nats-server 2.15 does not
    deliver a push consumer to the autoscaler's wildcard subscriptions at all (measured: nothing is delivered),
    and where a server does, the message keeps its ``$KV...`` subject and is dropped unanswered
    (tests/autoscaler/test_commands.py builds that delivery)."""
    sample = protocol.QueueSample(
        gateway="relay", model=MODEL, seq=1, ts=time.time(), queue_depth=10_000, inflight=0,
        arrivals_total=0, completions_total=0, timeouts_total=0,
    )  # fmt: skip
    stream = f"KV_{protocol.SLOTS_BUCKET}"
    async with cluster.client("agent-n2") as n2, cluster.client("oncall") as oncall:
        js = n2.jetstream(timeout=5.0)
        samples = cluster.metric("pulsescale_samples_total", outcome="no_scaler")
        relays = [
            await _relay(n2, f"{MODEL}.n2.relaycmd", command("pause", model=MODEL), protocol.cmd_subject("pause"),
                         QUEUE_GROUP),
            await _relay(n2, f"{MODEL}.n2.relayq", protocol.encode(sample), protocol.QUEUE_PREFIX + MODEL),
        ]  # fmt: skip
        try:
            await status(oncall)  # a request the service answered after the consumers were made
            cmd = await js.consumer_info(stream, relays[0])
            # Delivered or not, never answered: a reply to its ``$JS.ACK`` subject would have acknowledged it.
            assert cmd.num_ack_pending == cmd.delivered.consumer_seq
            assert cluster.metric("pulsescale_samples_total", outcome="no_scaler") == samples  # never a sample
        finally:
            for name in relays:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_consumer(stream, name)


# --- 4. events -------------------------------------------------------------------------------------------------------


async def test_an_agent_may_not_publish_events(cluster: Cluster) -> None:
    """Gateways route on ``slot.ready``: an agent user could forge one for any slot."""
    subject = f"{protocol.EVENTS_PREFIX}slot.ready"

    async def forge(nc: Client) -> None:
        await nc.publish(subject, b"{}")
        await nc.flush()

    with pytest.raises(PermissionDenied) as refused:
        await connect.run_client(cluster.options("agent-n2"), forge)
    assert (refused.value.operation, refused.value.subject) == ("publish", subject)


# --- 6/7. records the key does not vouch for --------------------------------------------------------------------


@contextlib.asynccontextmanager
async def autoscaler_store(cluster: Cluster) -> AsyncIterator[KvSlotStore]:
    async with cluster.client("autoscaler") as nc:
        store = await KvSlotStore.open(nc)
        await store.start()
        try:
            yield store
        finally:
            await store.close()


async def pool(cluster: Cluster) -> protocol.PoolReply:
    async with cluster.client("oncall") as nc:
        msg = await nc.request(protocol.cmd_subject("pool"), command("pool"), timeout=5)
        return protocol.decode(msg.data, protocol.PoolReply)


async def test_a_record_naming_another_slot_or_node_than_its_key_is_rejected(cluster: Cluster) -> None:
    """The reviewer's attack: agent-n2 wrote ``tiny.n2.s7`` = {node: n1, slot: s0, ready, endpoint}: the pool showed
    a second ``tiny.n1.s0``; likewise a lease for n1 under key n2."""
    forged = slot("n1", "s0", endpoint="http://203.0.113.66:8000").replace(b'"warm"', b'"ready"')
    before = cluster.metric("pulsescale_registry_rejected_records_total", reason="subject_mismatch")
    async with cluster.client("agent-n2") as n2, autoscaler_store(cluster) as store:
        js = n2.jetstream(timeout=5.0)
        await (await js.key_value(protocol.SLOTS_BUCKET)).put(f"{MODEL}.n2.s7", forged)
        lease = protocol.AgentLease(node="n1", slots=["s0"], heartbeat_at=time.time(), lease_s=30)
        await (await js.key_value(protocol.AGENTS_BUCKET)).put("n2", protocol.encode(lease))
        await wait_for(lambda: store.rejected.counts["subject_mismatch"] >= 2, 10, "both records rejected")
        assert f"{MODEL}.n2.s7" not in store.slots and "n2" not in store.agents
        assert store.index.lease("n1") is None and not any(r.node == "n1" and r.slot == "s0" for r in store.records())
        await wait_for(
            lambda: (
                cluster.metric("pulsescale_registry_rejected_records_total", reason="subject_mismatch") >= before + 2
            ),
            10,
            "the autoscaler to count both",
        )
        shown = [s.key for s in (await pool(cluster)).slots]
        assert f"{MODEL}.n2.s7" not in shown and f"{MODEL}.n1.s0" not in shown


async def test_only_slots_that_the_nodes_lease_lists_are_claimable(cluster: Cluster) -> None:
    """The reviewer's attack: agent-n3 writes a thousand warm records (5000 in the review) no agent serves; the
    status counted them WARM and every scale-up tried them first. Only s0, which its lease lists, is offered."""
    fakes = 1000
    async with cluster.client("agent-n3") as n3, autoscaler_store(cluster) as store:
        js = n3.jetstream(timeout=5.0)
        slots_kv = await js.key_value(protocol.SLOTS_BUCKET)
        agents_kv = await js.key_value(protocol.AGENTS_BUCKET)
        lease = protocol.AgentLease(node="n3", slots=["s0"], heartbeat_at=time.time(), lease_s=60)
        await agents_kv.put("n3", protocol.encode(lease))
        await slots_kv.put(f"{MODEL}.n3.s0", slot("n3", "s0", weights_resident=False))
        # The fakes look better than the real slot (resident, rootfs mounted): placement would try them first.
        await asyncio.gather(
            *(slots_kv.put(f"{MODEL}.n3.x{i}", slot("n3", f"x{i}", weights_resident=True, rootfs_mounted=True))
              for i in range(fakes))
        )  # fmt: skip
        await wait_for(lambda: len(store.records(MODEL)) >= fakes + 1, 20, "the view to hold every record")
        assert [r.key for r in store.claimable(MODEL)] == [f"{MODEL}.n3.s0"]
        claim = await store.claim(MODEL)
        assert claim.key == f"{MODEL}.n3.s0"
        await store.release(claim)

        # A lease that lists more than a node can hold is refused, not trusted: the node offers nothing.
        rejected = store.rejected.counts["bad_value"]
        many = [f"x{i}" for i in range(MAX_SLOTS_PER_NODE + 1)]
        # Written as raw JSON, as an attacker would: the contract type refuses to build it at all.
        big = {"v": 1, "node": "n3", "slots": many, "heartbeat_at": time.time(), "lease_s": 60}
        await agents_kv.put("n3", json.dumps(big).encode())
        await wait_for(lambda: store.rejected.counts["bad_value"] > rejected, 10, "the oversized lease refused")
        assert store.index.lease("n3") is None and store.claimable(MODEL) == []


# --- issue 25, M3: agents bound to their models -----------------------------------------------------------------------


def run_cli(cluster: Cluster, user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pulsescale", *argv], env=cluster.env(user), capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip


async def test_a_warm_slot_of_a_model_its_node_was_not_assigned_is_never_claimed(cluster: Cluster) -> None:
    """The reviewer's attack: agent-n1, assigned ``llama`` by the operator, advertises a warm ``tiny`` slot (any key
    under its node is its to write); the autoscaler claimed it and would route tiny's traffic there. Now it is never
    claimed and the autoscaler counts it, while n2's assigned tiny slot is claimed; the agent may not rewrite its
    assignment."""
    assigned = {"n1": "llama", "n2": MODEL}  # n3 stays unbound
    for node, model in assigned.items():
        done = await asyncio.to_thread(run_cli, cluster, "operator", "assign", node, model)
        assert done.returncode == 0 and done.stdout == f"node {node} may offer {model}\n", done.stderr
    before = cluster.metric("pulsescale_registry_rejected_records_total", reason="unassigned_model")
    async with contextlib.AsyncExitStack() as stack:
        n1 = await stack.enter_async_context(cluster.client("agent-n1"))
        n2 = await stack.enter_async_context(cluster.client("agent-n2"))
        admin = await stack.enter_async_context(cluster.client("operator"))
        for nc, node in ((n1, "n1"), (n2, "n2")):
            js = nc.jetstream(timeout=5.0)
            lease = protocol.AgentLease(node=node, slots=["a0"], heartbeat_at=time.time(), lease_s=60)
            await (await js.key_value(protocol.AGENTS_BUCKET)).put(node, protocol.encode(lease))
            # n1's slot looks better (resident, rootfs mounted): placement would try it first.
            await (await js.key_value(protocol.SLOTS_BUCKET)).put(
                f"{MODEL}.{node}.a0", slot(node, "a0", weights_resident=node == "n1", rootfs_mounted=node == "n1")
            )
        try:
            async with cluster.client("autoscaler") as nc, await KvSlotStore.open(nc, assignments=True) as store:
                keys = {f"{MODEL}.{n}.a0" for n in ("n1", "n2")}
                await wait_for(lambda: keys <= set(store.slots.keys()), 10, "both slots in the view")
                await wait_for(lambda: store.index.lease_fresh("n1") and store.index.lease_fresh("n2"), 10, "leases")
                claim = await store.claim(MODEL)
                assert claim.key == f"{MODEL}.n2.a0"  # not n1's, however much better placed
                # Counted once per such record; earlier tests of this module left records under n1 and n2 too.
                off = {
                    r.key
                    for r in store.records()
                    if r.state in ("warm", "ready") and r.node in assigned and r.model != assigned[r.node]
                }
                assert f"{MODEL}.n1.a0" in off and store.rejected.counts["unassigned_model"] == len(off)
                with pytest.raises(NoSlotAvailable):
                    await store.claim(MODEL)
                with pytest.raises(NoSlotAvailable, match="not assigned to node n1"):
                    await store.claim_slot(f"{MODEL}.n1.a0")
                await store.release(claim)
                assert store.record(f"{MODEL}.n1.a0").state == "warm"  # type: ignore[union-attr]
            await wait_for(
                lambda: (
                    cluster.metric("pulsescale_registry_rejected_records_total", reason="unassigned_model")
                    >= before + 1
                ),
                10,
                "the autoscaler to count it",
            )

            async def widen(nc: Client) -> None:
                kv = await nc.jetstream(timeout=5.0).key_value(protocol.ASSIGNMENTS_BUCKET)
                await kv.put("n1", protocol.encode(protocol.NodeAssignment(node="n1", models=["llama", MODEL])))

            with pytest.raises(PermissionDenied) as refused:
                await connect.run_client(cluster.options("agent-n1"), widen)
            assert refused.value.subject == f"$KV.{protocol.ASSIGNMENTS_BUCKET}.n1"
            listed = await asyncio.to_thread(run_cli, cluster, "operator", "assign", "--json")
            assert {a["node"]: a["models"] for a in json.loads(listed.stdout)} == {"n1": ["llama"], "n2": [MODEL]}
        finally:
            # The module's cluster is shared: leave no binding and no slot behind.
            assignments = await admin.jetstream(timeout=5.0).key_value(protocol.ASSIGNMENTS_BUCKET)
            for nc, node in ((n1, "n1"), (n2, "n2")):
                await assignments.delete(node)  # unbound again (a purge is a rollup: refused)
                await (await nc.jetstream(timeout=5.0).key_value(protocol.SLOTS_BUCKET)).delete(f"{MODEL}.{node}.a0")


# --- 13. monitoring port ---------------------------------------------------------------------------------------------


def _run_nats(store: Path, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pulsescale", "nats", "--secure", "--no-tls", "--port", str(free_port()),
         "--store-dir", str(store), "--nodes", "n1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # the process ends on error (EOF)
        lines.append(line)
        if line.startswith("or as flags:"):
            break
    return proc, "".join(lines)


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_pulsescale_nats_secure_serves_no_monitoring_port_unless_asked(tmp_path: Path) -> None:
    """The monitoring port has no authentication: ``/connz`` shows every client and subscription to any local
    user. Under --secure it is off unless --monitor-port asks for it."""
    proc, out = _run_nats(tmp_path / "plain")
    try:
        assert "or as flags:" in out, out
        conf = (tmp_path / "plain" / "nats-server.conf").read_text()
        assert "http" not in conf
        assert "monitor" not in (tmp_path / "plain" / "nats-server.log").read_text()
    finally:
        _stop(proc)
    port = free_port()
    proc, out = _run_nats(tmp_path / "asked", "--monitor-port", str(port))
    try:
        assert f"monitoring (no authentication) on http://127.0.0.1:{port}" in out, out
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 only
    finally:
        _stop(proc)


def test_nats_server_without_a_monitoring_port_still_waits_for_jetstream(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats", monitor_port=None) as server:

        async def kv_works() -> bytes | None:
            async def work(nc: Client) -> bytes | None:
                kv = (await ensure_buckets(nc.jetstream(timeout=5.0), names=(protocol.SLOTS_BUCKET,)))[
                    protocol.SLOTS_BUCKET
                ]
                await kv.put("k", b"v")
                return (await kv.get("k")).value

            return await connect.run_client(connect.NatsOptions(servers=(server.url,)), work)

        assert asyncio.run(kv_works()) == b"v"
        assert "http" not in (server.store_dir / "nats-server.conf").read_text()
