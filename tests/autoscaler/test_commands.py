"""The on-call command service against a real nats-server: idempotency, expiry, checks, leadership, audit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from autoscaler.commands.service import CommandService, CommandSettings
from tests.helpers import ShiftedClock, broker_subscriptions, wait_for
from warmpool import protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import AuditRecord, DecisionRow, OnCallSchedule, Override, ScaledObjectSpec, StatusRow
from warmpool.registry import KvSlotStore
from warmpool.seed import seed_pool


def make_spec(model: str, lo: int = 1, hi: int = 8) -> ScaledObjectSpec:
    return msgspec.convert(
        {
            "scaleTargetRef": {"name": model},
            "minReplicaCount": lo,
            "maxReplicaCount": hi,
            "triggers": [{"type": "gateway-queue", "metadata": {"model": model}}],
        },
        ScaledObjectSpec,
    )


class ControlPlaneDouble:
    """An in-memory `ControlPlane` for these tests. The real controller (`autoscaler.daemon.Autoscaler`)
    replaces it in the integration tests; this one records what the command plane asked of it."""

    def __init__(self, specs: dict[str, ScaledObjectSpec]) -> None:
        self.specs = specs
        self.overrides: dict[str, Override | None] = {}
        self.calls: list[tuple[str, Override | None]] = []
        self.decisions: dict[str, list[DecisionRow]] = {}
        self.fail_next: Exception | None = None
        self.schedules: dict[str, tuple[OnCallSchedule, ...]] = {}

    def spec_for(self, model: str) -> ScaledObjectSpec | None:
        return self.specs.get(model)

    def models(self) -> list[str]:
        return sorted(self.specs)

    async def set_override(self, model: str, override: Override | None) -> None:
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err
        self.calls.append((model, override))
        self.overrides[model] = override

    def schedules_for(self, model: str) -> tuple[OnCallSchedule, ...]:
        return self.schedules.get(model, ())

    async def set_schedules(self, model: str, schedules: tuple[OnCallSchedule, ...]) -> None:
        self.schedules[model] = schedules

    def status(self, model: str | None) -> list[StatusRow]:
        rows = []
        for m in sorted(self.specs):
            if model is not None and m != model:
                continue
            o = self.overrides.get(m)
            desired = o.replicas if o is not None and o.replicas is not None else self.specs[m].min_replica_count
            rows.append(
                StatusRow(
                    model=m,
                    scaler=f"default.{m}",
                    desired=desired,
                    ready=desired,
                    activating=0,
                    warm=2,
                    stale=1,
                    mode="override" if o else "stable",
                    override=o,
                    reason="demand 3.0 / target 4 per replica",
                    decisions=self.decisions.get(m, []),
                )
            )
        return rows


@pytest.fixture
def control() -> ControlPlaneDouble:
    return ControlPlaneDouble({"qwen": make_spec("qwen", 1, 8), "llama": make_spec("llama", 0, 4)})


@pytest.fixture
def clock() -> ShiftedClock:
    return ShiftedClock()


@contextlib.asynccontextmanager
async def serving(
    nc: Client, control: ControlPlaneDouble, store: KvSlotStore, **kwargs: Any
) -> AsyncIterator[CommandService]:
    """A started command service over the double, stopped at the end whatever happened."""
    svc = CommandService(nc, control, store, **kwargs)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.stop()


@pytest.fixture
async def service(
    nc: Client, store: KvSlotStore, control: ControlPlaneDouble, clock: ShiftedClock
) -> AsyncIterator[CommandService]:
    await seed_pool(store, "qwen", nodes=2, slots_per_node=2)
    async with serving(nc, control, store, clock=clock) as svc:
        yield svc


def request(verb: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "id": uuid.uuid4().hex, "expires_at": time.time() + 5, "by": "alice@laptop", **fields}


async def send(nc: Client, verb: str, body: dict[str, Any] | bytes) -> dict[str, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await nc.request(protocol.cmd_subject(verb) if verb in protocol.CMD_VERBS else f"pulse.cmd.{verb}", data, 2)
    return json.loads(msg.data)


async def audit_records(nc: Client) -> list[AuditRecord]:
    js = nc.jetstream()
    info = await js.stream_info(protocol.AUDIT_STREAM)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await js.get_msg(protocol.AUDIT_STREAM, seq)
        assert raw.subject is not None and raw.subject.startswith("pulse.audit.")
        assert raw.data is not None
        out.append(protocol.decode(raw.data, AuditRecord))
    return out


# --- applying ---------------------------------------------------------------------------------------------------


async def test_scale_installs_a_timed_override(
    nc: Client, service: CommandService, control: ControlPlaneDouble, clock: ShiftedClock
) -> None:
    clock.shift = 100.0  # the service's clock decides expiry: the request must be valid by it
    before = clock()
    reply = await send(nc, "scale", request("scale", model="qwen", replicas=4, for_s=600, expires_at=clock() + 5))
    assert reply["ok"] is True and reply["v"] == 1
    [(model, override)] = control.calls
    assert model == "qwen" and override is not None
    assert (override.kind, override.replicas, override.by) == ("scale", 4, "alice@laptop")
    assert override.expires_at is not None and before + 600 <= override.expires_at <= clock() + 600
    assert reply["override"]["expires_at"] == override.expires_at


async def test_pause_and_resume(nc: Client, service: CommandService, control: ControlPlaneDouble) -> None:
    assert (await send(nc, "pause", request("pause", model="qwen")))["ok"]
    assert (await send(nc, "pause", request("pause", model="qwen", replicas=2)))["ok"]
    assert (await send(nc, "resume", request("resume", model="qwen")))["ok"]
    assert control.calls == [
        ("qwen", Override(kind="pause", replicas=None, expires_at=None, by="alice@laptop")),
        ("qwen", Override(kind="pause", replicas=2, expires_at=None, by="alice@laptop")),
        ("qwen", None),
    ]


async def test_duplicate_id_is_applied_once_and_answered_alike(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    data = json.dumps(request("scale", model="qwen", replicas=3, for_s=60)).encode()
    first = await nc.request("pulse.cmd.scale", data, 2)
    second = await nc.request("pulse.cmd.scale", data, 2)
    assert second.data == first.data and json.loads(first.data)["ok"]
    assert len(control.calls) == 1
    records = [r for r in await audit_records(nc) if r.id == json.loads(data)["id"]]
    assert [r.applied for r in records] == [True, False]
    assert records[0].reply == records[1].reply
    assert service.outcomes["duplicate"] == 1


async def test_expired_request_is_refused_and_not_applied(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    body = request("scale", model="qwen", replicas=3, for_s=60)
    body["expires_at"] = time.time() - 1
    reply = await send(nc, "scale", body)
    assert reply["ok"] is False and reply["error"]["code"] == "expired"
    assert "expired" in reply["error"]["message"]
    assert control.calls == []
    [record] = await audit_records(nc)
    assert (record.verb, record.id, record.applied, record.reply["error"]["code"]) == (
        "scale",
        body["id"],
        False,
        "expired",
    )


async def test_unknown_model_lists_the_known_ones(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    for verb, extra in (("scale", {"replicas": 2, "for_s": 60}), ("pause", {}), ("resume", {}), ("status", {})):
        reply = await send(nc, verb, request(verb, model="mistral", **extra))
        assert reply["error"]["code"] == "unknown_model", verb
        assert "'mistral'" in reply["error"]["message"] and "llama, qwen" in reply["error"]["message"]
    assert control.calls == []


@pytest.mark.parametrize(
    ("verb", "replicas", "bounds"),
    [("scale", 9, "[1, 8]"), ("scale", 0, "[1, 8]"), ("pause", 12, "[1, 8]")],
)
async def test_replicas_outside_bounds_are_refused(
    nc: Client, service: CommandService, control: ControlPlaneDouble, verb: str, replicas: int, bounds: str
) -> None:
    extra = {"for_s": 60} if verb == "scale" else {}
    reply = await send(nc, verb, request(verb, model="qwen", replicas=replicas, **extra))
    assert reply["error"]["code"] == "out_of_bounds"
    assert bounds in reply["error"]["message"] and "minReplicaCount" in reply["error"]["message"]
    assert control.calls == []


async def test_malformed_commands_are_answered_with_their_reason(nc: Client, service: CommandService) -> None:
    cases: list[tuple[str, dict[str, Any] | bytes, str]] = [
        ("scale", b"{not json", "bad_json"),
        ("scale", b"[1, 2]", "not_object"),
        ("scale", {k: v for k, v in request("scale", model="qwen", for_s=60).items()}, "missing_field"),
        ("scale", request("scale", model="Qwen.7b", replicas=1, for_s=60), "bad_name"),
        ("scale", request("scale", model="qwen", replicas=-1, for_s=60), "negative"),
        ("scale", request("scale", model="qwen", replicas=1, for_s=0), "bad_value"),
        ("scale", {**request("scale", model="qwen", replicas=1, for_s=60), "v": 2}, "bad_version"),
        ("frobnicate", request("frobnicate"), "bad_value"),
    ]
    for verb, body, code in cases:
        reply = await send(nc, verb, body)
        assert reply["ok"] is False and reply["error"]["code"] == code, (body, reply)
    # ... and the service keeps going.
    assert (await send(nc, "status", request("status")))["ok"]
    assert service.rejections.total() == len(cases)
    records = await audit_records(nc)
    assert len(records) == len(cases) + 1 and not any(r.applied for r in records[:-1])
    assert records[0].request == {"raw": "{not json", "bytes": 9}
    assert records[3].by == "alice@laptop" and records[3].request["model"] == "Qwen.7b"


async def test_a_failing_controller_is_an_internal_error_not_a_crash(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    control.fail_next = RuntimeError("KV write timed out")
    body = request("pause", model="qwen")
    reply = await send(nc, "pause", body)
    assert reply["error"]["code"] == "internal" and "KV write timed out" in reply["error"]["message"]
    # Not remembered: the same id retried is tried again.
    assert (await send(nc, "pause", body))["ok"]
    assert len(control.calls) == 1


# --- reading ----------------------------------------------------------------------------------------------------


async def test_status_rows_and_decision_trim(nc: Client, service: CommandService, control: ControlPlaneDouble) -> None:
    control.decisions["qwen"] = [DecisionRow(ts=float(i), desired=i, reason=f"r{i}") for i in range(25)]
    reply = await send(nc, "status", request("status"))
    assert [r["model"] for r in reply["models"]] == ["llama", "qwen"]
    qwen = reply["models"][1]
    assert [d["desired"] for d in qwen["decisions"]] == list(range(15, 25))  # the newest 10, newest last
    one = await send(nc, "status", request("status", model="llama"))
    assert [r["model"] for r in one["models"]] == ["llama"]
    # The audit keeps a summary of read replies, not the rows.
    assert (await audit_records(nc))[-1].reply == {"ok": True, "models": 1}


async def test_pool_lists_slots_with_agent_freshness(nc: Client, service: CommandService, store: KvSlotStore) -> None:
    await seed_pool(store, "llama", nodes=1, slots_per_node=1, lease_s=0.001, node_prefix="old")
    # A lease is fresh for lease_s after the view *heard* it (revision 10): on a busy machine the watch can deliver
    # it just before the request is handled, within that millisecond; ask once it has lapsed as heard.
    await wait_for(lambda: store.index.lease_verdict("old-0") == "lapsed", 5, "old-0's lease heard and lapsed")
    reply = await send(nc, "pool", request("pool"))
    assert reply["counts"] == {"llama": {"warm": 1}, "qwen": {"warm": 4}}
    by_key = {s["key"]: s for s in reply["slots"]}
    # Revision 10: the agent's clock against ours, from its heartbeat (here our own write: milliseconds).
    skew_s = by_key["qwen.node-0.s0"].pop("skew_s")
    assert isinstance(skew_s, float) and abs(skew_s) < 1.0, skew_s
    assert by_key["qwen.node-0.s0"] == {
        "key": "qwen.node-0.s0",
        "model": "qwen",
        "node": "node-0",
        "rack": "rack-0",
        "state": "warm",
        "drain": False,
        "agent": "fresh",
        "resident": True,
        "endpoint": None,
        "reason": None,
        "engine": None,
        "engine_mode": None,
        "rootfs_mounted": True,  # as seeded: the slot record's, copied (revision 4)
        "image_digest": None,
    }
    assert by_key["llama.old-0.s0"]["agent"] == "stale"
    only = await send(nc, "pool", request("pool", model="llama"))
    assert [s["key"] for s in only["slots"]] == ["llama.old-0.s0"]
    assert (await send(nc, "pool", request("pool", model="mistral")))["error"]["code"] == "unknown_model"


async def test_a_big_pool_is_cut_to_fit_the_message_cap_but_counted_whole(
    nc: Client, service: CommandService, store: KvSlotStore
) -> None:
    long_prefix = "rack-row-" + "n" * 50  # long node names: a few hundred slots exceed 64 KiB
    await seed_pool(store, "llama", nodes=30, slots_per_node=10, node_prefix=long_prefix)
    msg = await nc.request("pulse.cmd.pool", json.dumps(request("pool")).encode(), 5)
    assert len(msg.data) <= protocol.MAX_MESSAGE_BYTES
    reply = protocol.decode(msg.data, protocol.PoolReply)
    assert reply.ok and reply.counts == {"llama": {"warm": 300}, "qwen": {"warm": 4}}
    assert 0 < len(reply.slots) < 304 and reply.truncated == 304 - len(reply.slots)
    assert len(msg.data) > protocol.MAX_MESSAGE_BYTES // 4  # halved at most twice: not cut to nothing


async def test_replies_are_the_contracts_types(nc: Client, service: CommandService) -> None:
    async def raw(verb: str, **fields: Any) -> bytes:
        return (await nc.request(f"pulse.cmd.{verb}", json.dumps(request(verb, **fields)).encode(), 2)).data

    scaled = protocol.decode(await raw("scale", model="qwen", replicas=3, for_s=60), protocol.OverrideReply)
    assert scaled.ok and scaled.model == "qwen" and scaled.override is not None and scaled.override.replicas == 3
    resumed = protocol.decode(await raw("resume", model="qwen"), protocol.OverrideReply)
    assert resumed.ok and resumed.override is None
    status = protocol.decode(await raw("status", model="qwen"), protocol.StatusReply)
    assert [(r.model, r.warm, r.stale) for r in status.models] == [("qwen", 2, 1)]
    drained = protocol.decode(await raw("drain", node="node-0"), protocol.DrainReply)
    assert drained.drained and drained.touched == ["qwen.node-0.s0", "qwen.node-0.s1"]
    # A refusal is the envelope alone, whatever the verb (no empty pool), and reads as any verb's reply.
    refused = await raw("pool", model="mistral")
    assert set(json.loads(refused)) <= {"v", "ok", "error", "reason"}
    pool = protocol.decode(refused, protocol.PoolReply)
    assert not pool.ok and pool.error is not None and pool.error.code == "unknown_model"


async def test_drain_and_undrain_touch_the_nodes_slots(nc: Client, service: CommandService, store: KvSlotStore) -> None:
    reply = await send(nc, "drain", request("drain", node="node-1"))
    assert reply["touched"] == ["qwen.node-1.s0", "qwen.node-1.s1"] and reply["drained"] is True
    assert {r.key: r.state for r in store.records("qwen")}["qwen.node-1.s0"] == "draining"
    again = await send(nc, "drain", request("drain", node="node-1"))  # a repeat is harmless
    assert again["ok"] and {r.key: r.state for r in store.records("qwen")}["qwen.node-1.s1"] == "draining"
    back = await send(nc, "undrain", request("undrain", node="node-1"))
    assert back["touched"] == ["qwen.node-1.s0", "qwen.node-1.s1"]
    assert {r.state for r in store.records("qwen")} == {"warm"}
    unknown = await send(nc, "drain", request("drain", node="node-9"))
    assert unknown["error"]["code"] == "unknown_node" and "node-0, node-1" in unknown["error"]["message"]


async def test_every_command_is_audited(nc: Client, service: CommandService) -> None:
    bodies = [
        ("scale", request("scale", model="qwen", replicas=2, for_s=30)),
        ("pause", request("pause", model="qwen")),
        ("resume", request("resume", model="qwen")),
        ("status", request("status")),
        ("pool", request("pool")),
        ("drain", request("drain", node="node-0")),
        ("undrain", request("undrain", node="node-0")),
        ("scale", request("scale", model="qwen", replicas=99, for_s=30)),
    ]
    for verb, body in bodies:
        await send(nc, verb, body)
    records = await audit_records(nc)
    assert [(r.verb, r.id) for r in records] == [(v, b["id"]) for v, b in bodies]
    assert [r.applied for r in records] == [True] * 7 + [False]
    assert all(r.by == "alice@laptop" and r.ts > 0 for r in records)
    assert records[0].request["replicas"] == 2 and records[0].reply["ok"] is True
    assert records[-1].reply["error"]["code"] == "out_of_bounds"
    info = await nc.jetstream().stream_info(protocol.AUDIT_STREAM)
    assert info.config.subjects == [protocol.AUDIT_WILDCARD]
    assert info.config.max_age == CommandSettings().audit_max_age_s


async def test_message_without_reply_subject_is_still_applied_and_audited(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    await nc.publish("pulse.cmd.pause", json.dumps(request("pause", model="llama")).encode())
    for _ in range(100):
        if control.calls:
            break
        await asyncio.sleep(0.02)
    assert control.calls == [("llama", Override(kind="pause", replicas=None, expires_at=None, by="alice@laptop"))]
    records = await audit_records(nc)
    assert records and records[-1].verb == "pause" and records[-1].applied


# --- leadership -------------------------------------------------------------------------------------------------


async def test_only_the_leader_subscribes(nc: Client, store: KvSlotStore, control: ControlPlaneDouble) -> None:
    leading = False
    svc = CommandService(
        nc, control, store, holds_shards=lambda: leading, settings=CommandSettings(leadership_poll_s=0.02)
    )
    await svc.start()
    try:
        assert not svc.subscribed
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request("pulse.cmd.status", json.dumps(request("status")).encode(), 1)
        leading = True
        for _ in range(200):
            if svc.subscribed:
                break
            await asyncio.sleep(0.01)
        assert (await send(nc, "status", request("status")))["ok"]
        leading = False
        for _ in range(200):
            if not svc.subscribed:
                break
            await asyncio.sleep(0.01)
        assert not svc.subscribed
        leading = True  # elected: the election's state says so before it calls back
        svc.on_leadership(True)  # the election's callback: subscribes without waiting for the poll
        for _ in range(5):  # a few loop turns, far less than the 20 ms poll
            await asyncio.sleep(0)
        assert svc.subscribed
    finally:
        await svc.stop()
    assert not svc.subscribed


async def test_a_callback_saying_leading_after_the_lead_was_lost_does_not_subscribe(
    nc: Client, store: KvSlotStore, control: ControlPlaneDouble
) -> None:
    """`on_leadership` runs later than it was called: a burst of shard losses calls it with "still leading" for
    every shard but the last, and those may run after the last one's "not leading"."""
    async with serving(
        nc, control, store, holds_shards=lambda: False, settings=CommandSettings(leadership_poll_s=60)
    ) as svc:
        svc.on_leadership(True)
        for _ in range(5):
            await asyncio.sleep(0)
        assert not svc.subscribed


