"""The daemon's HTTP port: ``/metrics`` (rendered in a thread), ``/healthz`` and ``/readyz``.

Request handling only: what the answers say (`Autoscaler.health`, `healthy`, `ready`) and the metrics' registry
are the daemon's, read through `Probed`. The daemon's `run` binds it when given a ``metrics_port``.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

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

    async def metrics(_: web.Request) -> web.Response:
        # Rendered in a worker thread: at 1,000 models a scrape renders ~20,000 series (tens of ms of CPU), which on
        # the event loop would hold up every sample and claim behind it; off it, the loop gets the GIL back every
        # switch interval (5 ms). prometheus_client's metrics take their own locks, so a concurrent render is safe.
        body = await asyncio.get_running_loop().run_in_executor(None, generate_latest, scaler.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

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
