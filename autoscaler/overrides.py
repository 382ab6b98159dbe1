"""The on-call overrides a replica keeps in `pulse_leases`, under ``protocol.override_key(model)``.

`StoredOverrides.save` writes one as the command service sets it (a resume deletes it), so the next owner of the
model's shard restores it; `StoredOverrides.load` reads them all back when shards are taken
(`autoscaler.ownership`). A stored one the command service could not have accepted is counted and not obeyed. It
counts the writes it makes, so a take-over that read before a write does not put back what it read. The daemon
composes it.
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

from autoscaler import commands
from warmpool import protocol
from warmpool.buckets import list_keys
from warmpool.errors import BadMessage
from warmpool.protocol import Override, OverrideRecord
from warmpool.registry import KvSlotStore

__all__ = ["OVERRIDE_READS_AT_ONCE", "StoredOverrides"]

OVERRIDE_READS_AT_ONCE = 32
"""Stored overrides read in parallel when shards are taken (`StoredOverrides.load`)."""

log = logging.getLogger("pulsescale.autoscaler")


class StoredOverrides:
    """The on-call overrides in `pulse_leases` (`leases_kv`), by model: written here, read back on a take-over."""

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
        """`AutoscalerSettings.max_replicas`: a stored override over it is refused (`_check_stored`)."""
        self.writes: dict[str, int] = {}  # model -> on-call overrides set here (see `Ownership.take_over`)
        self._leases_kv = leases_kv
        self._rejected_overrides: set[tuple[str, int | None]] = set()  # (key, revision) of stored ones refused

    async def save(self, model: str, override: Override | None) -> None:
        """Store the override under the model's key, or (None) delete it: `Autoscaler.set_override`'s write."""
        key = protocol.override_key(model)
        # Counted before the write: an `Ownership.take_over` that read the stored overrides before it does not
        # restore them.
        self.writes[model] = self.writes.get(model, 0) + 1
        if override is None:
            with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                await self._leases_kv.delete(key)
        else:
            await self._leases_kv.put(key, protocol.encode(OverrideRecord(model=model, override=override)))

    async def load(self) -> dict[str, Override]:
        """The on-call overrides stored in `pulse_leases`, by model. One that breaks the contract is counted (by
        reason, in the registry's rejections) and logged, and its model runs on the policy."""
        out: dict[str, Override] = {}
        try:
            js = self.nc.jetstream(timeout=2.0)
            keys = await list_keys(js, protocol.LEASES_BUCKET, protocol.OVERRIDE_KEY_PREFIX)
        except (nats.errors.Error, TimeoutError) as err:
            log.warning("cannot list the stored overrides (%s); models run on the policy until one is set", err)
            return out
        # Read at once, a few dozen at a time: the list holds every override ever cleared too (a delete marker
        # stays), and one read after another would hold up the first decisions of a takeover.
        reads = asyncio.Semaphore(OVERRIDE_READS_AT_ONCE)

        async def read(key: str) -> None:
            source = f"{protocol.LEASES_BUCKET}/{key}"
            try:
                async with reads:
                    entry = await self._leases_kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                return  # resumed (deleted), now or before
            except (nats.errors.Error, TimeoutError) as err:
                log.warning("cannot read %s (%s); its model runs on the policy", source, err)
                return
            try:
                record = protocol.decode(entry.value or b"", OverrideRecord)
                if protocol.override_key(record.model) != key:
                    raise BadMessage("subject_mismatch", f"an override of {record.model} stored under {key}")
                self._check_stored(record.override)
            except BadMessage as err:
                if (key, entry.revision) not in self._rejected_overrides:  # counted once, however often read
                    self._rejected_overrides.add((key, entry.revision))
                    self.store.rejected(err, source=source)
                return
            out[record.model] = record.override

        await asyncio.gather(*(read(k) for k in keys))
        return out

    def _check_stored(self, override: Override) -> None:
        """A stored override must be one the command service could have accepted: none of ours expires more than
        `commands.MAX_OVERRIDE_S` from now (a clock skew's worth more is tolerated) or holds more replicas than
        `max_replicas`. Anything else was written around the command service, and is not obeyed."""
        now = self.clock()
        limit = now + commands.MAX_OVERRIDE_S + protocol.MAX_CLOCK_SKEW_S
        if override.expires_at is not None and override.expires_at > limit:
            raise BadMessage(
                "too_late",
                f"override expires {override.expires_at - now:.0f} s from now; at most "
                f"{commands.MAX_OVERRIDE_S:.0f} s is accepted",
            )
        if override.replicas is not None and override.replicas > self.max_replicas:
            cap = self.max_replicas
            raise BadMessage("bad_value", f"override holds {override.replicas} replicas, over the limit of {cap}")
