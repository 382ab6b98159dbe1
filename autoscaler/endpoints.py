"""The daemon's HTTP port: ``/metrics`` (`autoscaler.exposition`: what changed since the last scrape, rendered on
the loop in slices), ``/healthz`` and ``/readyz``.

Request handling only: what the answers say (`Autoscaler.health`, `healthy`, `ready`) and the metrics' registry
are the daemon's, read through `Probed`. The daemon's `run` binds it when given a ``metrics_port``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from autoscaler.exposition import RENDER_SLICE_S
from autoscaler.metrics import AutoscalerMetrics
from warmpool.errors import PulsescaleError

__all__ = ["Probed", "serve_http"]


class Probed(Protocol):
    """What the port answers from (`autoscaler.daemon.Autoscaler` implements it)."""

    @property
    def metrics(self) -> AutoscalerMetrics: ...

    def health(self) -> dict[str, Any]:
        """The body of ``/healthz`` and ``/readyz``."""
        ...

    def healthy(self) -> bool:
        """``/healthz`` answers 200, else 503."""
        ...

    def ready(self) -> bool:
        """``/readyz`` answers 200, else 503."""
        ...


async def serve_http(scaler: Probed, host: str, port: int) -> tuple[web.AppRunner, int]:
    """``/metrics``, ``/healthz`` and ``/readyz`` on `host`:`port`; returns the runner and the bound port."""

    async def metrics(request: web.Request) -> web.StreamResponse:
        # Not in a thread: rendering 1,000 models' ~110,000 series there took 1.5-2.5 s of CPU a scrape, holding the
        # GIL for most of it. Only the series written since the last scrape are rendered, in slices of a few ms.
        names = request.query.getall("name[]", [])  # as prometheus_client's handler: only these sample names
        parts = await scaler.metrics.exposition.render(frozenset(names) if names else None)
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE_LATEST})
        response.content_length = sum(len(part) for part in parts)
        await response.prepare(request)
        until = time.perf_counter() + RENDER_SLICE_S
        for part in parts:
            # A write waits only while the socket's buffer is full: to a fast reader, megabytes go out in one step
            # of the loop unless it yields.
            await response.write(part)
            if time.perf_counter() >= until:
                await asyncio.sleep(0)
                until = time.perf_counter() + RENDER_SLICE_S
        await response.write_eof()
        return response

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response(scaler.health(), status=200 if scaler.healthy() else 503)

    async def readyz(_: web.Request) -> web.Response:
        return web.json_response(scaler.health(), status=200 if scaler.ready() else 503)

    app = web.Application()
    app.add_routes([web.get("/metrics", metrics), web.get("/healthz", healthz), web.get("/readyz", readyz)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except OSError as err:
        await runner.cleanup()
        raise PulsescaleError(
            f"cannot serve metrics on {host}:{port}: {err.strerror or err}; pick another --metrics-port"
        ) from None
    addresses = runner.addresses
    return runner, int(addresses[0][1]) if addresses else port