async def test_leadership_that_flaps_while_the_broker_is_down_leaves_one_subscription(
    nats_server: NatsServer, nc: Client, store: KvSlotStore, control: ControlPlaneDouble
) -> None:
    """Deposed, elected and deposed again while nats-py reconnects, leading once the broker is back. nats-py
    queues the SUB of a subscription made while it reconnects and, when that one is dropped before the
    reconnect, sends that SUB anyway with no UNSUB: the broker held two queue-group subscriptions on
    ``pulse.cmd.*`` for this connection, one never read, and every other command went unanswered."""
    leading = True
    settings = CommandSettings(leadership_poll_s=0.02)
    async with serving(nc, control, store, holds_shards=lambda: leading, settings=settings) as svc:
        nats_server.kill()
        await wait_for(lambda: nc.is_reconnecting, 5, "nats-py to see the broker go")
        for leading in (False, True, False):
            await svc.set_leading(leading)
            await asyncio.sleep(0.05)  # and the poll's turns in between
        leading = True
        nats_server.restart()
        await wait_for(lambda: nc.is_connected and svc.subscribed, 10, "connected and answering again")
        await nc.flush()
        subs = broker_subscriptions(nats_server, "pytest")
        assert {s: n for s, n in subs.items() if ".cmd." in s[0]} == {(protocol.CMD_WILDCARD, settings.queue_group): 1}
        for _ in range(6):
            assert (await send(nc, "status", request("status")))["ok"]


