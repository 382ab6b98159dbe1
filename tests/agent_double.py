"""A protocol-level double of the node agent, for autoscaler tests that need agents to misbehave on cue.

It speaks exactly the agent's side of wire contract v1 — heartbeats in `pulse_agents`, slot records in
`pulse_slots`, request/reply on `pulse.agent.<node>.{activate,deactivate}` with fencing checks against the
registry — but runs no engine. The real agent (nodeagent) is exercised end to end in its own tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Literal

from nats.aio.client import Client
from nats.aio.msg import Msg

from warmpool import protocol
from warmpool.errors import PulsescaleError
from warmpool.protocol import AgentLease, SlotRecord
from warmpool.registry import KvSlotStore

Behaviour = Literal["ok", "silent", "refuse"]


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
    activation_delay_s: float = 0.0
    lease_s: float = 2.0
    activations: list[str] = field(default_factory=list)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _subs: list[object] = field(default_factory=list)

    async def start(self) -> AgentDouble:
        names = [f"s{i}" for i in range(self.slots)]
        await self.beat()
        for name in names:
            await self.store.register(
                SlotRecord(model=self.model, node=self.node, slot=name, state="warm", rack=self.rack,
                           weights_resident=self.resident, rootfs_mounted=self.resident, updated_at=time.time())
            )  # fmt: skip
        self._subs.append(await self.nc.subscribe(protocol.agent_subject(self.node, "activate"), cb=self._activate))
        self._subs.append(await self.nc.subscribe(protocol.agent_subject(self.node, "deactivate"), cb=self._deactivate))
        self._tasks.append(asyncio.create_task(self._heartbeat()))
        return self

    async def beat(self) -> None:
        await self.store.heartbeat(
            AgentLease(node=self.node, heartbeat_at=time.time(), lease_s=self.lease_s, rack=self.rack)
        )

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 4)
            with contextlib.suppress(Exception):
                await self.beat()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()  # type: ignore[attr-defined]

    async def _activate(self, msg: Msg) -> None:
        if self.behaviour == "silent":
            return
        req = protocol.decode(msg.data, protocol.ActivateRequest)
        key = protocol.slot_key(self.model, self.node, req.slot)
        self.activations.append(key)
        if self.behaviour == "refuse":
            await msg.respond(protocol.error_reply("engine_failed", "the double refuses"))
            return
        rec, _ = await self.store.get(key)
        if rec.claim_id != req.claim_id:
            await msg.respond(protocol.error_reply("foreign_claim", f"{key} is held by {rec.claim_id}"))
            return
        t0 = time.perf_counter()
        try:
            await self.store.set_state(key, "activating", expect=["claimed"], token=req.token)
            await asyncio.sleep(self.activation_delay_s)
            endpoint = f"http://{self.node}.test:8000"
            await self.store.set_state(key, "ready", expect=["activating"], endpoint=endpoint)
        except PulsescaleError as err:
            await msg.respond(protocol.error_reply(err.code, str(err)))
            return
        total_ms = (time.perf_counter() - t0) * 1e3
        await msg.respond(protocol.ok_reply(endpoint=endpoint, timings={"total_ms": total_ms, "load_ms": 0.0}))

    async def _deactivate(self, msg: Msg) -> None:
        if self.behaviour == "silent":
            return
        req = protocol.decode(msg.data, protocol.DeactivateRequest)
        key = protocol.slot_key(self.model, self.node, req.slot)
        with contextlib.suppress(PulsescaleError):
            claim = self.store.adopt(key)
            if claim is not None and claim.claim_id == (req.claim_id or claim.claim_id):
                await self.store.release(claim, reason="deactivated")
        await msg.respond(protocol.ok_reply())
