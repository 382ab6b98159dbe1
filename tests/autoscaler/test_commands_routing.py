"""On-call commands with models sharded over autoscaler replicas (protocol revision 6), against a real nats-server:
2-3 `CommandService`s, each on its own connection, each with a `FixedRouter` — a fixture serving a fixed owner map
in place of the shard leases (`autoscaler.shards.leases.ShardLeases`), so the test says who owns what.

What must hold: a command reaches the model's owner whichever replica the queue group hands it to, with exactly
one reply and one audit record; a model nobody owns is refused ``not_leader``; a hand-over that raced a
rebalance is refused, never handed on again; ``status`` merges every replica's rows with owner and shard and
names a silent replica within its bound instead of hanging."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from typing import Any

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from autoscaler.commands.service import CommandService, CommandSettings
from tests.autoscaler.test_commands import ControlPlaneDouble, audit_records, make_spec, request
from warmpool import connect, protocol
from warmpool.embedded import NatsServer
from warmpool.protocol import ReplicaRecord
from warmpool.registry import KvSlotStore

MODELS = ("qwen", "llama", "mistral")
OWNERS = {"qwen": "b", "llama": "c", "mistral": "a"}


class FixedRouter:
    """A `Router` over a fixed owner map (each replica its own copy, so a test can make two views disagree)."""

    def __init__(self, identity: str, owners: dict[str, str | None], live: Sequence[str]) -> None:
        self.identity = identity
        self.owners = owners
        self.live = list(live)

    def owns_model(self, model: str) -> bool:
        return self.owners.get(model) == self.identity

    def owner_of_model(self, model: str) -> str | None:
        return self.owners.get(model)

    def replicas(self) -> list[ReplicaRecord]:
        now = time.time()
        return [
            ReplicaRecord(
                identity=i,
                renewed_at=now,
                lease_s=5.0,
                started_at=now - 60,
                shards=sorted({protocol.shard_of(m) for m, o in self.owners.items() if o == i}),
                models=sum(1 for o in self.owners.values() if o == i),
            )
            for i in self.live
        ]


class Fleet:
    def __init__(self) -> None:
        self.services: dict[str, CommandService] = {}
        self.controls: dict[str, ControlPlaneDouble] = {}
        self.routers: dict[str, FixedRouter] = {}

    def handed_over(self) -> int:
        return sum(s.outcomes["handed_over"] for s in self.services.values())


@pytest.fixture
async def fleet_of(nats_server: NatsServer, store: KvSlotStore) -> AsyncIterator[Any]:
    """``await fleet_of(["a", "b"], owners)``: replicas on their own connections; all stopped at the end."""
    async with AsyncExitStack() as stack:

        async def start(
            identities: Sequence[str],
            owners: dict[str, str | None] | None = None,
            settings: CommandSettings | None = None,
            live: Sequence[str] | None = None,
        ) -> Fleet:
            fleet = Fleet()
            for ident in identities:
                nc = await connect.connect(connect.NatsOptions(servers=(nats_server.url,), name=f"replica-{ident}"))
                stack.push_async_callback(nc.close)
                control = ControlPlaneDouble({m: make_spec(m, 0, 8) for m in MODELS})
                router = FixedRouter(ident, dict(owners or OWNERS), live or identities)
                svc = CommandService(nc, control, store, router=router, settings=settings or CommandSettings())
                await svc.start()
                stack.push_async_callback(svc.stop)
                fleet.services[ident], fleet.controls[ident], fleet.routers[ident] = svc, control, router
            return fleet

        yield start


async def ask(nc: Client, verb: str, body: dict[str, Any], *, linger_s: float = 0.0) -> list[dict[str, Any]]:
    """Every reply the request gets within its first reply plus `linger_s` (a duplicate would show here)."""
    inbox = nc.new_inbox()
    got: list[Msg] = []
    first = asyncio.Event()

    async def on_reply(msg: Msg) -> None:
        got.append(msg)
        first.set()

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        await nc.publish(protocol.cmd_subject(verb), json.dumps(body).encode(), reply=inbox)
        await asyncio.wait_for(first.wait(), 3)
        await asyncio.sleep(linger_s)
    finally:
        await sub.unsubscribe()
    return [json.loads(m.data) for m in got]


async def test_a_command_reaches_the_owner_whichever_replica_the_queue_group_picks(nc: Client, fleet_of: Any) -> None:
    fleet = await fleet_of(["a", "b", "c"])
    sent: list[str] = []
    for i in range(30):
        model = MODELS[i % 3]
        body = request("scale", model=model, replicas=1 + i % 4, for_s=60)
        sent.append(body["id"])
        replies = await ask(nc, "scale", body, linger_s=0.02 if i % 10 == 0 else 0.0)
        assert len(replies) == 1 and replies[0]["ok"], replies
        assert replies[0]["model"] == model
    await asyncio.sleep(0.1)  # a duplicate reply or a loop would still be in flight
    for ident, control in fleet.controls.items():
        # Each replica applied exactly the requests of its own model, whichever replica received them.
        assert {m for m, _ in control.calls} == {m for m, o in OWNERS.items() if o == ident}
        assert len(control.calls) == 10
    assert fleet.handed_over() > 0  # 30 requests over 3 fronts: about 20 landed elsewhere than their owner
    records = [r for r in await audit_records(nc) if r.verb == "scale"]
    assert sorted(r.id for r in records) == sorted(sent)  # one audit record per request, by its owner
    assert all(r.applied for r in records)


async def test_a_request_for_a_model_nobody_owns_is_refused_not_leader(nc: Client, fleet_of: Any) -> None:
    fleet = await fleet_of(["a", "b"], {**OWNERS, "llama": None, "qwen": "b", "mistral": "a"})
    body = request("pause", model="llama")
    replies = await ask(nc, "pause", body, linger_s=0.05)
    assert len(replies) == 1 and not replies[0]["ok"]
    err = replies[0]["error"]
    assert err["code"] == "not_leader"
    assert f"model llama (shard {protocol.shard_of('llama')})" in err["message"]
    assert "handing over; retry" in err["message"]
    assert all(c.calls == [] for c in fleet.controls.values())
    [record] = [r for r in await audit_records(nc) if r.id == body["id"]]  # refusals are audited too
    assert not record.applied and record.reply["error"]["code"] == "not_leader"


async def test_a_hand_over_that_raced_a_rebalance_is_refused_not_handed_on(nc: Client, fleet_of: Any) -> None:
    """Each replica believes the other owns qwen: whichever receives it hands it over once, the other refuses."""
    fleet = await fleet_of(["a", "b"])
    fleet.routers["a"].owners["qwen"] = "b"
    fleet.routers["b"].owners["qwen"] = "a"
    body = request("scale", model="qwen", replicas=2, for_s=60)
    replies = await ask(nc, "scale", body, linger_s=0.2)
    assert len(replies) == 1 and replies[0]["error"]["code"] == "not_leader", replies
    assert "moved off replica" in replies[0]["error"]["message"]
    assert fleet.handed_over() == 1
    assert sum(s.outcomes["not_leader"] for s in fleet.services.values()) == 1
    assert len([r for r in await audit_records(nc) if r.id == body["id"]]) == 1


async def test_only_this_replicas_hand_over_subject_with_an_inbox_reply_is_accepted(nc: Client, fleet_of: Any) -> None:
    fleet = await fleet_of(["a", "b"])
    subject = protocol.replica_subject("b", "scale")

    def body() -> bytes:
        return json.dumps(request("scale", model="qwen", replicas=2, for_s=60)).encode()

    # The real hand-over subject works: the owner answers directly (so its subscription is in place before the
    # relayed message below; published earlier, that one could reach the server before the subscription).
    msg = await nc.request(subject, body(), timeout=2)
    assert json.loads(msg.data)["ok"]
    # A relayed message: the owner's own subject, but a reply subject that is no inbox (a KV key).
    await nc.publish(subject, body(), reply=f"$KV.{protocol.SLOTS_BUCKET}.x")
    # One connection's messages reach one subscription in order: once the next request is answered, the relayed
    # one has been handled (dropped, counted).
    msg = await nc.request(subject, body(), timeout=2)
    assert json.loads(msg.data)["ok"]
    assert fleet.services["b"].outcomes["dropped_bad_value"] == 1
    assert fleet.controls["b"].calls and fleet.controls["a"].calls == []


async def test_status_merges_every_replicas_rows_with_owner_and_shard(nc: Client, fleet_of: Any) -> None:
    await fleet_of(["a", "b", "c"])
    for _ in range(6):  # whichever replica is the front
        [reply] = await ask(nc, "status", request("status"))
        assert reply["ok"] and reply.get("error") is None, reply
        rows = {r["model"]: (r["owner"], r["shard"]) for r in reply["models"]}
        assert rows == {m: (o, protocol.shard_of(m)) for m, o in OWNERS.items()}
        assert [r["identity"] for r in reply["replicas"]] == ["a", "b", "c"]
    [one] = await ask(nc, "status", request("status", model="llama"))
    assert [(r["model"], r["owner"]) for r in one["models"]] == [("llama", "c")]


async def test_status_names_a_silent_replica_within_the_bound(nc: Client, fleet_of: Any) -> None:
    """Replica d is in the replica records but never answers (hung): the front waits the bound, not forever."""
    hung = await nc.subscribe(protocol.replica_subject("d", "*"))  # takes requests, answers none
    await nc.flush()
    try:
        settings = CommandSettings(peer_status_timeout_s=0.3)
        await fleet_of(["a", "b"], {**OWNERS, "llama": "d"}, settings, live=["a", "b", "d"])
        t0 = time.monotonic()
        [reply] = await ask(nc, "status", request("status"))
        took = time.monotonic() - t0
        assert reply["ok"]
        assert reply["missing"] == ["d"] and reply["error"] is None
        assert sorted(r["model"] for r in reply["models"]) == ["mistral", "qwen"]  # d's llama is missing
        assert took < 3.0  # the bound (0.3 s) plus slack; the CLI gives up at 5 s
    finally:
        await hung.unsubscribe()


async def test_a_status_waiting_on_a_silent_replica_holds_up_no_other_command(nc: Client, fleet_of: Any) -> None:
    """The fan-out of ``status`` waits up to its bound on a hung replica; the commands that arrive meanwhile (an
    on-call ``scale`` in an incident) are answered at once, not after it."""
    hung = await nc.subscribe(protocol.replica_subject("d", "*"))  # takes requests, answers none
    await nc.flush()
    try:
        settings = CommandSettings(peer_status_timeout_s=2.0)
        await fleet_of(["a"], {"qwen": "a", "llama": "d", "mistral": "a"}, settings, live=["a", "d"])
        status = asyncio.ensure_future(ask(nc, "status", request("status")))
        await asyncio.sleep(0.1)  # the fan-out is waiting on d
        t0 = time.monotonic()
        [scaled] = await ask(nc, "scale", request("scale", model="qwen", replicas=2, for_s=60))
        took = time.monotonic() - t0
        assert scaled["ok"], scaled
        assert not status.done() and took < 1.0, f"scale answered after {took:.2f} s, behind the status"
        [reply] = await status
        assert reply["missing"] == ["d"]
    finally:
        await hung.unsubscribe()