async def test_a_deposed_leader_refuses_until_it_unsubscribes(
    nc: Client, store: KvSlotStore, control: ControlPlaneDouble
) -> None:
    leading = True
    svc = CommandService(
        nc, control, store, holds_shards=lambda: leading, settings=CommandSettings(leadership_poll_s=60)
    )
    await svc.start()
    try:
        leading = False  # lost the lease; the poll has not noticed yet
        body = request("pause", model="qwen")
        reply = await send(nc, "pause", body)
        assert reply["error"]["code"] == "not_leader" and control.calls == []
        leading = True  # not remembered: the retry is applied
        assert (await send(nc, "pause", body))["ok"]
        assert len(control.calls) == 1
    finally:
        await svc.stop()


async def test_two_replicas_answer_each_request_once(
    nc: Client, store: KvSlotStore, control: ControlPlaneDouble
) -> None:
    """The overlap of an old and a new leader: the queue group delivers each request to one of them."""
    services = [CommandService(nc, control, store) for _ in range(2)]
    for s in services:
        await s.start()
    try:
        for i in range(6):
            assert (await send(nc, "pause", request("pause", model="qwen", replicas=i + 1)))["ok"]
    finally:
        for s in services:
            await s.stop()
    assert len(control.calls) == 6
    assert len(await audit_records(nc)) == 6


