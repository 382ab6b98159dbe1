"""The models of the published ScaledObjects, from KV `pulse_scalers` (read only), for `gateway.catalog`.

Followed with the registry's `BucketView` (a snapshot, then changes; re-listed after a reconnect; a record that
breaks the contract is counted and the last good one kept, as the autoscaler does). A bucket that does not exist
means no ScaledObject anywhere (``absent``: looked for again every `retry_s`); one that does not answer means this
NATS user may not read it (nats-server refuses such a request without a reply) or JetStream is down
(``unreadable``: said once in the log with the fix, asked again with a growing pause).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.client import Client

from gateway.catalog import Catalog, ScalersState
from warmpool import buckets, protocol
from warmpool.bucketview import BucketView
from warmpool.protocol import ScalerRecord
from warmpool.rejects import Rejections

__all__ = ["Scalers"]

log = logging.getLogger("pulsescale.gateway")


class Scalers:
    """Tells `catalog` which models have a ScaledObject; `on_change()` after each change."""

    def __init__(
        self,
        nc: Client,
        catalog: Catalog,
        rejected: Rejections,
        *,
        on_change: Callable[[], None] = lambda: None,
        retry_s: float = 2.0,
        open_timeout_s: float = 2.0,
    ) -> None:
        self._nc = nc
        self.catalog = catalog
        self._rejected = rejected
        self._on_change = on_change
        self._retry_s = retry_s
        self._open_timeout_s = open_timeout_s
        self.view: BucketView[ScalerRecord] | None = None

    def _state(self, state: ScalersState, why: str = "") -> None:
        if state == self.catalog.scalers:
            return
        if state == "unreadable":
            log.warning(
                "cannot read %s (%s): models without a ready slot are refused (503 models_not_listed) until it is "
                "read; give this gateway's NATS user KV reads of %s, or pass --models",
                protocol.SCALERS_BUCKET,
                why,
                protocol.SCALERS_BUCKET,
            )
        elif state == "absent":
            log.info("bucket %s does not exist (yet): no ScaledObject names a model", protocol.SCALERS_BUCKET)
        self.catalog.set_scalers(state)
        self._on_change()

    async def run(self, stop: asyncio.Event) -> None:
        def on_view(view: BucketView[ScalerRecord]) -> None:
            self.view = view

        def on_event(view: BucketView[ScalerRecord], _: object) -> None:
            self.catalog.set_scaled(r.spec.model for r in view.values())
            self._on_change()

        await buckets.follow_view(
            self._nc, protocol.SCALERS_BUCKET, ScalerRecord, self._rejected, stop,
            on_state=self._state, on_view=on_view, on_event=on_event, keep_bad=True, name="gateway-scalers-view",
            retry_s=self._retry_s, open_timeout_s=self._open_timeout_s,
        )  # fmt: skip
