"""The on-call schedules a replica keeps in `pulse_leases`, under ``protocol.schedule_key(model)`` (revision 8).

`StoredSchedules.save` writes a model's on-call schedules (``pulsescale schedule``) as the command service sets them
(none left: the key is deleted), so the next owner of the model's shard restores them; `StoredSchedules.load`
reads them all back when shards are taken (`autoscaler.ownership`), as `autoscaler.stored.overrides` does for overrides.
A stored record the command service could not have written (a floor over the autoscaler's limit) is counted and
not obeyed. It counts the writes it makes, so a take-over that read before a write does not put back what it read.
The daemon composes it.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.stored.records import StoredRecords
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import OnCallSchedule, ScheduleRecord
from warmpool.registry import KvSlotStore

__all__ = ["StoredSchedules"]


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
        self.clock = clock
        self.max_replicas = max_replicas
        """`AutoscalerSettings.max_replicas`: a stored floor over it is refused."""
        self._records = StoredRecords(
            nc,
            leases_kv,
            store,
            kind=ScheduleRecord,
            prefix=protocol.SCHEDULE_KEY_PREFIX,
            key_of=protocol.schedule_key,
            model_of=lambda r: r.model,
            what="schedules",
        )

    @property
    def writes(self) -> dict[str, int]:
        """Model -> writes made here (see `Ownership.take_over`)."""
        return self._records.writes

    async def save(self, model: str, schedules: tuple[OnCallSchedule, ...]) -> None:
        """Store the model's on-call schedules; with none, delete the key."""
        record = ScheduleRecord(model=model, schedules=list(schedules)) if schedules else None
        await self._records.put(model, record)

    async def load(self) -> dict[str, tuple[OnCallSchedule, ...]] | None:
        """The on-call schedules stored in `pulse_leases`, by model; None when they cannot be listed (the models
        keep what they had). A record that breaks the contract is counted (by reason, in the registry's
        rejections) and logged, and its model runs on its ScaledObject's schedules alone."""
        got = await self._records.read_all(self._check, unread="its ScaledObject's schedules")
        return None if got is None else {model: tuple(r.schedules) for model, r in got.items()}

    def _check(self, record: ScheduleRecord) -> None:
        for s in record.schedules:
            if s.schedule.replicas > self.max_replicas:
                raise BadMessage(
                    "bad_value",
                    f"schedule {s.schedule.name} holds {s.schedule.replicas} replicas, over the limit of "
                    f"{self.max_replicas}",
                )