# --- where a request came from and where its answer goes (issue 8 review) ----------------------------------------


async def test_a_reply_subject_outside_the_inboxes_is_never_written(
    nc: Client, service: CommandService, store: KvSlotStore, control: ControlPlaneDouble
) -> None:
    """On-call's ``pulse.cmd.status`` with reply ``$KV.pulse_slots.<key>`` made the autoscaler overwrite that slot
    (its grants cover the bucket): the request is dropped, counted, neither applied nor answered."""
    key = next(r.key for r in store.records("qwen"))
    _, rev = await store.get(key)
    pause = json.dumps(request("pause", model="qwen")).encode()
    await nc.publish("pulse.cmd.pause", pause, reply=f"$KV.{protocol.SLOTS_BUCKET}.{key}")
    await send(nc, "status", request("status"))  # answered after the first one was handled
    assert (await store.get(key))[1] == rev
    assert control.calls == []
    assert service.rejections.counts["bad_value"] == 1 and service.outcomes["dropped_bad_value"] == 1
    assert [r.verb for r in await audit_records(nc)] == ["status"]


async def test_a_message_relayed_from_another_subject_is_dropped_unanswered(
    nc: Client, service: CommandService, control: ControlPlaneDouble
) -> None:
    """A push consumer of a bucket delivers onto our subject with the stored message's own subject (``$KV...``)
    and a ``$JS.ACK...`` reply. Built here as the server delivers it (nats-server 2.15 delivers a push consumer
    only to literal interest, which the service's wildcard subscription is not; older servers did)."""
    inbox = nc.new_inbox()
    replies = await nc.subscribe(inbox)
    relayed = Msg(nc, subject=f"$KV.{protocol.SLOTS_BUCKET}.qwen.n2.relay", reply=inbox,
                  data=json.dumps(request("pause", model="qwen")).encode())  # fmt: skip
    await service._on_msg(relayed)
    await nc.publish(inbox, b"marker")  # same connection: an answer to the relay would arrive first
    assert (await replies.next_msg(timeout=2)).data == b"marker"
    assert control.calls == []
    assert service.rejections.counts["subject_mismatch"] == 1
    assert (await nc.jetstream().stream_info(protocol.AUDIT_STREAM)).state.messages == 0  # not even audited
