"""The on-call overrides a replica keeps in `pulse_leases`, under ``protocol.override_key(model)``.

`StoredOverrides.save` writes one as the command service sets it (a resume deletes it), so the next owner of the
model's shard restores it; `StoredOverrides.load` reads them all back when shards are taken
(`autoscaler.ownership`). A stored one the command service could not have accepted is counted and not obeyed. It
counts the writes it makes, so a take-over that read before a write does not put back what it read. The daemon
composes it.
"""

from __future__ import annotations

from collections.abc import Callable

from nats.aio.client import Client
from nats.js.kv import KeyValue

from autoscaler.stored.records import READS_AT_ONCE, StoredRecords
from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import Override, OverrideRecord
from warmpool.registry import KvSlotStore

__all__ = ["OVERRIDE_READS_AT_ONCE", "StoredOverrides"]

OVERRIDE_READS_AT_ONCE = READS_AT_ONCE
"""Stored overrides read in parallel when shards are taken (`StoredOverrides.load`)."""


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
        self.clock = clock
        self.max_replicas = max_replicas
        """`AutoscalerSettings.max_replicas`: a stored override over it is refused (`_check_stored`)."""
        self._records = StoredRecords(
            nc,
            leases_kv,
            store,
            kind=OverrideRecord,
            prefix=protocol.OVERRIDE_KEY_PREFIX,
            key_of=protocol.override_key,
            model_of=lambda r: r.model,
            what="an override",
        )

    @property
    def writes(self) -> dict[str, int]:
        """Model -> on-call overrides set here (see `Ownership.take_over`)."""
        return self._records.writes

    async def save(self, model: str, override: Override | None) -> None:
        """Store the override under the model's key, or (None) delete it: `Autoscaler.set_override`'s write."""
        record = None if override is None else OverrideRecord(model=model, override=override)
        await self._records.put(model, record)

    async def load(self) -> dict[str, Override]:
        """The on-call overrides stored in `pulse_leases`, by model (none when they cannot be listed: models run
        on the policy until one is set). One that breaks the contract is counted (by reason, in the registry's
        rejections) and logged, and its model runs on the policy."""
        got = await self._records.read_all(lambda r: self._check_stored(r.override), unread="the policy")
        return {model: r.override for model, r in (got or {}).items()}

    def _check_stored(self, override: Override) -> None:
        """A stored override must be one the command service could have accepted: none of ours expires more than
        `protocol.MAX_OVERRIDE_S` from now (a clock skew's worth more is tolerated) or holds more replicas than
        `max_replicas`. Anything else was written around the command service, and is not obeyed."""
        now = self.clock()
        limit = now + protocol.MAX_OVERRIDE_S + protocol.MAX_CLOCK_SKEW_S
        if override.expires_at is not None and override.expires_at > limit:
            raise BadMessage(
                "too_late",
                f"override expires {override.expires_at - now:.0f} s from now; at most "
                f"{protocol.MAX_OVERRIDE_S:.0f} s is accepted",
            )
        if override.replicas is not None and override.replicas > self.max_replicas:
            cap = self.max_replicas
            raise BadMessage("bad_value", f"override holds {override.replicas} replicas, over the limit of {cap}")
