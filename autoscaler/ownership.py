"""The shards this replica holds, and what it does as they come and go: the reactions to `ShardLeases`.

A shard taken (`Ownership.on_shard_acquired`) is taken over in one task (`Ownership.take_over`): its models adopt
the slots held for them, get their stored on-call overrides and schedules back (`autoscaler.stored.overrides`,
`autoscaler.stored.schedules`), start, and decide; a
model whose ScaledObject arrives in a shard already held is taken over the same way. A shard lost
(`Ownership.on_shard_lost`) stops its models at once; claims in flight are left for the next owner. Either way the
leadership gauges, the sample subscriptions (`autoscaler.subscriptions`) and the command service follow. The
daemon composes it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

from autoscaler.controller import ModelController
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.models import Models
from autoscaler.shards.leases import INVOLUNTARY
from autoscaler.stored.overrides import StoredOverrides
from autoscaler.stored.schedules import StoredSchedules
from warmpool import protocol
from warmpool.protocol import OnCallSchedule, Override
from warmpool.registry import KvSlotStore

__all__ = ["Ownership"]

log = logging.getLogger("pulsescale.autoscaler")


class Ownership:
    """The held shards' models taken over and stopped (their tables: `models`, the daemon's `Models`)."""

    def __init__(
        self,
        store: KvSlotStore,
        overrides: StoredOverrides,
        models: Models,
        *,
        metrics: AutoscalerMetrics,
        contained: Callable[[str], AbstractContextManager[None]],
        clock: Callable[[], float],
        slice_s: float,
        schedules: StoredSchedules | None = None,
    ) -> None:
        self.store = store
        self.overrides = overrides
        self.schedules = schedules
        """The on-call schedules stored in `pulse_leases` (None: not kept, as in tests of the overrides alone)."""
        self.models = models
        """The controllers by model and shard, the shards held (`Models.held`: this class keeps it), the leases and
        the command service."""
        self.metrics = metrics
        self.contained = contained
        """The daemon's `Autoscaler._contained`: a bug in one model's handling is logged, counted and survived."""
        self.clock = clock
        self.slice_s = slice_s
        self.arrived: set[str] = set()  # models whose ScaledObject came in a shard already held, for `take_over`
        self.resigning = False  # a clean resign is not a lost lease
        self._acquired: set[int] = set()  # shards taken, waiting for `take_over`
        self._stopping: dict[str, asyncio.Future[None]] = {}  # models whose lost shard's stop may still run
        self._takeover: asyncio.Task[None] | None = None  # held so the task is not garbage-collected mid-run

    def on_shard_acquired(self, shard: int) -> None:
        """`ShardLeases.on_acquired`: act for the shard's models once `take_over` has adopted their slots."""
        self.models.held.add(shard)
        self._acquired.add(shard)
        self._leading_changed()
        self.take_over_soon()

    def take_over_soon(self) -> None:
        if self._takeover is None or self._takeover.done():
            self._takeover = asyncio.ensure_future(self.take_over())

    def on_shard_lost(self, shard: int) -> None:
        """`ShardLeases.on_lost`: stop acting for the shard's models at once; claims in flight are left for the
        next owner to adopt or expire. Called synchronously, also from inside a fenced `owns` check."""
        shards = self.models.shards
        why = shards.last_loss if shards is not None else ""
        if why in INVOLUNTARY and not self.resigning:
            self.metrics.lease_lost.inc()
        self.models.held.discard(shard)
        self._acquired.discard(shard)
        for model in list(self.models.by_shard.get(shard, ())):
            c = self.models.by_model.get(model)
            if c is not None:
                task = asyncio.ensure_future(c.stop(release_in_flight=False))  # its claims are forgotten once stopped
                task.add_done_callback(functools.partial(_log_failed_stop, c))
                self._stopping[model] = task
        self._leading_changed()

    def _leading_changed(self) -> None:
        leading = bool(self.models.held)
        self.metrics.leader.set(1 if leading else 0)
        self.metrics.shards_held.set(len(self.models.held))
        self.models.subjects_changed.set()
        service = self.models.commands
        if service is not None:
            service.on_leadership(leading)

    async def take_over(self) -> None:
        """Rebuild the shards just taken from the buckets: adopt their models' held slots, restore their
        overrides, then act; the same for models whose ScaledObject arrived in a shard already held. Those taken
        or arrived while this runs are handled in the same task, overrides read once per batch. (Adopting and
        starting are idempotent: a model met twice is harmless.)"""
        overrides: dict[str, Override] | None = None
        writes: dict[str, int] = {}
        stored_schedules: dict[str, tuple[OnCallSchedule, ...]] | None = None
        schedule_writes: dict[str, int] = {}
        read_at = 0.0
        while self._acquired or self.arrived:
            batch, self._acquired = self._acquired, set()
            arrived, self.arrived = self.arrived, set()
            if overrides is None or time.monotonic() - read_at > 1.0:
                # One read for the shards of a round (they are taken one by one, within milliseconds).
                writes = dict(self.overrides.writes)
                read_at, overrides = time.monotonic(), await self.overrides.load()
                if self.schedules is not None:
                    schedule_writes = dict(self.schedules.writes)
                    stored_schedules = await self.schedules.load()
            todo = [(shard, model) for shard in sorted(batch) for model in sorted(self.models.by_shard.get(shard, ()))]
            todo += [(protocol.shard_of(m), m) for m in sorted(arrived) if protocol.shard_of(m) not in batch]
            # First adopt and start every model, so a sample arriving now acts; then the first decisions.
            started: list[tuple[ModelController, float]] = []  # and when each started
            until = time.perf_counter() + self.slice_s
            for shard, model in todo:
                if time.perf_counter() >= until:
                    # 1,000 models' adoption and first decision is a few hundred ms: renewals run between.
                    await asyncio.sleep(0)
                    until = time.perf_counter() + self.slice_s
                stopping = self._stopping.pop(model, None)
                if stopping is not None and not stopping.done():
                    # Lost and taken back in one round: the old term's stop must end (and forget its books)
                    # before this one adopts and starts, or it would undo them.
                    await asyncio.wait([stopping])
                c = self.models.by_model.get(model)
                if c is None or not self.models.owns_shard(shard):
                    continue  # its ScaledObject went while we yielded, or the shard moved on meanwhile
                with self.contained(f"taking over {model}"):
                    override = overrides.get(model)
                    if self.overrides.writes.get(model, 0) != writes.get(model, 0):
                        override = None  # one set here since the read is newer than it (a resume's delete too)
                    schedules = None
                    written = self.schedules.writes.get(model, 0) if self.schedules is not None else 0
                    if stored_schedules is not None and written == schedule_writes.get(model, 0):
                        # Also none stored: deleted while another replica owned it.
                        schedules = stored_schedules.get(model, ())
                    c.take_over(self.store.records(model), override=override, schedules=schedules)
                    started.append((c, self.clock()))
            for c, began in started:
                if time.perf_counter() >= until:
                    await asyncio.sleep(0)
                    until = time.perf_counter() + self.slice_s
                if self.models.by_model.get(c.model) is c and c.deps.owns() and not c.decided_since(began):
                    # (Its first sample since it started, arriving meanwhile, may have decided it: not twice.)
                    with self.contained(f"the first decision of {c.model}"):
                        c.evaluate(self.clock())
            where = f"shard(s) {','.join(map(str, sorted(batch)))}" if batch else "shards already held"
            log.info("acting for %d more model(s) in %s", len(started), where)


def _log_failed_stop(c: ModelController, stopped: asyncio.Future[None]) -> None:
    if not stopped.cancelled() and stopped.exception() is not None:
        log.error("%s: stopping after deposition failed: %s", c.model, stopped.exception())
