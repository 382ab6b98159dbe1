"""Ready endpoints per model, learned from `pulse_slots` (read only: the gateway role may not write it).

A slot is routable while its record says ``ready`` with an endpoint; the moment a change says anything else (or the
key is deleted) it is dropped. A snapshot (the first listing, and every re-list after a reconnect) replaces the whole
table, so a slot that left while the gateway was disconnected is dropped too. `ready_endpoints` is the pure part.

The endpoint is what the slot's agent wrote in its fenced ``ready`` write; only ``http``/``https`` URLs with a host
and no credentials, path or query are routed (an agent's typo must not point the gateway somewhere odd), others are
counted in `refused` and skipped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import nats.js.errors
from nats.aio.client import Client

from warmpool import protocol
from warmpool.errors import BadMessage
from warmpool.protocol import SlotRecord
from warmpool.registry import BucketView, Changed, Removed, Snapshot
from warmpool.rejects import Rejections

__all__ = ["Routes", "endpoint_ok", "ready_endpoints"]

log = logging.getLogger("pulsescale.gateway")

Table = dict[str, dict[str, str]]
"""model -> slot key -> endpoint URL."""


def endpoint_ok(url: str) -> bool:
    """An endpoint the gateway routes to: ``http(s)://host[:port]`` and nothing else."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a bad port
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and parts.username is None
        and parts.password is None
        and parts.path in ("", "/")
        and not parts.query
        and not parts.fragment
    )


def ready_endpoints(records: Iterable[SlotRecord], models: frozenset[str] | None) -> Table:
    """The routing table of `records`: ready slots with a good endpoint, of `models` (None: every model)."""
    table: Table = {}
    for r in records:
        if r.state == "ready" and r.endpoint and endpoint_ok(r.endpoint) and (models is None or r.model in models):
            table.setdefault(r.model, {})[r.key] = r.endpoint.rstrip("/")
    return table


class Routes:
    """Follows `pulse_slots` and calls `on_ready(model, key, url)` / `on_gone(model, key)` as slots come and go."""

    def __init__(
        self,
        nc: Client,
        models: frozenset[str] | None,
        *,
        on_ready: Callable[[str, str, str], None],
        on_gone: Callable[[str, str], None],
        rejected: Rejections,
    ) -> None:
        self._nc = nc
        self.models = models
        self._on_ready, self._on_gone = on_ready, on_gone
        self._rejected = rejected
        self.table: Table = {}
        self.view: BucketView[SlotRecord] | None = None
        self.listed = asyncio.Event()
        """Set once the first snapshot is in: before it, the gateway knows no endpoint yet."""

    async def open(self, stop: asyncio.Event, retry_s: float = 0.5) -> None:
        """Open the bucket, waiting while it does not exist yet (the autoscaler creates it; this role may not)."""
        said = False
        while not stop.is_set():
            try:
                kv = await self._nc.jetstream(timeout=2.0).key_value(protocol.SLOTS_BUCKET)
            except nats.js.errors.BucketNotFoundError:
                if not said:
                    log.info("waiting for bucket %s (the autoscaler creates it)", protocol.SLOTS_BUCKET)
                    said = True
                await asyncio.sleep(retry_s)
                continue
            self.view = BucketView(self._nc, kv, SlotRecord, self._rejected)
            return

    async def run(self, stop: asyncio.Event) -> None:
        await self.open(stop)
        view = self.view
        if view is None:
            return
        watch = asyncio.create_task(view.run(), name="gateway-slots-view")
        try:
            async for event in view.changes():
                self._apply(event)
                if stop.is_set():
                    break
        finally:
            view.closed = True
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    def _apply(self, event: Snapshot[SlotRecord] | Changed[SlotRecord] | Removed) -> None:
        if isinstance(event, Snapshot):
            new = ready_endpoints(event.records.values(), self.models)
            for model, slots in self.table.items():
                for key in slots.keys() - new.get(model, {}).keys():
                    self._on_gone(model, key)
            for model, slots in new.items():
                for key, url in slots.items():
                    if self.table.get(model, {}).get(key) != url:
                        self._on_ready(model, key, url)
            self.table = new
            self.listed.set()
            return
        try:
            model = protocol.parse_slot_key(event.key)[0]
        except BadMessage:
            return  # the view already refused such a record
        if self.models is not None and model not in self.models:
            return
        if isinstance(event, Changed) and event.record.state == "ready" and event.record.endpoint:
            url = event.record.endpoint
            if not endpoint_ok(url):
                log.warning("slot %s: endpoint %r is not http(s)://host[:port]; not routed", event.key, url)
            else:
                url = url.rstrip("/")
                if self.table.get(model, {}).get(event.key) != url:
                    self.table.setdefault(model, {})[event.key] = url
                    self._on_ready(model, event.key, url)
                return
        if self.table.get(model, {}).pop(event.key, None) is not None:
            self._on_gone(model, event.key)
