"""The hook's NATS connection, made and kept off the request path: `run` connects in the background and tries
again while the server is away; `publish` sends a sample when connected and drops it otherwise.

Dropping is the point: nats-py buffers what is published while it reconnects and sends it all on reconnect, a burst
of stale samples; and a gateway that cannot reach NATS has nothing useful to say later. Its counters go on, so the
first sample after the outage carries every request of it. Each outage is logged once, when it starts, and once
when it ends; never per sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client

from warmpool import connect
from warmpool.errors import PulsescaleError

__all__ = ["NatsLink"]

log = logging.getLogger("pulsescale.litellm")

_FIRST_RETRY_S = 0.25
_CLOSED_POLL_S = 1.0  # how soon a connection nats-py gave up on is noticed (it retries forever: rare)

Connector = Callable[..., Awaitable[Client]]


class NatsLink:
    """One NATS connection for the hook's samples (module doc). `connected` says whether a publish goes out now."""

    def __init__(
        self, opts: connect.NatsOptions, *, reconnect_max_s: float, connector: Connector = connect.connect
    ) -> None:
        self.opts = opts
        self.reconnect_max_s = reconnect_max_s
        self._connector = connector
        self.nc: Client | None = None
        self.published_total = 0
        self.dropped_total = 0
        """Samples not sent because no connection was up."""
        self._down_since_logged = False

    @property
    def connected(self) -> bool:
        return self.nc is not None and self.nc.is_connected

    async def publish(self, subject: str, payload: bytes) -> None:
        """What `gateway.publisher.Publisher` calls for each sample."""
        nc = self.nc
        if nc is None or not nc.is_connected:
            self.dropped_total += 1
            return
        await nc.publish(subject, payload)
        self.published_total += 1

    async def run(self, stop: asyncio.Event) -> None:
        """Connect, and again whenever the connection is closed for good, until `stop`; then close."""
        delay_s = _FIRST_RETRY_S
        try:
            while not stop.is_set():
                try:
                    nc = await self._connector(self.opts, on_disconnect=self._lost, on_reconnect=self._back)
                except PulsescaleError as err:  # NatsUnavailable, NatsUnreachable, BadInput: what connect names
                    self._down(f"cannot connect to NATS: {err}")
                    await _wait(stop, delay_s)
                    delay_s = min(delay_s * 2, self.reconnect_max_s)
                    continue
                delay_s = _FIRST_RETRY_S
                self.nc = nc
                self._up()
                while not stop.is_set() and not nc.is_closed:
                    await _wait(stop, _CLOSED_POLL_S)
                if not stop.is_set():
                    self._down("the NATS connection was closed")
        finally:
            last, self.nc = self.nc, None
            if last is not None and not last.is_closed:
                with contextlib.suppress(Exception):  # closing: nothing left to report to
                    await last.close()

    async def _lost(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            self._down("lost the NATS connection, reconnecting")

    async def _back(self) -> None:
        self._up()

    def _down(self, why: str) -> None:
        if not self._down_since_logged:
            log.warning(
                "pulsescale: %s (%s): requests are still counted; samples resume when NATS is back",
                why,
                ", ".join(self.opts.servers),
            )
            self._down_since_logged = True

    def _up(self) -> None:
        url = self.nc.connected_url if self.nc is not None else None
        where = url.netloc if url is not None else ", ".join(self.opts.servers)
        if self._down_since_logged:
            log.warning("pulsescale: NATS at %s is back: publishing demand samples again", where)
        else:
            log.info("pulsescale: connected to NATS at %s: publishing demand samples", where)
        self._down_since_logged = False


async def _wait(stop: asyncio.Event, timeout_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout_s)
