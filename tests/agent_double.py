"""A protocol-level double of the node agent, for autoscaler tests that need agents to misbehave on cue.

It speaks exactly the agent's side of wire contract v1 — heartbeats in `pulse_agents` (with the renewal interval,
revision 2), slot records in `pulse_slots`, request/reply on `pulse.agent.<node>.{activate,deactivate}` with the
typed replies (`ActivateReply`, `DeactivateReply`) and fencing checks against the registry; as the holder it
writes `activating` and then `ready` (with the endpoint) before it replies — but runs no engine. Like the real
agent it handles each request in its own task, one activation per slot at a time, and answers a repeat of an
activation that succeeded (same token and claim) with `ready` again: a successor finishing a predecessor's claim
sends exactly that. The real agent (nodeagent) is exercised end to end in its own tests.

Behaviours: ``ok``; ``silent`` (never answers); ``refuse`` (answers `refuse_code`, ``engine_failed`` by default).
`stop_heartbeat()` makes the agent look dead to the registry while it keeps answering.

A *malicious* node, for the security tests (DESIGN, "Trust boundaries"): ``lie_endpoint`` writes its fenced
``ready`` with its own endpoint but replies with `reply_endpoint` (an address outside the cluster);
``no_ready_write`` replies ready without writing anything; `heartbeat_ahead_s` dates every heartbeat that far in
the future; `put_raw_lease` writes a lease the contract refuses (``lease_s`` over `protocol.MAX_LEASE_S`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg

from warmpool import protocol
from warmpool.errors import InvalidTransition, PulsescaleError
from warmpool.protocol import ActivateReply, AgentLease, DeactivateReply, SlotRecord, StageTimings
from warmpool.registry import KvSlotStore, ensure_buckets

Behaviour = Literal["ok", "silent", "refuse", "lie_endpoint", "no_ready_write"]


@dataclass
class AgentDouble:
    nc: Client
    store: KvSlotStore
    node: str
    model: str
    slots: int = 2
    rack: str = "rack-0"
    resident: bool = True
    behaviour: Behaviour = "ok"
    refuse_code: str = "engine_failed"
    activation_delay_s: float = 0.0
    lease_s: float = 2.0
    heartbeat_every_s: float | None = None
    """Renewal interval, also written in the lease; default a quarter of `lease_s`."""
    heartbeat_ahead_s: float = 0.0
    """Date heartbeats this far ahead of the wall clock (a forged or clock-broken lease)."""
    reply_endpoint: str = "http://203.0.113.66:8000"
    """The endpoint ``lie_endpoint`` puts in its reply (TEST-NET-3: outside any cluster)."""
    activations: list[str] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _subs: list[object] = field(default_factory=list)
    _requests: set[asyncio.Task[None]] = field(default_factory=set)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    @property
    def every_s(self) -> float:
        return self.heartbeat_every_s if self.heartbeat_every_s is not None else self.lease_s / 4

    async def start(self) -> AgentDouble:
        names = [f"s{i}" for i in range(self.slots)]
        await self.beat()
        for name in names:
            await self.store.register(
                SlotRecord(model=self.model, node=self.node, slot=name, state="warm", rack=self.rack,
                           weights_resident=self.resident, rootfs_mounted=self.resident, updated_at=time.time())
            )  # fmt: skip
        for verb, handler in (("activate", self._activate), ("deactivate", self._deactivate)):
            subject = protocol.agent_subject(self.node, verb)
            self._subs.append(await self.nc.subscribe(subject, cb=self._spawner(handler)))
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        return self

    async def beat(self) -> None:
        lease = AgentLease(
            node=self.node,
            slots=[f"s{i}" for i in range(self.slots)],
            heartbeat_at=time.time() + self.heartbeat_ahead_s,
            lease_s=self.lease_s,
            rack=self.rack,
            heartbeat_every_s=self.every_s,
        )
        await self.store.heartbeat(lease)

    async def _heartbeat(self) -> None:
        # As the real agent: one write per interval, each waiting for its acknowledgement (or a timeout).
        while True:
            await asyncio.sleep(self.every_s)
            with contextlib.suppress(Exception):
                await self.beat()

    async def put_raw_lease(self, **fields: object) -> None:
        """Write this node's lease as raw JSON, bypassing `AgentLease`'s checks (a lease the contract refuses);
        `fields` override the honest lease's. Heartbeats stop, so the raw lease stays."""
        self.stop_heartbeat()
        raw = {"v": protocol.VERSION, "node": self.node, "slots": [f"s{i}" for i in range(self.slots)],
               "heartbeat_at": time.time(), "lease_s": self.lease_s,
               "rack": self.rack, "heartbeat_every_s": self.every_s, **fields}  # fmt: skip
        kv = (await ensure_buckets(self.nc.jetstream()))[protocol.AGENTS_BUCKET]
        await kv.put(self.node, msgspec.json.encode(raw))

    def _spawner(self, handler: Callable[[Msg], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
        """A subscription callback that handles each request in its own task, as the real agent does: nats-py
        runs one callback at a time per subscription, which would serialise every activation on the node."""

        async def cb(msg: Msg) -> None:
            task = asyncio.create_task(handler(msg))
            self._requests.add(task)
            task.add_done_callback(self._requests.discard)

        return cb

    def stop_heartbeat(self) -> None:
        for t in self._tasks:
            t.cancel()

    async def stop(self) -> None:
        self.stop_heartbeat()
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()  # type: ignore[attr-defined]
        for t in list(self._requests):
            t.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)

    async def _activate(self, msg: Msg) -> None:
        if self.behaviour == "silent":
            return
        req = protocol.decode(msg.data, protocol.ActivateRequest)
        key = protocol.slot_key(self.model, self.node, req.slot)
        self.activations.append(key)
        if self.behaviour == "refuse":
            await self._reply(
                msg, protocol.refusal(ActivateReply, self.refuse_code, "the double refuses", slot=req.slot)
            )
            return
        if self.behaviour == "no_ready_write":
            reply = ActivateReply(slot=req.slot, key=key, state="ready", endpoint=self.reply_endpoint,
                                  token=req.token, claim_id=req.claim_id)  # fmt: skip
            await self._reply(msg, reply)
            return
        async with self._locks.setdefault(key, asyncio.Lock()):
            await self._activate_locked(msg, req, key)

    async def _activate_locked(self, msg: Msg, req: protocol.ActivateRequest, key: str) -> None:
        rec, _ = await self.store.get(key)
        if rec.state == "ready" and rec.claim_id == req.claim_id and rec.token == req.token:
            endpoint = self.reply_endpoint if self.behaviour == "lie_endpoint" else rec.endpoint
            repeat = ActivateReply(slot=req.slot, key=key, state="ready", endpoint=endpoint, token=req.token,
                                   claim_id=req.claim_id, repeated=True)  # fmt: skip
            await self._reply(msg, repeat)  # a repeat of an activation that succeeded, as the real agent answers
            return
        if rec.claim_id != req.claim_id:
            refusal = protocol.refusal(
                ActivateReply, "foreign_claim", f"{key} is held by {rec.claim_id}", slot=req.slot
            )
            await self._reply(msg, refusal)
            return
        t0 = time.perf_counter()
        try:
            await self.store.set_state(key, "activating", expect=["claimed"], token=req.token)
            await asyncio.sleep(self.activation_delay_s)
            endpoint = f"http://{self.node}.test:8000"
            await self.store.set_state(key, "ready", expect=["activating"], endpoint=endpoint)
        except InvalidTransition as err:  # released or taken meanwhile
            await self._reply(msg, protocol.refusal(ActivateReply, "not_claimed", str(err), slot=req.slot))
            return
        except PulsescaleError as err:
            await self._reply(msg, protocol.refusal(ActivateReply, "registry_unavailable", str(err), slot=req.slot))
            return
        total_ms = (time.perf_counter() - t0) * 1e3
        timings = StageTimings(load_ms=0.0, engine_ms=0.0, readiness_ms=0.0, total_ms=total_ms)
        if self.behaviour == "lie_endpoint":
            endpoint = self.reply_endpoint
        reply = ActivateReply(slot=req.slot, key=key, state="ready", endpoint=endpoint, token=req.token,
                              claim_id=req.claim_id, timings=timings)  # fmt: skip
        await self._reply(msg, reply)

    async def _deactivate(self, msg: Msg) -> None:
        if self.behaviour == "silent":
            return
        req = protocol.decode(msg.data, protocol.DeactivateRequest)
        key = protocol.slot_key(self.model, self.node, req.slot)
        with contextlib.suppress(PulsescaleError):
            claim = self.store.adopt(key)
            if claim is not None and claim.claim_id == req.claim_id:
                await self.store.release(claim, reason="deactivated")
        await self._reply(msg, DeactivateReply(slot=req.slot, key=key))

    @staticmethod
    async def _reply(msg: Msg, reply: ActivateReply | DeactivateReply) -> None:
        await msg.respond(protocol.encode(reply))
