"""Per-model records a replica keeps in `pulse_leases` for the next owner of the model's shard: the on-call
overrides (`autoscaler.stored.overrides`) and schedules (`autoscaler.stored.schedules`).

`StoredRecords.put` writes a model's record (None deletes the key) and counts the writes it makes, so a take-over
that read before a write does not put back what it read (`Ownership.take_over`); `StoredRecords.read_all` reads
every record under the kind's key prefix back when shards are taken, a few dozen at a time (the list holds every
key ever cleared too: a delete marker stays, and one read after another would hold up a take-over's first
decisions). A record that breaks the contract, or that the command service could not have accepted (`check`), is
counted once per revision (by reason, in the registry's rejections) and not obeyed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from warmpool import protocol
from warmpool.buckets import list_keys
from warmpool.errors import BadMessage
from warmpool.registry import KvSlotStore

__all__ = ["READS_AT_ONCE", "StoredRecords"]

READS_AT_ONCE = 32
"""Stored records read in parallel when shards are taken (`StoredRecords.read_all`)."""

log = logging.getLogger("pulsescale.autoscaler")

R = TypeVar("R", bound=protocol.Message)


class StoredRecords(Generic[R]):
    """One kind of per-model record in `pulse_leases` (`leases_kv`): `key_of(model)` under `prefix`, of type
    `kind`, whose `model_of(record)` names its model."""

    def __init__(
        self,
        nc: Client,
        leases_kv: KeyValue,
        store: KvSlotStore,
        *,
        kind: type[R],
        prefix: str,
        key_of: Callable[[str], str],
        model_of: Callable[[R], str],
        what: str,
    ) -> None:
        self.nc = nc
        self.store = store
        self.writes: dict[str, int] = {}  # model -> writes made here (see `Ownership.take_over`)
        self._leases_kv = leases_kv
        self._kind, self._prefix, self._key_of, self._model_of, self._what = kind, prefix, key_of, model_of, what
        self._rejected: set[tuple[str, int | None]] = set()  # (key, revision) of stored records refused

    async def put(self, model: str, record: R | None) -> None:
        """Store `record` under the model's key, or (None) delete it."""
        key = self._key_of(model)
        self.writes[model] = self.writes.get(model, 0) + 1  # before the write: see `Ownership.take_over`
        if record is None:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await self._leases_kv.delete(key)
        else:
            await self._leases_kv.put(key, protocol.encode(record))

    async def read_all(self, check: Callable[[R], None], *, unread: str) -> dict[str, R] | None:
        """Every stored record that passes `check` (which raises `BadMessage`), by model; None when the keys
        cannot be listed. `unread` says in a log line what a model whose record cannot be read runs on."""
        try:
            js = self.nc.jetstream(timeout=2.0)
            keys = await list_keys(js, protocol.LEASES_BUCKET, self._prefix)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("cannot list %s/%s* (%s)", protocol.LEASES_BUCKET, self._prefix, err)
            return None
        out: dict[str, R] = {}
        reads = asyncio.Semaphore(READS_AT_ONCE)

        async def read(key: str) -> None:
            source = f"{protocol.LEASES_BUCKET}/{key}"
            try:
                async with reads:
                    entry = await self._leases_kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return  # cleared (deleted), now or before
            except (nats.errors.Error, TimeoutError) as err:
                log.warning("cannot read %s (%s); its model runs on %s", source, err, unread)
                return
            try:
                record = protocol.decode(entry.value or b"", self._kind)
                model = self._model_of(record)
                if self._key_of(model) != key:
                    raise BadMessage("subject_mismatch", f"{self._what} of {model} stored under {key}")
                check(record)
            except BadMessage as err:
                if (key, entry.revision) not in self._rejected:  # counted once, however often read
                    self._rejected.add((key, entry.revision))
                    self.store.rejected(err, source=source)
                return
            out[model] = record

        await asyncio.gather(*(read(k) for k in keys))
        return out
