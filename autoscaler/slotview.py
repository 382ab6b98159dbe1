"""The slot view's events, applied: the ``pulsescale_slots`` gauges and each change handed to its model.

The gauges are kept from the events (`SlotCounts`: each key's last model and state remembered), not a scan of
every slot per tick; a listing (`Snapshot`, after a reconnect) goes to every controller, a change to the one
controller whose model the key names. The daemon composes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractContextManager

from autoscaler.controller import ModelController
from autoscaler.models import Models
from warmpool import protocol
from warmpool.registry import Changed, KvSlotStore, Removed, Snapshot

__all__ = ["SlotCounts", "SlotEvents"]


class SlotEvents:
    """`pulse_slots` as the view sees it, into the gauges and the controllers (`models`, the daemon's `Models`)."""

    def __init__(
        self,
        store: KvSlotStore,
        models: Models,
        *,
        contained: Callable[[str], AbstractContextManager[None]],
    ) -> None:
        self.store = store
        self.models = models
        self.contained = contained
        """The daemon's `Autoscaler._contained`: a bug in one model's handling is logged, counted and survived."""
        self.slot_counts = SlotCounts()
        """Slots per (model, state) from the slot view's events: the ``pulsescale_slots`` gauges."""

    async def follow_slots(self, stop: asyncio.Event) -> None:
        async for event in self.store.watch():
            if stop.is_set():
                return
            with self.contained("a slot change"):
                self._on_slot_event(event)

    def _on_slot_event(self, event: Snapshot[protocol.SlotRecord] | Changed[protocol.SlotRecord] | Removed) -> None:
        with self.contained("slot gauges"):
            for model, state in self.slot_counts.apply(event):
                c = self.models.by_model.get(model)
                if c is not None:
                    c.scaler.series.slots[state].set(self.slot_counts.count(model, state))
        if isinstance(event, Snapshot):
            for c in self.models.by_model.values():
                c.on_slot_snapshot(event.records)
            return
        record = event.record if isinstance(event, Changed) else None
        owner = self.models.by_model.get(event.key.split(".", 1)[0])  # keys are <model>.<node>.<slot>
        if owner is not None:
            owner.on_slot_change(event.key, record)

    def slot_gauges(self, c: ModelController) -> None:
        """Set a model's slot gauges from the counts (its controller was just made; events keep them after)."""
        for state, gauge in c.scaler.series.slots.items():
            gauge.set(self.slot_counts.count(c.model, state))


class SlotCounts:
    """Slots per (model, state), kept from the slot view's events instead of a scan of every slot per tick.
    Each key's last (model, state) is remembered, so an event is applied by what it changes, whatever the view
    skipped in between; a `Snapshot` (a reconnect) starts over from the listing."""

    __slots__ = ("_of", "counts")

    def __init__(self) -> None:
        self._of: dict[str, tuple[str, str]] = {}  # slot key -> (model, state) as last seen
        self.counts: dict[tuple[str, str], int] = {}

    def count(self, model: str, state: str) -> int:
        return self.counts.get((model, state), 0)

    def apply(
        self, event: Snapshot[protocol.SlotRecord] | Changed[protocol.SlotRecord] | Removed
    ) -> set[tuple[str, str]]:
        """Fold one event in; returns the (model, state) pairs whose count may have changed."""
        if isinstance(event, Snapshot):
            touched = set(self.counts)
            self._of.clear()
            self.counts.clear()
            for key, rec in event.records.items():
                self._add(key, (rec.model, rec.state))
            return touched | set(self.counts)
        new = (event.record.model, event.record.state) if isinstance(event, Changed) else None
        old = self._of.pop(event.key, None)
        if old == new:
            if new is not None:
                self._of[event.key] = new
            return set()
        if old is not None:
            left = self.counts[old] - 1
            if left:
                self.counts[old] = left
            else:
                del self.counts[old]
        if new is not None:
            self._add(event.key, new)
        return {p for p in (old, new) if p is not None}

    def _add(self, key: str, pair: tuple[str, str]) -> None:
        self._of[key] = pair
        self.counts[pair] = self.counts.get(pair, 0) + 1
