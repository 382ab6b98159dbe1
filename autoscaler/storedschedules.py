"""The on-call schedules a replica keeps in `pulse_leases`, under ``protocol.schedule_key(model)`` (revision 8).

`StoredSchedules.save` writes a model's on-call schedules (``pulsescale schedule``) as the command service sets them
(none left: the key is deleted), so the next owner of the model's shard restores them; `StoredSchedules.load`
reads them all back when shards are taken (`autoscaler.ownership`), as `autoscaler.overrides` does for overrides.
A stored record the command service could not have written (a floor over the autoscaler's limit) is counted and
not obeyed. It counts the writes it makes, so a take-over that read before a write does not put back what it read.
The daemon composes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.buckets import list_keys
from warmpool.errors import BadMessage
from warmpool.protocol import OnCallSchedule, ScheduleRecord
from warmpool.registry import KvSlotStore

__all__ = ["StoredSchedules"]

READS_AT_ONCE = 32
"""Stored schedule records read in parallel when shards are taken."""

log = logging.getLogger("pulsescale.autoscaler")


class StoredSchedules:
    """The on-call schedules in `pulse_leases` (`leases_kv`), by model: written here, read back on a take-over."""

    def __init__(
        self,
        nc: Client,
        leases_kv: KeyValue,
        store: KvSlotStore,
        *,
        clock: Callable[[], float],
        max_replicas: int,
    ) -> None:
        self.nc = nc
        self.store = store
        self.clock = clock
        self.max_replicas = max_replicas
        """`AutoscalerSettings.max_replicas`: a stored floor over it is refused."""
        self.writes: dict[str, int] = {}  # model -> writes made here (see `Ownership.take_over`)
        self._leases_kv = leases_kv
        self._rejected: set[tuple[str, int | None]] = set()  # (key, revision) of stored records refused

    async def save(self, model: str, schedules: tuple[OnCallSchedule, ...]) -> None:
        """Store the model's on-call schedules; with none, delete the key."""
        key = protocol.schedule_key(model)
        self.writes[model] = self.writes.get(model, 0) + 1  # before the write: see `Ownership.take_over`
        if not schedules:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await self._leases_kv.delete(key)
        else:
            record = ScheduleRecord(model=model, schedules=list(schedules))
            await self._leases_kv.put(key, protocol.encode(record))

    async def load(self) -> dict[str, tuple[OnCallSchedule, ...]] | None:
        """The on-call schedules stored in `pulse_leases`, by model; None when they cannot be listed (the models
        keep what they had). A record that breaks the contract is counted (by reason, in the registry's
        rejections) and logged, and its model runs on its ScaledObject's schedules alone."""
        out: dict[str, tuple[OnCallSchedule, ...]] = {}
        try:
            js = self.nc.jetstream(timeout=2.0)
            keys = await list_keys(js, protocol.LEASES_BUCKET, protocol.SCHEDULE_KEY_PREFIX)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("cannot list the stored schedules (%s); models keep the on-call schedules they had", err)
            return None
        reads = asyncio.Semaphore(READS_AT_ONCE)

        async def read(key: str) -> None:
            source = f"{protocol.LEASES_BUCKET}/{key}"
            try:
                async with reads:
                    entry = await self._leases_kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return
            except (nats.errors.Error, TimeoutError) as err:
                log.warning("cannot read %s (%s); its model runs on its ScaledObject's schedules", source, err)
                return
            try:
                record = protocol.decode(entry.value or b"", ScheduleRecord)
                if protocol.schedule_key(record.model) != key:
                    raise BadMessage("subject_mismatch", f"schedules of {record.model} stored under {key}")
                for s in record.schedules:
                    if s.schedule.replicas > self.max_replicas:
                        raise BadMessage(
                            "bad_value",
                            f"schedule {s.schedule.name} holds {s.schedule.replicas} replicas, over the limit of "
                            f"{self.max_replicas}",
                        )
            except BadMessage as err:
                if (key, entry.revision) not in self._rejected:
                    self._rejected.add((key, entry.revision))
                    self.store.rejected(err, source=source)
                return
            out[record.model] = tuple(record.schedules)

        await asyncio.gather(*(read(k) for k in keys))
        return out
