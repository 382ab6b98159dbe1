"""The operator's side of the NATS buckets: the ScaledObjects' records in `pulse_scalers`, and the slots in
`pulse_slots` a deleted one waits for.

`Records` is the only code of the operator that touches either bucket: it reads a record (an unreadable one is
absent), publishes one, withdraws one (a delete marker the autoscaler's watch sees), finds another published record
that scales the same model (the one-ScaledObject-per-model rule, and whether the model's slots stay claimed after a
delete), and lists a model's held slots (`HELD_SLOT_STATES`) for the finalizer. Records are keyed
``<namespace>.<name>`` (`record_key`), as the autoscaler's `StatusRow.key`.
"""

from __future__ import annotations

from typing import Final

import nats.js.errors

from kube.context import OperatorContext
from warmpool import protocol
from warmpool.errors import BadMessage

__all__ = ["HELD_SLOT_STATES", "Records", "record_key"]

HELD_SLOT_STATES: Final = frozenset({"claimed", "activating", "ready", "releasing"})
"""Slot states that mean a model still holds the slot; the finalizer waits until none is left."""


def record_key(namespace: str, name: str) -> str:
    """An object's key in `pulse_scalers` (and its row's `StatusRow.key`)."""
    return f"{namespace}.{name}"


class Records:
    """The records of one `OperatorContext`'s buckets (``ctx.scalers``, ``ctx.slots``)."""

    def __init__(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    async def read(self, key: str) -> protocol.ScalerRecord | None:
        """The record under `key`; None when there is none or it does not decode."""
        try:
            entry = await self.ctx.scalers.get(key)
        except nats.js.errors.KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        try:
            return protocol.decode(entry.value, protocol.ScalerRecord)
        except BadMessage:
            return None  # unreadable: treated as absent, overwritten by the next valid write

    async def publish(self, key: str, record: protocol.ScalerRecord) -> None:
        """Writes the record (the autoscaler's watch sees it)."""
        await self.ctx.scalers.put(key, protocol.encode(record))

    async def withdraw(self, key: str) -> bool:
        """Deletes the record (a delete marker: the autoscaler's watch sees it). True if there was one."""
        if await self.read(key) is None:
            return False
        await self.ctx.scalers.delete(key)
        return True

    async def model_conflict(self, model: str, key: str) -> str | None:
        """Another published record that scales `model`, as a message. The autoscaler runs one controller per model
        and ignores a second record naming it (first seen wins), so this object would look Ready and do nothing.
        Only asked while this object is not published: of two published ones the autoscaler keeps the first."""
        try:
            keys = await self.ctx.scalers.keys()
        except nats.js.errors.NoKeysError:
            return None
        for other in sorted(keys):
            if other == key:
                continue
            record = await self.read(other)
            if record is not None and record.spec.model == model:
                return (
                    f"model {model} is already scaled by ScaledObject {record.namespace}/{record.name} "
                    f"({protocol.SCALERS_BUCKET}/{other}); one ScaledObject per model: delete one of them, or name "
                    "another model in this one's trigger"
                )
        return None

    async def model_still_scaled(self, model: str, except_key: str) -> bool:
        """Whether another ScaledObject's record names `model` (its slots then stay claimed by design)."""
        try:
            keys = await self.ctx.scalers.keys()
        except nats.js.errors.NoKeysError:
            return False
        for k in keys:
            if k == except_key:
                continue
            record = await self.read(k)
            if record is not None and record.spec.model == model:
                return True
        return False

    async def held_slots(self, model: str) -> list[str]:
        """The keys of `model`'s slots that it still holds (`HELD_SLOT_STATES`)."""
        try:
            keys = await self.ctx.slots.keys()
        except nats.js.errors.NoKeysError:
            return []
        held = []
        for k in keys:
            if not k.startswith(f"{model}."):
                continue
            try:
                entry = await self.ctx.slots.get(k)
                if entry.value is None:
                    continue
                slot = protocol.decode(entry.value, protocol.SlotRecord)
            except (nats.js.errors.KeyNotFoundError, BadMessage):
                continue
            if slot.model == model and slot.state in HELD_SLOT_STATES:
                held.append(k)
        return held
