"""`pulsescale bridge`: demand samples from metrics, for teams whose gateway does not publish on NATS.

It reads engines' Prometheus pages (vLLM's ``/metrics``: ``num_requests_waiting`` -> queue depth,
``num_requests_running`` -> in flight, ``request_success_total`` -> the counters) or PromQL queries against a
Prometheus server (one per model, its value the demand), and publishes each model's `QueueSample` on
``pulse.queue.<model>`` under its own gateway id, as a gateway would, with the gateway's own publisher
(`gateway.publisher`: every 100 ms and on change). The pages are the `--target`s and, with ``--slots``, each ready
slot's endpoint, followed in `pulse_slots` by the gateway's own `gateway.routes`. With ``--scaledobjects``, also
what the ScaledObjects' triggers name (contract revision 14: ``source: vllm-metrics`` or ``prometheus``), followed
in `pulse_scalers` by `bridge.scalers`; the flags win for a model they read.

A model whose sources fail or go stale past their bound is no longer published (`bridge.board`): the autoscaler
then sees a silent gateway and applies its staleness rule, instead of a figure nobody measured. Bad input is a
named, counted error per source (`bridge.errors`); the daemon keeps reading every other source.

A ready slot is read only as the gateway routes it (`gateway.routes`, contract revision 11): `pulse_assignments` is
followed, a node whose assignment does not list the slot's model is never read, and a node without one is read unless
``--require-assignment`` (the secure deployment's setting, as on the gateway: an agent may write a ``ready`` record of
any model pointing at a page it serves). No slot is read before the assignments are read or known absent.

It needs only the gateway NATS role (publish ``pulse.queue.>``; with ``--slots``, KV reads of `pulse_slots` and
`pulse_assignments`; with ``--scaledobjects``, of `pulse_scalers`, `pulse_slots` and `pulse_assignments`).
``/healthz`` and ``/metrics`` are on `settings.host`:`settings.port` (loopback unless told otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import aiohttp
from aiohttp import web
from nats.aio.client import Client
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from bridge.board import DemandBoard
from bridge.metrics import BridgeMetrics
from bridge.scalers import ScalerSources
from bridge.settings import BridgeSettings
from bridge.sources import Fetcher, Source, Sources
from gateway.publisher import Publisher
from gateway.queue import ModelQueue
from gateway.routes import Routes
from warmpool import daemonstart
from warmpool.errors import PulsescaleError
from warmpool.rejects import Rejections

__all__ = ["Bridge", "run"]

log = logging.getLogger("pulsescale.bridge")


class Bridge:
    """The daemon (module doc). `start()` serves and reads with `nc`; `close()` stops it."""

    def __init__(
        self,
        settings: BridgeSettings,
        nc: Client,
        *,
        metrics: BridgeMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        settings.check()
        self.settings = settings
        self.nc = nc
        self.metrics = metrics or BridgeMetrics()
        self._clock = clock
        self.board = DemandBoard(self.metrics, clock=clock, models=settings.models)
        # The publisher reads only `counts()` of each entry (`Publisher.sample`), which `ModelCounts` has; its
        # annotation names the gateway's queue type, hence the cast.
        self.publisher = Publisher(
            nc,
            settings.gateway_id,
            cast("dict[str, ModelQueue[Any]]", self.board.published),
            every_s=settings.sample_every_s,
            min_gap_s=settings.sample_min_gap_s,
            clock=clock,
            on_published=lambda model: self.metrics.samples.labels(model).inc(),
        )
        self.board.publisher = self.publisher
        self.rejected = Rejections(log, on_reject=lambda reason: self.metrics.rejected_records.labels(reason).inc())
        # The ready slots: the flags' (--slots), or those of models whose ScaledObject names them (--scaledobjects).
        self.routes = (
            Routes(
                nc,
                settings.models,
                on_ready=self._slot_ready,
                on_gone=self._slot_gone,
                rejected=self.rejected,
                require_assignment=settings.require_assignment,
            )
            if settings.slots or settings.scaledobjects
            else None
        )
        self.scalers: ScalerSources | None = None
        """With --scaledobjects, what the ScaledObjects' triggers name (`bridge.scalers`); made by `start`."""
        self.sources: Sources | None = None
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.port = settings.port

    # --- life ----------------------------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        # One connection per source at a time and no pool limit: a slow engine must not hold up the others' reads.
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=True)
        self.sources = Sources(Fetcher(self._session, s), self.board, self.metrics, clock=self._clock)
        try:
            await self._serve_http()
        except BaseException:
            await self.close()
            raise
        for t in s.targets:
            if not self.sources.add(self._target(t.url, t.model)):
                log.warning("target %s is given twice; read once, for %s", t.url, self.sources.by_id[t.url].model)
        for q in s.queries:
            assert s.prometheus_url is not None
            every, stale = s.query_every_s, s.query_stale_after_s
            self.sources.add(Source(f"query:{q.model}", "query", s.prometheus_url, q.model, every, stale, q.promql))
        self._tasks = [
            asyncio.create_task(self.publisher.run(self._stop), name="bridge-publisher"),
            asyncio.create_task(self._sweep(), name="bridge-sweep"),
        ]
        if self.routes is not None:
            self._tasks.append(asyncio.create_task(self.routes.run(self._stop), name="bridge-slots"))
        if s.scaledobjects:
            routes = self.routes
            assert routes is not None
            self.scalers = ScalerSources(
                self.nc, s, self.sources, self.rejected, ready_slots=lambda model: routes.table.get(model, {})
            )
            self._tasks.append(asyncio.create_task(self.scalers.run(self._stop), name="bridge-scaledobjects"))
        log.info(
            "bridge %s: %d target(s), %d quer(y/ies)%s%s; /metrics on http://%s:%d",
            s.gateway_id,
            len(s.targets),
            len(s.queries),
            (", the ready slots of pulse_slots" + (" (assigned nodes only)" if s.require_assignment else ""))
            if s.slots
            else "",
            ", what the ScaledObjects of pulse_scalers name (the flags win)" if s.scaledobjects else "",
            s.host,
            self.port,
        )

    def _target(self, url: str, model: str | None, *, key: str | None = None) -> Source:
        s = self.settings
        if key is not None:
            return Source(key, "slot", url, model, s.scrape_every_s, s.stale_after_s)
        return Source(url, "target", url, model, s.scrape_every_s, s.stale_after_s)

    async def _serve_http(self) -> None:
        app = web.Application()
        app.add_routes([web.get("/metrics", self.metrics_page), web.get("/healthz", self.healthz)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._runner = runner
        try:
            await web.TCPSite(runner, self.settings.host, self.settings.port).start()
        except OSError as err:
            raise PulsescaleError(
                f"cannot listen on {self.settings.host}:{self.settings.port}: {err.strerror or err}; pick another "
                "--listen"
            ) from None
        addresses = runner.addresses
        self.port = int(addresses[0][1]) if addresses else self.settings.port

    async def close(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.sources is not None:
            await self.sources.close()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> Bridge:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def crashed(self) -> BaseException | None:
        """The exception a background task died of, if one did."""
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                return t.exception()
        return None

    async def _sweep(self) -> None:
        """Takes a model out the moment its readings pass their bound, without waiting for the next read."""
        while not self._stop.is_set():
            self.board.wake.clear()
            at = self.board.next_check_at()
            timeout = None if at is None else max(at - self._clock(), 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.board.wake.wait(), timeout)

    # --- slots ---------------------------------------------------------------------------------------------------

    def _slot_ready(self, model: str, key: str, url: str) -> None:
        assert self.sources is not None
        if not self.settings.slots:  # only --scaledobjects: the ScaledObjects say which models' slots are read
            if self.scalers is not None:
                self.scalers.slot_ready(model, key, url)
            return
        page = url + self.settings.slot_metrics_path
        old = self.sources.by_id.get(key)
        if old is not None and old.url == page:
            return
        self.sources.remove(key)  # the same slot at a new endpoint: read there from now on
        if not self.sources.add(self._target(page, model, key=key)):
            log.info("slot %s: its page %s is read already (a --target); not read twice", key, page)

    def _slot_gone(self, model: str, key: str) -> None:
        assert self.sources is not None
        if not self.settings.slots:
            if self.scalers is not None:
                self.scalers.slot_gone(model, key)
            return
        self.sources.remove(key)

    # --- pages ---------------------------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        sources = self.sources.by_id.values() if self.sources is not None else ()
        return {
            "gateway": self.settings.gateway_id,
            "nats_connected": self.nc.is_connected,
            "slots_listed": self.routes.listed.is_set() if self.routes is not None else None,
            "assignments": self.routes.assigned.state if self.routes is not None else None,
            "sources": {
                s.id: {
                    "kind": s.kind,
                    "url": s.url,
                    "model": s.model,
                    "scaledobject": s.scaler,  # None: a flag or --config names it
                    "error": str(self.board.last_error[s.id]) if s.id in self.board.last_error else None,
                }
                for s in sources
            },
            "models": self.board.health(),
            "scaledobjects": self.scalers.health() if self.scalers is not None else None,
        }

    async def healthz(self, _: web.Request) -> web.Response:
        ok = self.nc.is_connected and self.crashed() is None
        return web.json_response(self.health(), status=200 if ok else 503)

    async def metrics_page(self, _: web.Request) -> web.Response:
        # On the loop, not in a thread (as the autoscaler renders its many series): the reading-age gauges read
        # the board, which only the loop may touch; the bridge has a few series per source and model.
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def run(
    settings: BridgeSettings,
    *,
    stop: asyncio.Event,
    ready: asyncio.Event | None = None,
    on_started: Callable[[Bridge], None] | None = None,
) -> None:
    """Run the bridge until `stop` is set (signal handling is the caller's)."""
    await daemonstart.serve_until_stopped(
        settings.nats, lambda nc: Bridge(settings, nc), stop, ready=ready, on_started=on_started
    )
