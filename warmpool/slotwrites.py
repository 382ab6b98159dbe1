"""Writing the registry's buckets: the one compare-and-set loop every slot write goes through, reads from the
broker (not the view), and the writes that need no fencing token: the agent's (`register`, `set_state`,
`heartbeat`, `withdraw`, `unregister`) and drains.

Every slot write is ``kv.update(key, value, last=rev)`` on the revision we last saw, so the server decides every
race; a lost race means a re-read and a re-build. Each acknowledged write is applied to the view at once
(`BucketView.apply_local`). The holder's fenced writes are built on `SlotWrites.cas` by `warmpool.claims`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import msgspec
import nats.js.errors
from nats.js.kv import KeyValue

from warmpool import protocol, slots
from warmpool.bucketview import BucketView, Clock, check_record
from warmpool.errors import BadMessage, ClaimConflict, InvalidTransition, SlotNotFound, StaleToken
from warmpool.protocol import AgentLease, SlotRecord, SlotState

__all__ = ["SlotWrites"]


class SlotWrites:
    """Compare-and-set writes of `pulse_slots` and the plain writes of `pulse_agents`, kept in step with the
    views `slots` and `agents`: `cas` (the loop), `get` / `refresh` (broker reads), the agent's side, drains."""

    def __init__(
        self,
        slots_kv: KeyValue,
        agents_kv: KeyValue,
        slots_view: BucketView[SlotRecord],
        agents_view: BucketView[AgentLease],
        *,
        clock: Clock = time.time,
    ) -> None:
        self.clock = clock
        self.slots_kv = slots_kv
        self._agents_kv = agents_kv
        self.slots = slots_view
        self.agents = agents_view

    # --- reading from the broker ----------------------------------------------------------------------------------

    async def get(self, key: str) -> tuple[SlotRecord, int]:
        """Read one slot from the broker (not the view)."""
        try:
            entry = await self.slots_kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            raise SlotNotFound(f"no slot {key} in {protocol.SLOTS_BUCKET}") from None
        assert entry.value is not None and entry.revision is not None
        rec = protocol.decode(entry.value, SlotRecord)
        check_record(key, rec)
        return rec, entry.revision

    async def refresh(self, key: str) -> tuple[SlotRecord, int] | None:
        try:
            rec, rev = await self.get(key)
        except (SlotNotFound, BadMessage):
            self.slots.forget(key)
            return None
        self.slots.apply_local(key, rec, rev)
        return rec, rev

    # --- compare-and-set -------------------------------------------------------------------------------------------

    max_cas_attempts = 8
    """Lost compare-and-sets (another writer got there first) one write retries before `ClaimConflict`."""

    async def _read(self, key: str) -> tuple[SlotRecord | None, int]:
        """(record, revision) from the broker; (None, 0) when the key does not exist, (None, revision) when its
        value breaks the contract (counted)."""
        try:
            entry = await self.slots_kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None, 0
        assert entry.revision is not None
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None, entry.revision
        return self.slots.decode(key, entry.value), entry.revision

    async def cas(
        self,
        key: str,
        build: Callable[[SlotRecord | None, int], Awaitable[SlotRecord | None]],
        *,
        what: str,
        start: tuple[SlotRecord, int] | None = None,
    ) -> tuple[SlotRecord, int] | None:
        """The one compare-and-set loop: write ``await build(current, revision)`` over the slot's record.

        `build` gets None for a key that is absent or unreadable; it returns the record to write, None for
        "nothing to write" (returned as None), or raises to refuse. Another writer winning the race means a
        re-read and a re-build. `start` is a copy we hold (a holder's claim): it may be stale, so a refusal
        (`StaleToken`, `InvalidTransition`) built on it is tried once more on a fresh read before it counts."""
        cur: tuple[SlotRecord | None, int] | None = start
        fresh = start is None
        for _ in range(self.max_cas_attempts):
            if cur is None:
                cur = await self._read(key)
                fresh = True
            rec, rev = cur
            try:
                new = await build(rec, rev)
            except (StaleToken, InvalidTransition):
                if fresh:
                    raise
                cur = None
                continue
            if new is None:
                return None
            try:
                if rev == 0:
                    new_rev = await self.slots_kv.create(key, protocol.encode(new))
                else:
                    new_rev = await self.slots_kv.update(key, protocol.encode(new), last=rev)
            except nats.js.errors.KeyWrongLastSequenceError:
                cur = None
                continue
            self.slots.apply_local(key, new, new_rev)
            return new, new_rev
        raise ClaimConflict(f"slot {key} keeps changing {what}")

    # --- agent side ------------------------------------------------------------------------------------------------

    async def register(self, record: SlotRecord) -> int:
        """Write a slot as its agent sees it (start-up, re-stage). Keeps a pending drain request."""

        async def build(cur: SlotRecord | None, _: int) -> SlotRecord:
            return record if cur is None else msgspec.structs.replace(record, drain=record.drain or cur.drain)

        done = await self.cas(record.key, build, what="while its agent registers it")
        assert done is not None
        return done[1]

    async def set_state(
        self, key: str, state: SlotState, *, expect: Iterable[SlotState] | None = None, **fields: Any
    ) -> tuple[SlotRecord, int]:
        """Agent-side transition by compare-and-set (`warm` after staging, `failed` with a reason, ...).

        `expect` lists the states the slot must be in; anything else raises `InvalidTransition`.
        """
        allowed = set(expect) if expect is not None else None

        async def build(rec: SlotRecord | None, _: int) -> SlotRecord:
            if rec is None:
                raise SlotNotFound(f"no slot {key} in {protocol.SLOTS_BUCKET}")
            if allowed is not None and rec.state not in allowed:
                raise InvalidTransition(f"slot {key} is {rec.state}, expected one of {sorted(allowed)}")
            slots.check_transition(rec.state, state)
            return msgspec.structs.replace(rec, state=state, updated_at=self.clock(), **fields)

        done = await self.cas(key, build, what="under its agent")
        assert done is not None
        return done

    async def heartbeat(self, lease: AgentLease) -> int:
        """Write an agent's lease. One writer per node, so a plain put is enough."""
        rev = await self._agents_kv.put(lease.node, protocol.encode(lease))
        self.agents.apply_local(lease.node, lease, rev)
        return rev

    async def withdraw(self, node: str) -> None:
        """Remove an agent's lease at clean shutdown: its slots stop being claimable at once."""
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self._agents_kv.delete(node)

    async def unregister(self, key: str) -> None:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            await self.slots_kv.delete(key)

    # --- drain ---------------------------------------------------------------------------------------------------

    async def drain(self, node: str) -> list[str]:
        """Stop offering a node's slots: idle ones go to `draining`, held ones finish and go there on release."""
        return await self._drain(node, True)

    async def undrain(self, node: str) -> list[str]:
        return await self._drain(node, False)

    async def _drain(self, node: str, on: bool) -> list[str]:
        async def build(rec: SlotRecord | None, _: int) -> SlotRecord | None:
            if rec is None:
                return None  # gone meanwhile
            if rec.state in slots.HELD_STATES:
                new = msgspec.structs.replace(rec, drain=on)
            elif on:
                new = msgspec.structs.replace(rec, state="draining", drain=True, updated_at=self.clock())
            else:
                state: SlotState = "warm" if rec.state == "draining" else rec.state
                new = msgspec.structs.replace(rec, state=state, drain=False, updated_at=self.clock())
            if msgspec.structs.replace(new, updated_at=rec.updated_at) == rec:
                return None  # already so: a repeated drain changes nothing
            return new

        touched = []
        for key in [r.key for r in self.slots.values() if r.node == node]:
            if await self.cas(key, build, what="while its node is (un)drained") is not None:
                touched.append(key)
        return touched
